"""Recording sends and recvs in the forward pass, and the recv node that acts in backward.

For every message that carries tensors requiring grad, the sender detaches those tensors and
keeps a ``SendRecord``; the receiver passes them through :class:`_RecvFunction`, an autograd
node whose backward hands the gradients of its outputs to the backward phase running in the
context (which ships them to the sender). The recv node knows the context and the message,
never the engine.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

from distgrad.rpc import _context, _identity
from distgrad.rpc._context import DistAutogradContext
from distgrad.rpc._records import RecvRecord, SendRecord, Target, target_of

__all__ = ["attach_recv", "detach_for_send", "is_recv_node"]

_RECV_NODE_NAME = "_RecvFunctionBackward"


def is_recv_node(node: Any) -> bool:
    """Whether an autograd node is the recv node of a message (its ``message_id`` names it)."""
    return type(node).__name__ == _RECV_NODE_NAME


class _RecvFunction(torch.autograd.Function):
    """Identity in forward; in backward, hands the gradients to the running phase."""

    @staticmethod
    def forward(
        ctx: Any, context_id: int, message_id: int, anchor: Tensor, *tensors: Tensor
    ) -> Any:
        ctx.set_materialize_grads(False)  # unused outputs stay None and are not shipped as zeros
        # Ids only, no record: a record holding the node that holds the record would be a cycle
        # through C++ that the garbage collector cannot see.
        ctx.context_id = context_id
        ctx.message_id = message_id
        # detach(): a new tensor on the same memory. Returning an input as is would make
        # autograd take a view of it, which sparse tensors do not have.
        return tuple(t.detach() for t in tensors)

    @staticmethod
    def backward(ctx: Any, *grads: Tensor | None) -> Any:
        _context.lookup(ctx.context_id).hand_back(ctx.message_id, list(grads))
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
        ctx.know(to_worker)
        if not sent:
            return out, None, []
        message_id = _identity.new_id()
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
        ctx.know(from_worker)
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
