"""The machinery both backward modes share: a worker's part of a pass, shipping gradients,
waiting for the answers, and turning failures into errors that name where they started.

A worker's part of a pass (a :class:`Pass`) begins when the pass reaches it (at the root, or
with a gradient message) and ends when every gradient message its phases shipped has been
answered; only then does it answer its own message. So when the root's messages are answered,
the whole pass is over, and an error anywhere travels back along the answers.

Gradients bound for the worker whose message is being answered do not travel as a message of
their own: they ride back in the answer (a :class:`~distgrad.rpc._wire.Reply`), and that
worker runs them when the answer arrives. On a round trip (the root calls a worker and uses its
result) the backward is then one RPC where torch sends two, one nested in the other.
"""

from __future__ import annotations

import re
import time
from collections.abc import Callable

from torch import Tensor
from torch.distributed import rpc as torch_rpc
from torch.futures import Future

from distgrad.errors import RpcAutogradError
from distgrad.rpc import _identity, _transport
from distgrad.rpc._context import DistAutogradContext, GradientSink, counters
from distgrad.rpc._records import Lineage, RecvRecord
from distgrad.rpc._wire import GradientMessage, Reply

__all__ = [
    "HOP_MARGIN_S",
    "Pass",
    "as_backward_error",
    "deadline_after",
    "drain",
    "in_flight",
    "pass_error",
    "phase",
    "ship",
]

_MARKER = "distributed backward failed on "
_TORCH_PREFIX = "Error on Node "  # torch's distributed engine's words for the same
HOP_MARGIN_S = 0.5  # each hop gives its callee this much less time, so the deepest error wins


class Pass:
    """This worker's part of one backward pass, from its start here until it answers.

    ``receiver`` is the RPC handler (FAST's or SMART's) that gradient messages go to;
    ``reply_to`` the worker whose gradient message this part answers (``None`` at the root).
    SMART's messages also carry ``lineage`` and ``retain_graph``.
    """

    def __init__(
        self,
        ctx: DistAutogradContext,
        pass_id: int,
        deadline: float,
        receiver: Callable[[GradientMessage], list[Reply]],
        reply_to: str | None = None,
        lineage: Lineage | None = None,
        retain_graph: bool = True,
    ) -> None:
        self.ctx = ctx
        self.pass_id = pass_id
        self.deadline = deadline  # time.monotonic() by which this worker's part must be done
        self.receiver = receiver
        self.reply_to = reply_to
        self.lineage = lineage
        self.retain_graph = retain_graph
        self.outgoing: list[tuple[str, Future[list[Reply]]]] = []  # (worker, answer)
        self.replies: list[Reply] = []  # what rides back in this part's answer

    def take(self, record: RecvRecord, grads: list[Tensor | None]) -> None:
        """A recv node ran: ship its gradients (see :func:`ship`)."""
        ship(self, record, grads)


def ship(active: Pass, record: RecvRecord, grads: list[Tensor | None]) -> None:
    """The one place a gradient leaves this worker: in the answer ``active`` will give, when
    the recv's sender is the worker waiting for that answer; otherwise as a gradient message
    whose answer ``active`` waits for."""
    counters["gradient_tensors_sent"] += sum(g is not None for g in grads)
    if record.from_worker == active.reply_to:
        active.replies.append(Reply(record.message_id, grads))
        counters["gradient_replies_sent"] += 1
        return
    budget = max(active.deadline - time.monotonic() - HOP_MARGIN_S, 0.1)
    message = GradientMessage(
        record.context_id,
        record.message_id,
        grads,
        active.pass_id,
        budget,
        _identity.worker_name(),
        active.lineage,
        active.retain_graph,
    )
    # The answer's gradients are kept as they arrive: the context's store copies those that
    # share memory or do not fill their own (an expanded gradient), on the waiting thread.
    # They used to be copied on the RPC thread that completes the answer, which page-faulted:
    # measured with perf on a 1000x1000 round trip, 640 page faults per step in those copies
    # (2.8-3.4 ms of the step), against 170 when the store copies them on the waiting thread
    # (torch's engine: about 290). That thread is any of the agent's 16 pool threads, likely
    # each with a malloc arena of its own that gives freed 4 MB blocks back to the system.
    answer = _transport.call_async(record.from_worker, active.receiver, (message,), budget)
    active.outgoing.append((record.from_worker, answer))
    counters["gradient_messages_sent"] += 1


OnReply = Callable[[DistAutogradContext, Pass, Reply], None]


def drain(ctx: DistAutogradContext, active: Pass, on_reply: OnReply) -> None:
    """Wait for every message ``active`` shipped, handing the gradients their answers carry
    back to ``on_reply`` (FAST runs them; SMART adds them to its pass).

    Those runs may ship more messages, which join the list. Every message is waited for (each
    bounded by its RPC timeout) even after a failure; the first error is raised.
    """
    first: BaseException | None = None
    waited = 0
    while waited < len(active.outgoing):
        peer, fut = active.outgoing[waited]
        waited += 1
        try:
            replies = fut.wait()
        except Exception as exc:
            first = first or as_backward_error(exc, peer, delivering=True)
            continue
        if first is not None:
            continue  # the pass has failed: start no more work
        try:
            for reply in replies:
                counters["gradient_replies_received"] += 1
                on_reply(ctx, active, reply)
        except Exception as exc:
            first = as_backward_error(exc, _identity.worker_name())
    if first is not None:
        raise first


class in_flight:  # lower case: a context manager used as a function
    """Count a worker's part of a pass as running (``debug_state()['passes_in_flight']``).

    This and :class:`phase` are classes, not ``contextlib`` generators: a round trip's
    backward enters five of them, and a generator costs 2.5 us more each, hot (measured: 4.9
    against 2.5 us, 4.3 against 1.7 us), several times that in a live step, where the code is
    cold.
    """

    __slots__ = ("ctx",)

    def __init__(self, ctx: DistAutogradContext) -> None:
        self.ctx = ctx

    def __enter__(self) -> None:
        with self.ctx.lock:
            self.ctx.passes_in_flight += 1

    def __exit__(self, *exc: object) -> None:
        with self.ctx.lock:
            self.ctx.passes_in_flight -= 1


class phase:  # lower case: a context manager used as a function
    """Run a local phase of ``active``: holds the context's lock, and recv nodes that run hand
    their gradients to ``active`` (through ``ctx.active_pass``)."""

    __slots__ = ("active", "ctx", "previous")

    def __init__(self, ctx: DistAutogradContext, active: Pass) -> None:
        self.ctx = ctx
        self.active = active
        self.previous: GradientSink | None = None

    def __enter__(self) -> None:
        self.ctx.lock.acquire()
        self.previous, self.ctx.active_pass = self.ctx.active_pass, self.active

    def __exit__(self, *exc: object) -> None:
        self.ctx.active_pass = self.previous
        self.ctx.lock.release()


def as_backward_error(exc: BaseException, worker: str, *, delivering: bool = False) -> Exception:
    """An :class:`RpcAutogradError` naming the worker where the failure started, in torch's
    words first (``Error on Node 1: <the error>``, which programs and torch's tests match),
    then distgrad's (``(distributed backward failed on worker1)``) on the same line."""
    text = str(exc)
    for line in text.splitlines():
        at = line.find(_TORCH_PREFIX)
        if at >= 0 and _MARKER in line:  # already wrapped further down: keep the innermost
            # Remote errors arrive as their repr: drop the closing quotes and parentheses.
            return RpcAutogradError(re.sub(r"""(\\?['"]\)?)+$""", "", line[at:]))
    if delivering:
        why = f"could not deliver gradients to it ({_transport.describe_error(exc)})"
    else:
        why = _transport.describe_error(exc)
    first, newline, rest = why.partition("\n")
    return RpcAutogradError(
        f"{_TORCH_PREFIX}{_node(worker)}: {first} ({_MARKER}{worker}){newline}{rest}"
    )


def _node(worker: str) -> str:
    """The worker's id, as torch's engine names a node in its errors (its name if unknown)."""
    try:
        return str(torch_rpc.get_worker_info(worker).id)
    except Exception:  # RPC already down: the name still says where
        return worker


def deadline_after(budget: float) -> float:
    return time.monotonic() + budget


def pass_error(exc: Exception, worker: str) -> Exception:
    """``exc`` as raised at the end of a pass: kept if already an ``RpcAutogradError``."""
    return exc if isinstance(exc, RpcAutogradError) else as_backward_error(exc, worker)
