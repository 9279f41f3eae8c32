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
from torch.autograd.graph import Node

from distgrad.rpc import _context, _identity
from distgrad.rpc._context import DistAutogradContext
from distgrad.rpc._records import Leaf, Lineage, RecvRecord, SendRecord, Target, node_of, target_of

__all__ = ["attach_recv", "detach_for_send", "is_recv_node", "message_id_of"]

_RECV_NODE_NAME = "_RecvFunctionBackward"


def is_recv_node(node: Node) -> bool:
    """Whether an autograd node is the recv node of a message (its ``message_id`` names it)."""
    return type(node).__name__ == _RECV_NODE_NAME


def message_id_of(recv_node: Node) -> int:
    """The message id of a recv node (set on the node's context in forward)."""
    message_id: int = recv_node.message_id  # type: ignore[attr-defined]
    return message_id


class _RecvFunction(torch.autograd.Function):
    """Identity in forward; in backward, hands the gradients to the running phase."""

    @staticmethod
    def forward(
        ctx: Any, context_id: int, message_id: int, anchor: Tensor, *tensors: Tensor
    ) -> tuple[Tensor, ...]:
        ctx.set_materialize_grads(False)  # unused outputs stay None and are not shipped as zeros
        # Ids only, no record: a record holding the node that holds the record would be a cycle
        # through C++ that the garbage collector cannot see.
        ctx.context_id = context_id
        ctx.message_id = message_id
        # detach(): a new tensor on the same memory. Returning an input as is would make
        # autograd take a view of it, which sparse tensors do not have.
        return tuple(t.detach() for t in tensors)

    @staticmethod
    def backward(ctx: Any, *grads: Tensor | None) -> tuple[None, ...]:
        _context.lookup(ctx.context_id).hand_back(ctx.message_id, list(grads))
        return (None, None, None, *[None] * len(grads))


# torch's C apply, without ``Function.apply``'s Python wrapper: outside functorch transforms
# that wrapper only unwraps dead functorch wrappers (received tensors are never any). 13 us
# against 20 us per recv node, hot; a round trip makes two.
_apply_recv: Callable[..., tuple[Tensor, ...]] = torch._C._FunctionBase.__dict__["apply"].__get__(
    None, _RecvFunction
)


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


class _Detacher:
    """Detaches the tensors that require grad, remembering their targets and positions."""

    def __init__(self) -> None:
        self.index = 0
        self.targets: list[Target] = []
        self.positions: list[int] = []

    def __call__(self, t: Tensor) -> Tensor:
        index = self.index
        self.index += 1
        if not t.requires_grad:
            return t
        self.targets.append(target_of(t))
        self.positions.append(index)
        return t.detach()


class _Substituter:
    """Replaces the tensors at chosen positions (in traversal order) with given ones."""

    def __init__(self, replaced: dict[int, Tensor]) -> None:
        self.index = 0
        self.replaced = replaced

    def __call__(self, t: Tensor) -> Tensor:
        index = self.index
        self.index += 1
        return self.replaced.get(index, t)


def detach_for_send(
    ctx: DistAutogradContext, to_worker: str, payload: Any
) -> tuple[Any, int | None, list[int], Lineage | None]:
    """Detach the tensors in ``payload`` that require grad and record a send for them.

    Returns the payload to transmit, the message id (``None`` if nothing requires grad), the
    positions, in traversal order, of the tensors that required grad, and the send's lineage.
    """
    if not torch.is_grad_enabled():
        with ctx.lock:
            ctx.know(to_worker)
        return payload, None, [], None
    detacher = _Detacher()
    out = _map_tensors(payload, detacher)
    with ctx.lock:
        ctx.know(to_worker)
        if not detacher.targets:
            return out, None, [], None
        message_id = _identity.new_id()
        lineage, leaves = _lineage_below(ctx, detacher.targets)
        ctx.sends[message_id] = SendRecord(message_id, to_worker, detacher.targets, lineage, leaves)
    return out, message_id, detacher.positions, lineage


# A send's lineage is found when it is sent by walking the graph below its tensors, so that
# SMART needs no lineage query for it; the walk stops after this many nodes (the lineage is
# then left for SMART to ask for), so that FAST, which never uses it, pays little.
_LINEAGE_WALK_NODES = 64
_LINEAGE_SIZE = 64


def _lineage_below(
    ctx: DistAutogradContext, targets: list[Target]
) -> tuple[Lineage | None, list[Leaf] | None]:
    """The sends on every worker that gradients entering ``targets`` reach (holds the lock),
    and the leaves below ``targets`` (what FAST's ``SendRecord.leaves`` caches).

    Each recv reached contributes its sender's send and that send's own lineage, which came
    with it. The lineage is ``None`` if the walk or the lineage grows too large, or a recv's is
    unknown; the leaves are ``None`` if the walk grows too large (FAST then walks in backward).
    """
    stack: list[Node | None] = [node_of(t) for t in targets]
    # The walk finds the leaves too, so that FAST does not walk the same graph again in
    # backward (on a round trip's callee that walk took 46-51 us of a live step, loaded
    # 2-core machine; now 3 us).
    leaves: list[Leaf] | None = []
    found: dict[str, set[int]] = {}
    seen: set[int] = set()
    known = True
    while stack:
        node = stack.pop()
        if node is None or id(node) in seen:
            continue
        seen.add(id(node))
        if len(seen) > _LINEAGE_WALK_NODES:
            return None, None
        if is_recv_node(node):
            record = ctx.recvs[message_id_of(node)]
            if record.lineage is None:
                known = False
                continue
            found.setdefault(record.from_worker, set()).add(record.message_id)
            for worker, ids in record.lineage.items():
                found.setdefault(worker, set()).update(ids)
            continue
        variable = getattr(node, "variable", None)
        if isinstance(variable, Tensor):  # a leaf's AccumulateGrad, as in _local.walk
            if leaves is not None:
                leaves.append((variable, node))
            continue
        stack.extend(n for n, _ in node.next_functions)
    if not known or sum(len(ids) for ids in found.values()) > _LINEAGE_SIZE:
        return None, leaves
    return {worker: frozenset(ids) for worker, ids in found.items()}, leaves


def attach_recv(
    ctx: DistAutogradContext,
    from_worker: str,
    payload: Any,
    message_id: int | None,
    positions: list[int],
    lineage: Lineage | None,
) -> Any:
    """Pass the tensors at ``positions`` through a recv node of message ``message_id``."""
    if message_id is None:
        with ctx.lock:
            ctx.know(from_worker)
        return payload
    if isinstance(payload, Tensor):  # a call's result, most often
        found = [payload]
    else:
        every: list[Tensor] = []
        _tensors_in(payload, every)
        found = [every[i] for i in positions]
    apply = _apply_recv if not torch._C._are_functorch_transforms_active() else _RecvFunction.apply
    if torch.is_grad_enabled():
        outputs = apply(ctx.context_id, message_id, _context.ANCHOR, *found)
    else:
        with torch.enable_grad():
            outputs = apply(ctx.context_id, message_id, _context.ANCHOR, *found)
    with ctx.lock:
        ctx.know(from_worker)
        ctx.recvs[message_id] = RecvRecord(
            message_id, from_worker, ctx.context_id, len(found), lineage
        )
    if isinstance(payload, Tensor):
        return outputs[0]
    return _map_tensors(payload, _Substituter(dict(zip(positions, outputs, strict=True))))


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
