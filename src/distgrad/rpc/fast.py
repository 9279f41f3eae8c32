"""FAST mode: every gradient that arrives flows on at once.

1. The root worker runs its local engine from the roots. Whenever the engine reaches a recv
   node, that node ships the gradients it got to the worker that sent the tensors (one message
   carrying the context id and the autograd message id), without waiting.
2. A worker that receives gradients for message ``m`` runs its local engine from the tensors of
   ``sends[m]`` with those gradients; its own recv nodes ship further in the same way.
3. A worker answers a gradient message only after the messages its own phase shipped have been
   answered (``_pass``), and gradients for the worker it answers ride back in the answer.

Each gradient message flows on as soon as it arrives, so no worker waits for a send that will
never receive a gradient (torch's FAST mode waits there until its RPC timeout). The price: a
local subgraph reached by several messages runs once per message, with partial gradients (the
sum is right because backward is linear; tensor hooks see the partial gradients). SMART mode
runs it once.
"""

from __future__ import annotations

from collections.abc import Sequence

from torch import Tensor

from distgrad.errors import RpcAutogradError
from distgrad.rpc import _identity, _local
from distgrad.rpc._context import ANCHOR, DistAutogradContext, counters, lookup
from distgrad.rpc._pass import Pass, as_backward_error, deadline_after, drain, in_flight, phase
from distgrad.rpc._records import Leaf, SendRecord, Target, node_of
from distgrad.rpc._wire import GradientMessage, Reply

__all__ = ["receive", "run_from_roots"]


def run_from_roots(
    ctx: DistAutogradContext,
    pass_id: int,
    budget: float,
    roots: Sequence[Tensor],
    grads: Sequence[Tensor],
    foreign: frozenset[int],
) -> None:
    """The root's side of a FAST pass; ``foreign``: memory of gradients the user passed in."""
    active = Pass(ctx, pass_id, deadline_after(budget), receive)
    leaves = _local.walk(r.grad_fn for r in roots).leaves
    with in_flight(ctx):
        _run_phase(ctx, active, list(roots), list(grads), leaves, foreign)
        drain(ctx, active, _run_reply)


def receive(message: GradientMessage) -> list[Reply]:
    """RPC handler: run this worker's part of the pass from ``sends[message.message_id]``.

    Returns the gradients this part produced for the sender's own sends, which the sender runs
    when the answer arrives.
    """
    counters["gradient_messages_received"] += 1
    try:
        ctx = lookup(message.context_id)
        active = Pass(ctx, message.pass_id, deadline_after(message.budget), receive, message.sender)
        with in_flight(ctx):
            _run_reply(ctx, active, Reply(message.message_id, message.grads))
            drain(ctx, active, _run_reply)
        return active.replies
    except Exception as exc:
        raise as_backward_error(exc, _identity.worker_name()) from None


def _run_reply(ctx: DistAutogradContext, active: Pass, reply: Reply) -> None:
    """Run the gradients for ``sends[reply.message_id]`` (a message or an answer's reply)."""
    record = _send(ctx, reply.message_id)
    starts: list[Target] = []
    grads: list[Tensor] = []
    for target, grad in zip(record.targets, reply.grads, strict=True):
        if grad is not None:
            starts.append(target)
            grads.append(grad)
    if starts:
        _run_phase(ctx, active, starts, grads, _leaves_below(record), frozenset())


def _run_phase(
    ctx: DistAutogradContext,
    active: Pass,
    starts: list[Target],
    grads: list[Tensor],
    leaves: list[Leaf],
    foreign: frozenset[int],
) -> None:
    # The graph is kept: a later message of the same pass may reach the same nodes.
    with phase(ctx, active):
        taken = _local.run(starts, grads, leaves, (ANCHOR,), ddp=ctx.ddp)
        ctx.store(taken, foreign)


def _send(ctx: DistAutogradContext, message_id: int) -> SendRecord:
    with ctx.lock:
        record = ctx.sends.get(message_id)
    if record is None:
        raise RpcAutogradError(
            f"no send with autograd message id {message_id} in context {ctx.context_id}"
        )
    return record


def _leaves_below(record: SendRecord) -> list[Leaf]:
    if record.leaves is None:  # found once per send (or when it was sent; see send_recv)
        record.leaves = _local.walk(node_of(t) for t in record.targets).leaves
    return record.leaves
