"""What the forward pass records where one worker's graph meets another's (pure data).

For every message that carries tensors requiring grad, the sender keeps a :class:`SendRecord`
(where each sent tensor's gradient enters its local graph) and the receiver a
:class:`RecvRecord` (whom to send the gradients back to). Both halves share one autograd
message id, unique across workers.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TypeAlias

import torch
from torch import Tensor
from torch.autograd.graph import GradientEdge, Node, get_gradient_edge

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

# Where a sent tensor's gradient enters this worker's graph: its gradient edge (its grad_fn and
# output number; a leaf's AccumulateGrad, with a node that owns it: see target_of). The edge
# keeps the graph but not the tensor's data, which can be freed as soon as the message is
# sent, and it still names the value that was sent if the tensor is later modified in place.
# (Bare tensors are still accepted where a target is read.)
Target: TypeAlias = "Tensor | GradientEdge"

# A leaf tensor requiring grad and its AccumulateGrad node (found by walking the graph).
Leaf: TypeAlias = "tuple[Tensor, Node]"

# Worker name -> ids of its sends: the sends whose gradients a send's gradient can reach
# (SMART's lineage; ``None`` where it was too large to carry and must be asked for).
Lineage: TypeAlias = "dict[str, frozenset[int]]"


def target_of(t: Tensor) -> GradientEdge:
    """The gradient edge of a tensor requiring grad, with a node that owns its graph in C++.

    For a leaf the owner matters: torch keeps a leaf's AccumulateGrad only weakly, and when
    the only owner left is its Python wrapper, any thread that reaches the leaf's accumulator
    (an op on the leaf, ``view_as`` included) does so holding the leaf's autograd mutex and
    then waits for the GIL to take the wrapper. A thread holding the GIL and waiting for that
    mutex (torch's ``backward`` from the leaf itself, a custom Function applied to it) then
    deadlocked with it: two threads, each with a context and a backward over the same leaf,
    hung 1 run in 14 (issue 20 item 5). The owner here (a view's node, whose edge holds the
    accumulator in C++) lives as long as the record, so no thread ever needs the GIL there.
    """
    if t.grad_fn is not None and t.layout == torch.strided:
        return get_gradient_edge(t)
    # A view's node owns the graph below it (get_gradient_edge's own trick for Python-defined
    # nodes); sparse tensors have no views, and a clone's node holds the graph the same way.
    with torch.enable_grad():
        token = (t.view_as(t) if t.layout == torch.strided else t.clone()).grad_fn
    assert token is not None
    node = t.grad_fn if t.grad_fn is not None else token.next_functions[0][0]
    assert node is not None  # a view's (or clone's) node has the leaf's accumulator below it
    return GradientEdge(node, t.output_nr, token)


def node_of(target: Target) -> Node:
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
    node = op.grad_fn.next_functions[0][0]  # type: ignore[union-attr]
    assert node is not None  # the leaf requires grad: its accumulator is below the op
    return node


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
    reach: dict[int, Node] | None = None  # id(node) -> node
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
