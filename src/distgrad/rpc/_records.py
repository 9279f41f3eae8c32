"""What the forward pass records where one worker's graph meets another's (pure data).

For every message that carries tensors requiring grad, the sender keeps a :class:`SendRecord`
(where each sent tensor's gradient enters its local graph) and the receiver a
:class:`RecvRecord` (whom to send the gradients back to). Both halves share one autograd
message id, unique across workers.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, TypeAlias

import torch
from torch import Tensor
from torch.autograd.graph import GradientEdge, get_gradient_edge

__all__ = [
    "Leaf",
    "Lineage",
    "RecvRecord",
    "SendRecord",
    "Target",
    "edge_of",
    "node_of",
    "target_of",
]

# Where a sent tensor's gradient enters this worker's graph: a leaf is kept as itself; any
# other tensor as its gradient edge (its grad_fn and output number). The edge keeps the graph
# but not the tensor's data, which can be freed as soon as the message is sent, and it still
# names the value that was sent if the tensor is later modified in place.
Target: TypeAlias = "Tensor | GradientEdge"

# A leaf tensor requiring grad and its AccumulateGrad node (found by walking the graph).
Leaf: TypeAlias = "tuple[Tensor, Any]"

# Worker name -> ids of its sends: the sends whose gradients a send's gradient can reach
# (SMART's lineage; ``None`` where it was too large to carry and must be asked for).
Lineage: TypeAlias = "dict[str, frozenset[int]]"


def target_of(t: Tensor) -> Target:
    if t.grad_fn is None:
        return t
    if t.layout == torch.strided:
        return get_gradient_edge(t)
    # get_gradient_edge keeps a Python-defined node's graph alive through a view of ``t``,
    # which sparse tensors do not have; a clone's node holds the graph the same way.
    with torch.enable_grad():
        token = t.clone().grad_fn
    return GradientEdge(t.grad_fn, t.output_nr, token)


def node_of(target: Target) -> Any:
    """The node a target's gradient enters: the edge's node, or a leaf's AccumulateGrad."""
    if isinstance(target, GradientEdge):
        return target.node
    if target.grad_fn is not None:
        return target.grad_fn
    # torch keeps a leaf's AccumulateGrad only weakly; an op's graph names it (view_as is the
    # cheapest op, clone the one sparse tensors have).
    if not torch.is_grad_enabled():
        with torch.enable_grad():
            return node_of(target)
    op = target.view_as(target) if target.layout == torch.strided else target.clone()
    return op.grad_fn.next_functions[0][0]  # type: ignore[union-attr]


def edge_of(target: Target) -> GradientEdge:
    return target if isinstance(target, GradientEdge) else GradientEdge(node_of(target), 0)


@dataclass
class SendRecord:
    """The sending half of a pair: where the sent tensors' gradients enter, and where they went.

    ``lineage``: the sends on every worker that this send's gradient reaches, found when it
    was sent (``None``: too many to carry). The last three fields are caches: the leaves below
    the targets (FAST; found by the lineage walk when the send is recorded, else on first
    use), and every node below them with the recv messages they reach (SMART, on first use).
    """

    message_id: int
    to_worker: str
    targets: list[Target]
    lineage: Lineage | None = None
    leaves: list[Leaf] | None = None
    reach: dict[int, Any] | None = None  # id(node) -> node
    recvs_reached: list[tuple[int, str]] | None = None  # (recv message id, its sender)


@dataclass
class RecvRecord:
    """The receiving half of a pair: the sender to ship gradients to, and the lineage of the
    sender's send (carried in the message; ``None`` if unknown)."""

    message_id: int
    from_worker: str
    context_id: int
    num_outputs: int
    lineage: Lineage | None = None
