"""The distributed backward pass (FAST mode) and the messages that carry gradients.

FAST mode, as distgrad runs it:

1. The root worker runs its local engine from the roots. Whenever the engine reaches a recv
   node, that node ships the gradients it got to the worker that sent the tensors (one RPC,
   carrying the context id and the autograd message id), without waiting.
2. A worker that receives gradients for message ``m`` runs its local engine from the tensors of
   ``sends[m]`` with those gradients; its own recv nodes ship further in the same way.
3. Every worker answers a gradient message only after the messages its own phase shipped have
   been answered, so when the root's messages are answered the whole pass is over. Errors travel
   back along the same answers; the first one is raised at the root, naming the worker where it
   started.
4. Gradients bound for the worker whose message a phase is answering do not travel as a message
   of their own: they ride back in the answer, and that worker runs them when the answer comes.
   On the common round trip (the root calls a worker, the worker returns a result) the whole
   backward is then one RPC instead of two nested ones.

Each gradient message flows on as soon as it arrives, so no worker waits for a send that will
never receive a gradient (PyTorch's FAST mode hangs there). The price: a local subgraph reached
by several messages runs once per message, with partial gradients (the sum is right because
backward is linear; tensor hooks see the partial gradients). SMART mode runs it once.

Gradients for leaves accumulate in the context (``get_gradients``), never in ``.grad``.
"""

from __future__ import annotations

import re
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import Tensor
from torch.autograd.graph import GradientEdge
from torch.distributed import rpc as torch_rpc

from distgrad.errors import RpcAutogradError
from distgrad.rpc import _agent
from distgrad.rpc.context import (
    DistAutogradContext,
    _Pass,
    counters,
    fills_its_storage,
    lookup,
    storage_of,
)
from distgrad.rpc.send_recv import RecvRecord, SendRecord, Target, edge_of

__all__ = ["backward", "ship_gradients"]

_MARKER = "distributed backward failed on "
_HOP_MARGIN_S = 0.5  # each hop gives its callee this much less time, so the deepest error wins


def find_leaves(outputs: Sequence[Target]) -> list[Tensor]:
    """Every leaf tensor requiring grad reachable backwards from ``outputs``, in a stable order."""
    leaves: dict[int, Tensor] = {}
    seen: set[int] = set()
    stack: list[Any] = []
    for t in outputs:
        if isinstance(t, GradientEdge):
            stack.append(t.node)
        elif t.grad_fn is None:
            leaves.setdefault(id(t), t)
        else:
            stack.append(t.grad_fn)
    while stack:
        node = stack.pop()
        if node is None or id(node) in seen:
            continue
        seen.add(id(node))
        variable = getattr(node, "variable", None)
        if isinstance(variable, Tensor):
            leaves.setdefault(id(variable), variable)
        stack.extend(next_node for next_node, _ in node.next_functions)
    return list(leaves.values())


def run_phase(
    ctx: DistAutogradContext,
    outputs: Sequence[Target],
    grads: list[Tensor],
    leaves: list[Tensor],
    owned: bool = False,
) -> None:
    """Run the local engine from ``outputs`` and add the leaves' gradients to the context.

    The caller holds ``ctx.lock`` and has set ``ctx.active_pass``. The graph is retained: a
    later message of the same pass may reach the same nodes.
    """
    sent_leaves = [t for t in outputs if isinstance(t, Tensor) and t.grad_fn is None]
    if (
        owned
        and len(sent_leaves) == len(outputs)
        and not any(t._backward_hooks for t in sent_leaves)
    ):
        # The message's tensors are leaves of this worker (a round trip's arguments, say):
        # their gradients are the ones that arrived, and the engine has nothing to run.
        for leaf, grad in zip(sent_leaves, grads, strict=True):
            ctx.accumulate(leaf, grad)
        return
    inputs = [*leaves, ctx.anchor]
    counters["engine_runs"] += 1
    # The engine takes tensors or edges, not a mix (as typed): a leaf's edge is its own.
    starts = [edge_of(t) for t in outputs]
    found = torch.autograd.grad(starts, inputs, grads, retain_graph=True, allow_unused=True)
    # A leaf that is also an output gets its given gradient back as is; copy it only if the
    # caller may still hold it (gradients that arrived over RPC are ours alone).
    given = {id(g) for g in grads} if not owned else set()
    for leaf, grad in zip(leaves, found[:-1], strict=True):
        if grad is not None:
            ctx.accumulate(leaf, grad.clone() if id(grad) in given else grad)


Reply = tuple[int, list[Tensor | None]]  # (autograd message id, gradients) for the receiver


def ship_gradients(context_id: int, message_id: int, grads: list[Tensor | None]) -> None:
    """Called by a recv node in backward: send ``grads`` to the worker that sent the tensors."""
    ctx = lookup(context_id)
    record = ctx.recvs[message_id]
    active = ctx.active_pass
    assert active is not None, "a recv node ran outside a distributed backward phase"
    if ride_back(active, record, grads):
        return
    budget = max(active.deadline - time.monotonic() - _HOP_MARGIN_S, 0.1)
    call = torch_rpc.rpc_async(
        record.from_worker,
        receive_gradients,
        args=(
            record.context_id,
            record.message_id,
            grads,
            active.pass_id,
            budget,
            _agent.worker_name(),
        ),
        timeout=budget,
    )
    active.outgoing.append((record.from_worker, call.then(with_owned_gradients)))
    counters["gradient_messages_sent"] += 1


def ride_back(active: _Pass, record: RecvRecord, grads: list[Tensor | None]) -> bool:
    """Count the gradients a recv ships; if their sender is the worker this phase answers,
    put them in the answer and return True (both modes). Otherwise the caller sends them."""
    counters["gradient_tensors_sent"] += sum(g is not None for g in grads)
    if record.from_worker != active.reply_to:
        return False
    active.replies.append((record.message_id, grads))
    counters["gradient_replies_sent"] += 1
    return True


def with_owned_gradients(answer: Any) -> list[Reply]:
    """An answer's gradients, each copied to memory of its own if it shares or skips any.

    Runs on the RPC thread that completes the answer, so that the copies the context would
    otherwise make on the waiting (user's) thread are made here, as PyTorch makes its copies on
    its engine's threads. Besides moving work off the training step's thread, it avoids a
    measured slow mode: in some processes glibc gives the main thread's freed heap back to the
    system after every step, and there two 4 MB copies took about 1,900 page faults per step
    (a 1000x1000 round trip's backward: 4.4 ms instead of 1.8 ms), against none here.
    """
    replies: list[Reply] = answer.wait() or []
    seen: set[int] = set()
    owned: list[Reply] = []
    for message_id, grads in replies:
        mine: list[Tensor | None] = []
        for grad in grads:
            if grad is not None:
                if storage_of(grad) in seen or not fills_its_storage(grad):
                    # An add's backward sends one expanded tensor for both inputs, say.
                    grad = grad.clone(memory_format=torch.contiguous_format)
                seen.add(storage_of(grad))
            mine.append(grad)
        owned.append((message_id, mine))
    return owned


def receive_gradients(
    context_id: int,
    message_id: int,
    grads: list[Tensor | None],
    pass_id: int,
    budget: float,
    sender: str,
) -> list[Reply]:
    """RPC handler: run this worker's part of the pass from ``sends[message_id]``.

    Returns the gradients this part produced for ``sender``'s own sends, which ``sender`` runs
    when the answer arrives.
    """
    me = _agent.worker_name()
    counters["gradient_messages_received"] += 1
    try:
        ctx = lookup(context_id)
        outputs, given, leaves = _message_inputs(ctx, message_id, grads)
        return _run_and_wait(
            ctx, pass_id, budget, outputs, given, leaves, owned=True, reply_to=sender
        )
    except Exception as exc:
        raise _as_backward_error(exc, me) from None


def _message_inputs(
    ctx: DistAutogradContext, message_id: int, grads: list[Tensor | None]
) -> tuple[list[Target], list[Tensor], list[Tensor]]:
    """Where a gradient message for ``sends[message_id]`` starts this worker's engine."""
    with ctx.lock:
        record = ctx.sends.get(message_id)
    if record is None:
        raise RpcAutogradError(
            f"no send with autograd message id {message_id} in context {ctx.context_id}"
        )
    outputs, given = _pair(record, grads)
    return outputs, given, _leaves_of(record)


def _leaves_of(record: SendRecord) -> list[Tensor]:
    if record.leaves is None:
        record.leaves = find_leaves(record.targets)
    return record.leaves


def _pair(record: SendRecord, grads: list[Tensor | None]) -> tuple[list[Target], list[Tensor]]:
    outputs: list[Target] = []
    given: list[Tensor] = []
    for target, grad in zip(record.targets, grads, strict=True):
        if grad is not None:
            outputs.append(target)
            given.append(grad)
    return outputs, given


def _run_and_wait(
    ctx: DistAutogradContext,
    pass_id: int,
    budget: float,
    outputs: Sequence[Target],
    grads: list[Tensor],
    leaves: list[Tensor],
    owned: bool = False,
    reply_to: str | None = None,
) -> list[Reply]:
    """Run one local phase, then wait (outside the lock) for the gradients it shipped.

    Answers that carry gradients for this worker's sends start further local phases here;
    returns what those phases produced for ``reply_to``.
    """
    active = _Pass(pass_id, deadline=time.monotonic() + budget, reply_to=reply_to)
    with ctx.lock:
        ctx.passes_in_flight += 1
    try:
        _run_phase_as(ctx, active, outputs, grads, leaves, owned)
        _drain(ctx, active)
        return active.replies
    finally:
        with ctx.lock:
            ctx.passes_in_flight -= 1


def _run_phase_as(
    ctx: DistAutogradContext,
    active: _Pass,
    outputs: Sequence[Target],
    grads: list[Tensor],
    leaves: list[Tensor],
    owned: bool,
) -> None:
    with ctx.lock:
        previous, ctx.active_pass = ctx.active_pass, active
        try:
            if outputs:
                run_phase(ctx, outputs, grads, leaves, owned)
        finally:
            ctx.active_pass = previous


ReplyHandler = Callable[[DistAutogradContext, _Pass, int, list[Tensor | None]], None]


def _run_reply(
    ctx: DistAutogradContext, active: _Pass, message_id: int, grads: list[Tensor | None]
) -> None:
    """FAST: the gradients for ``sends[message_id]`` came back in an answer; run them here."""
    outputs, given, leaves = _message_inputs(ctx, message_id, grads)
    _run_phase_as(ctx, active, outputs, given, leaves, owned=True)


def _drain(ctx: DistAutogradContext, active: _Pass, take_reply: ReplyHandler = _run_reply) -> None:
    """Wait for every message ``active`` shipped, handing the gradients their answers carry
    to ``take_reply`` (FAST runs them; SMART adds them to its pass).

    Those runs may ship more messages, which join the list. Every message is waited for (each
    bounded by its RPC timeout) even after a failure; the first error is raised.
    """
    first: BaseException | None = None
    waited = 0
    while waited < len(active.outgoing):
        peer, fut = active.outgoing[waited]
        waited += 1
        try:
            replies: list[Reply] = fut.wait() or []
        except Exception as exc:
            if first is None:
                first = _as_backward_error(exc, peer, delivering=True)
            continue
        if first is not None:
            continue  # the pass has failed: start no more work
        try:
            for message_id, grads in replies:
                counters["gradient_replies_received"] += 1
                take_reply(ctx, active, message_id, grads)
        except Exception as exc:
            first = _as_backward_error(exc, _agent.worker_name())
    if first is not None:
        raise first


def _as_backward_error(exc: BaseException, worker: str, *, delivering: bool = False) -> Exception:
    """An :class:`RpcAutogradError` naming the worker where the failure started."""
    text = str(exc)
    at = text.find(_MARKER)
    if at >= 0:  # already wrapped further down the chain: keep the innermost message
        # Remote errors arrive as their repr: drop the closing quotes and parentheses.
        line = re.sub(r"""(\\?['"]\)?)+$""", "", text[at:].splitlines()[0])
        return RpcAutogradError(line)
    if delivering:
        why = f"could not deliver gradients to it ({_agent.describe_error(exc)})"
    else:
        why = _agent.describe_error(exc)
    return RpcAutogradError(f"{_MARKER}{worker}: {why}")


def backward(
    context_id: int,
    roots: Sequence[Tensor],
    grad_tensors: Sequence[Tensor | None] | None = None,
    retain_graph: bool = False,
    *,
    mode: str = "fast",
    timeout: float | None = None,
) -> None:
    """Run a distributed backward pass from ``roots``, which must live on this worker.

    ``grad_tensors[i]`` is the gradient of ``roots[i]`` (``None`` or omitted: ones, allowed for
    single-element roots only). Gradients of every worker's leaves accumulate in the context
    (:func:`get_gradients` on that worker); ``.grad`` is never written. With
    ``retain_graph=False`` the context's graph may not be back-propagated again.

    ``mode="fast"`` (the default) ships every gradient on as it arrives; ``mode="smart"`` first
    finds which send/recv pairs lie on a path to the roots and runs each worker's local engine
    once (see docs/rpc.md). ``timeout`` (seconds, default: the RPC timeout) bounds the pass.

    Cost (FAST): one RPC per recv node the pass reaches, each answered after the work it
    triggers; no extra messages.

    Raises :class:`~distgrad.errors.RpcAutogradError` naming the worker where a failure started
    (an exception in a backward function, a dead or unreachable worker, a timeout), and
    :class:`~distgrad.errors.UnknownContextError` for an unknown context id.
    """
    ctx = lookup(context_id)
    outputs, grads = _check_roots(roots, grad_tensors)
    if mode not in ("fast", "smart"):
        raise ValueError(f"mode must be 'fast' or 'smart', got {mode!r}")
    with ctx.lock:
        if ctx.graph_freed:
            raise RpcAutogradError(
                f"context {context_id}: its graph was already back-propagated with "
                "retain_graph=False; pass retain_graph=True to the first backward to run another"
            )
    budget = _agent.rpc_timeout() if timeout is None else timeout
    pass_id = _agent.new_id()
    if mode == "smart":
        from distgrad.rpc.smart import smart_backward

        smart_backward(ctx, pass_id, budget, outputs, grads, retain_graph)
    else:
        try:
            _run_and_wait(ctx, pass_id, budget, outputs, grads, find_leaves(outputs))
        except RpcAutogradError:
            raise
        except Exception as exc:
            raise _as_backward_error(exc, _agent.worker_name()) from None
    if not retain_graph:
        with ctx.lock:
            ctx.graph_freed = True


def _check_roots(
    roots: Sequence[Tensor], grad_tensors: Sequence[Tensor | None] | None
) -> tuple[list[Tensor], list[Tensor]]:
    if isinstance(roots, Tensor):
        roots = [roots]
    if grad_tensors is None:
        grad_tensors = [None] * len(roots)
    elif isinstance(grad_tensors, Tensor):
        grad_tensors = [grad_tensors]
    if len(grad_tensors) != len(roots):
        raise ValueError(f"backward: got {len(roots)} roots but {len(grad_tensors)} grad_tensors")
    outputs: list[Tensor] = []
    grads: list[Tensor] = []
    for i, (root, grad) in enumerate(zip(roots, grad_tensors, strict=True)):
        if not isinstance(root, Tensor):
            raise TypeError(f"backward: roots[{i}] is a {type(root).__name__}, not a Tensor")
        if not root.requires_grad:
            raise RpcAutogradError(f"backward: roots[{i}] does not require grad and has no grad_fn")
        if grad is None:
            if root.numel() != 1:
                raise RpcAutogradError(
                    f"backward: roots[{i}] has shape {tuple(root.shape)}; pass grad_tensors "
                    "for roots with more than one element"
                )
            grad = torch.ones_like(root)
        elif grad.shape != root.shape:
            raise ValueError(
                f"backward: grad_tensors[{i}] has shape {tuple(grad.shape)} but roots[{i}] "
                f"has shape {tuple(root.shape)}"
            )
        outputs.append(root)
        grads.append(grad)
    return outputs, grads
