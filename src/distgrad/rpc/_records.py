"""What the forward pass records where one worker's graph meets another's (pure data).

For every message that carries tensors requiring grad, the sender keeps a :class:`SendRecord`
(where each sent tensor's gradient enters its local graph) and the receiver a
:class:`RecvRecord` (whom to send the gradients back to). Both halves share one autograd
message id, unique across workers.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, TypeAlias

from torch import Tensor
from torch.autograd.graph import GradientEdge, get_gradient_edge

__all__ = ["Leaf", "RecvRecord", "SendRecord", "Target", "edge_of", "target_of"]

# Where a sent tensor's gradient enters this worker's graph: a leaf is kept as itself; any
# other tensor as its gradient edge (its grad_fn and output number). The edge keeps the graph
# but not the tensor's data, which can be freed as soon as the message is sent, and it still
# names the value that was sent if the tensor is later modified in place.
Target: TypeAlias = "Tensor | GradientEdge"

# A leaf tensor requiring grad and its AccumulateGrad node (found by walking the graph).
Leaf: TypeAlias = "tuple[Tensor, Any]"


def target_of(t: Tensor) -> Target:
    return t if t.grad_fn is None else get_gradient_edge(t)


def edge_of(target: Target) -> GradientEdge:
    return target if isinstance(target, GradientEdge) else get_gradient_edge(target)


@dataclass
class SendRecord:
    """The sending half of a pair: where the sent tensors' gradients enter, and where they went.

    The last three fields are caches filled on first use by a backward pass: the leaves below
    the targets (FAST), and every node below them with the recv messages they reach (SMART).
    """

    message_id: int
    to_worker: str
    targets: list[Target]
    leaves: list[Leaf] | None = None
    reach: dict[int, Any] | None = None  # id(node) -> node
    recvs_reached: list[tuple[int, str]] | None = None  # (recv message id, its sender)


@dataclass
class RecvRecord:
    """The receiving half of a pair: the sender to ship gradients to."""

    message_id: int
    from_worker: str
    context_id: int
    num_outputs: int
