"""Send and recv records: where a worker's local autograd graph meets another worker's.

For every message that carries tensors requiring grad, the sender records a :class:`SendRecord`
(the tensors it sent, which are the edges into its local graph) and the receiver passes the
tensors through :class:`_RecvFunction`, an autograd node whose backward ships the incoming
gradients back to the sender. Both halves share one autograd message id, unique across workers.

In backward, a gradient message for message id ``m`` arrives at the sender, which looks up
``sends[m]`` and runs its local engine from those tensors with the received gradients.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeAlias

import torch
from torch import Tensor
from torch.autograd.graph import GradientEdge, get_gradient_edge

from distgrad.rpc import _agent
from distgrad.rpc.context import DistAutogradContext

__all__ = [
    "RecvRecord",
    "SendRecord",
    "Target",
    "attach_recv",
    "detach_for_send",
    "edge_of",
    "is_recv_node",
    "target_of",
]

_RECV_NODE_NAME = "_RecvFunctionBackward"


def is_recv_node(node: Any) -> bool:
    """Whether an autograd node is the recv node of a message."""
    return type(node).__name__ == _RECV_NODE_NAME


# Where a sent tensor's gradient enters this worker's graph: a leaf is kept as itself; any
# other tensor as its gradient edge (its grad_fn and output number). The edge keeps the graph
# but not the tensor's data, which can be freed as soon as the message is sent, and it still
# names the value that was sent if the tensor is later modified in place.
Target: TypeAlias = "Tensor | GradientEdge"


def target_of(t: Tensor) -> Target:
    return t if t.grad_fn is None else get_gradient_edge(t)


def edge_of(target: Target) -> GradientEdge:
    return target if isinstance(target, GradientEdge) else get_gradient_edge(target)


@dataclass
class SendRecord:
    """The sending half of a pair: where the sent tensors' gradients enter, and where they went."""

    message_id: int
    to_worker: str
    targets: list[Target]
    leaves: list[Tensor] | None = None  # leaves reachable from ``targets``, found on first use
    reach: dict[int, Any] | None = None  # SMART: id -> node for every node reachable
    recvs_reached: list[tuple[int, str]] | None = None  # SMART: (recv message id, its sender)


@dataclass
class RecvRecord:
    """The receiving half of a pair: the sender to ship gradients to."""

    message_id: int
    from_worker: str
    context_id: int
    num_outputs: int


class _RecvFunction(torch.autograd.Function):
    """Identity in forward; in backward, ships the gradients to the sender and returns none."""

    @staticmethod
    def forward(
        ctx: Any, context_id: int, message_id: int, anchor: Tensor, *tensors: Tensor
    ) -> Any:
        ctx.set_materialize_grads(False)  # unused outputs stay None and are not shipped as zeros
        # Ids only, no record: a record holding the node that holds the record would be a cycle
        # through C++ that the garbage collector cannot see.
        ctx.context_id = context_id
        ctx.message_id = message_id
        return tensors

    @staticmethod
    def backward(ctx: Any, *grads: Tensor | None) -> Any:
        from distgrad.rpc.fast import ship_gradients

        ship_gradients(ctx.context_id, ctx.message_id, list(grads))
        return (None, None, None, *[None] * len(grads))


def _map_tensors(obj: Any, fn: Callable[[Tensor], Tensor]) -> Any:
    """``obj`` with ``fn`` applied to every tensor inside lists, tuples and dicts, in order."""
    if isinstance(obj, Tensor):
        return fn(obj)
    if isinstance(obj, list):
        return [_map_tensors(x, fn) for x in obj]
    if isinstance(obj, tuple):
        mapped = [_map_tensors(x, fn) for x in obj]
        if hasattr(obj, "_fields"):  # namedtuple
            return type(obj)(*mapped)
        return tuple(mapped)
    if isinstance(obj, dict):
        return {k: _map_tensors(v, fn) for k, v in obj.items()}
    return obj


def _tensors_in(obj: Any, found: list[Tensor]) -> None:
    """Append the tensors inside ``obj`` to ``found``, in :func:`_map_tensors`'s order."""
    if isinstance(obj, Tensor):
        found.append(obj)
    elif isinstance(obj, (list, tuple)):
        for x in obj:
            _tensors_in(x, found)
    elif isinstance(obj, dict):
        for x in obj.values():
            _tensors_in(x, found)


def detach_for_send(
    ctx: DistAutogradContext, to_worker: str, payload: Any
) -> tuple[Any, int | None, list[int]]:
    """Detach the tensors in ``payload`` that require grad and record a send for them.

    Returns the payload to transmit, the message id (``None`` if nothing requires grad) and the
    positions, in traversal order, of the tensors that required grad.
    """
    sent: list[Target] = []
    positions: list[int] = []
    counter = [0]

    def detach(t: Tensor) -> Tensor:
        index = counter[0]
        counter[0] += 1
        if t.requires_grad and torch.is_grad_enabled():
            sent.append(target_of(t))
            positions.append(index)
            return t.detach()
        return t

    out = _map_tensors(payload, detach)
    with ctx.lock:
        ctx.known_workers.add(to_worker)
        if not sent:
            return out, None, []
        message_id = _agent.new_id()
        ctx.sends[message_id] = SendRecord(message_id, to_worker, sent)
    return out, message_id, positions


def attach_recv(
    ctx: DistAutogradContext,
    from_worker: str,
    payload: Any,
    message_id: int | None,
    positions: list[int],
) -> Any:
    """Pass the tensors at ``positions`` through a recv node of message ``message_id``."""
    with ctx.lock:
        ctx.known_workers.add(from_worker)
    if message_id is None:
        return payload
    every: list[Tensor] = []
    _tensors_in(payload, every)
    found = [every[i] for i in positions]
    record = RecvRecord(message_id, from_worker, ctx.context_id, len(found))
    with torch.enable_grad():
        outputs = _RecvFunction.apply(  # type: ignore[no-untyped-call]
            ctx.context_id, message_id, ctx.anchor, *found
        )
    with ctx.lock:
        ctx.recvs[message_id] = record
    replaced: dict[int, Tensor] = dict(zip(positions, outputs, strict=True))
    counter = [0]

    def substitute(t: Tensor) -> Tensor:
        index = counter[0]
        counter[0] += 1
        return replaced.get(index, t)

    return _map_tensors(payload, substitute)
