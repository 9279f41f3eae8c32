"""Distributed autograd contexts: one per forward/backward pass, known to every worker it touches.

A context holds, on each worker, what that worker recorded during the forward pass (its send and
recv records, keyed by autograd message id), the workers it exchanged messages with, and the
gradients the backward pass accumulated for this worker's tensors. Gradients never go to
``.grad``: read them with :func:`get_gradients`.

A context is created by :func:`context` on one worker and, lazily, on every worker that receives
a message carrying its id. When the ``with`` block exits, the context is released on this worker
and on every worker it touched, transitively (each worker forwards the release to the workers it
knows of), also when the block raised.
"""

from __future__ import annotations

import collections
import contextlib
import queue
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

from distgrad.errors import RpcAutogradError, UnknownContextError
from distgrad.rpc import _agent

if TYPE_CHECKING:
    from distgrad.rpc.send_recv import RecvRecord, SendRecord

__all__ = ["DistAutogradContext", "context", "current_context_id", "debug_state", "get_gradients"]

_RELEASE_TIMEOUT_S = 10.0


@dataclass
class _Pass:
    """One backward pass as seen by this worker: the gradient messages its phases sent."""

    pass_id: int
    deadline: float = 0.0  # time.monotonic() by which this worker's part must be done
    outgoing: list[tuple[str, Any]] = field(default_factory=list)  # (worker, future)
    # The worker whose gradient message this phase answers (None at the root). Gradients for
    # that worker ride back in the answer instead of travelling as a message of their own.
    reply_to: str | None = None
    replies: list[tuple[int, list[Tensor | None]]] = field(default_factory=list)


class DistAutogradContext:
    """What one worker knows about one distributed autograd context.

    All fields are guarded by ``lock``; local backward phases of one context run one at a time.
    """

    def __init__(self, context_id: int) -> None:
        self.context_id = context_id
        self.lock = threading.RLock()
        self.sends: dict[int, SendRecord] = {}
        self.recvs: dict[int, RecvRecord] = {}
        self.known_workers: set[str] = set()
        # id(tensor) -> (tensor, accumulated gradient)
        self._grads: dict[int, tuple[Tensor, Tensor]] = {}
        self._storages: set[int] = set()  # where the stored gradients' memory starts
        # A leaf every recv node hangs from, so that a backward asked for leaf gradients still
        # runs the recv nodes (torch only runs nodes on a path to a requested input).
        self.anchor = torch.zeros((), requires_grad=True)
        self.active_pass: _Pass | None = None
        self.passes_in_flight = 0
        self.graph_freed = False
        self.smart_passes: dict[int, Any] = {}  # pass id -> this worker's SMART state
        self.aborted_passes: set[int] = set()

    def accumulate(self, tensor: Tensor, grad: Tensor) -> None:
        """Add ``grad`` to the gradient stored for ``tensor`` (out of place).

        What is stored is a gradient of its own, as ``.grad`` would be: dense, laid out like
        ``tensor``, sharing memory with no other stored gradient. A gradient that is not (an
        expanded view such as the gradient of a ``sum``, a slice of a larger buffer, or one
        tensor handed to two leaves by an add's backward) is copied first, so that changing
        one gradient in place never changes another.
        """
        key = id(tensor)
        held = self._grads.get(key)
        if held is not None:
            self._storages.discard(storage_of(held[1]))
            stored = held[1] + grad
        elif _owns_its_memory(tensor, grad) and storage_of(grad) not in self._storages:
            stored = grad
        else:
            stored = torch.empty_like(tensor).copy_(grad)  # empty_like keeps tensor's layout
        self._storages.add(storage_of(stored))
        self._grads[key] = (tensor, stored)

    def gradients(self) -> dict[Tensor, Tensor]:
        with self.lock:
            return {t: g for t, g in self._grads.values()}

    def grad_of(self, tensor: Tensor) -> Tensor | None:
        with self.lock:
            held = self._grads.get(id(tensor))
            return None if held is None else held[1]


def storage_of(t: Tensor) -> int:
    """Where ``t``'s memory starts: equal for tensors that share a storage."""
    return int(t.untyped_storage().data_ptr())


def fills_its_storage(t: Tensor) -> bool:
    """Whether ``t`` uses every byte of its storage (not an expanded view or a slice)."""
    return t.untyped_storage().nbytes() == t.numel() * t.element_size()


def _owns_its_memory(tensor: Tensor, grad: Tensor) -> bool:
    """Whether ``grad`` fills its whole storage and is laid out like ``tensor`` (see
    ``AccumulateGrad``'s layout contract: dense tensors' gradients take their strides)."""
    if not fills_its_storage(grad):
        return False
    if _is_dense(tensor):
        return grad.stride() == tensor.stride()
    return grad.is_contiguous()


def _is_dense(t: Tensor) -> bool:
    """Whether ``t``'s elements tile one block of memory without gaps or overlaps."""
    expected = 1
    dims = sorted((st, sz) for st, sz in zip(t.stride(), t.shape, strict=True) if sz != 1)
    for stride, size in dims:
        if stride != expected:
            return False
        expected *= size
    return True


_COUNTER_NAMES = (
    "gradient_messages_sent",
    "gradient_tensors_sent",
    "gradient_messages_received",
    "gradient_replies_sent",
    "gradient_replies_received",
    "lineage_messages_sent",
    "engine_runs",
    "release_failures",
)
_registry: dict[int, DistAutogradContext] = {}
# Running totals on this worker, for tests and the benchmark (see debug_state).
counters: collections.Counter[str] = collections.Counter()
_registry_lock = threading.Lock()
_local = threading.local()


def current_context_id() -> int | None:
    """The id of the context this thread is in, or ``None``."""
    cid: int | None = getattr(_local, "context_id", None)
    return cid


def _set_current(context_id: int | None) -> int | None:
    previous = current_context_id()
    _local.context_id = context_id
    return previous


def lookup(context_id: int) -> DistAutogradContext:
    """The context with this id on this worker; :class:`UnknownContextError` if there is none."""
    with _registry_lock:
        ctx = _registry.get(context_id)
    if ctx is None:
        raise UnknownContextError(
            f"autograd context {context_id} is not known on {_agent.worker_name()}: it was never "
            "created here or it has already been released (contexts live only inside their "
            "`with distgrad.rpc.context()` block)"
        )
    return ctx


def get_or_create(context_id: int) -> DistAutogradContext:
    """The context with this id, created on this worker if it is new here."""
    with _registry_lock:
        ctx = _registry.get(context_id)
        if ctx is None:
            ctx = _registry[context_id] = DistAutogradContext(context_id)
        return ctx


def _pop(context_id: int) -> DistAutogradContext | None:
    with _registry_lock:
        return _registry.pop(context_id, None)


def _forget_all() -> None:
    with _registry_lock:
        _registry.clear()


@contextlib.contextmanager
def context(*, wait_for_release: bool = False) -> Iterator[int]:
    """Open a distributed autograd context on this thread and yield its id.

    The id is unique across workers (the worker id sits in its high 16 bits). RPCs made through
    :mod:`distgrad.rpc` inside the block carry the id and record send/recv pairs for tensors
    that require grad. A thread has at most one open context; opening a second one raises
    :class:`~distgrad.errors.RpcAutogradError`.

    On exit the context is dropped here at once, and a release goes to every worker this
    worker exchanged messages with (each forwards it to the workers it knows of). By default
    the release travels in the background, as in PyTorch, and this worker does not wait;
    ``wait_for_release=True`` waits until every worker has dropped the context and raises
    :class:`~distgrad.errors.RpcAutogradError` if one could not be reached (unless the block
    itself raised). :func:`shutdown` waits for releases still in flight.

    Cost: creating a context is local; on exit, one release message per worker it touched.
    """
    if current_context_id() is not None:
        raise RpcAutogradError(
            f"this thread is already in autograd context {current_context_id()}; "
            "a thread can be in only one context at a time"
        )
    context_id = _agent.new_id()
    get_or_create(context_id)
    _set_current(context_id)
    failed = True
    try:
        yield context_id
        failed = False
    finally:
        _set_current(None)
        if not wait_for_release:
            _release_in_background(context_id)
        elif (errors := release(context_id, sender=None)) and not failed:
            raise RpcAutogradError(
                f"autograd context {context_id} could not be released on every worker: "
                + "; ".join(errors)
            )


_pending_releases: list[Any] = []  # futures of releases sent in the background
# Releases waiting for the sender thread: (context id, this worker's name, peers to tell).
_outbox: queue.SimpleQueue[tuple[int, str, list[str]]] = queue.SimpleQueue()
_outbox_unsent = 0  # entries put in the outbox and not yet sent; guarded by _outbox_done
_outbox_done = threading.Condition()
_sender: threading.Thread | None = None


def _release_in_background(context_id: int) -> None:
    """Drop the context here; a sender thread tells the workers it touched.

    Sending an RPC costs the calling thread about 0.1 ms (pickling and handing the message to
    the transport); a thread of its own keeps that out of the training step.
    """
    global _outbox_unsent, _sender
    ctx = _pop(context_id)
    if ctx is None:
        return
    me = _agent.worker_name()
    with ctx.lock:
        peers = sorted(ctx.known_workers - {me})
    if not peers:
        return
    with _outbox_done:
        _outbox_unsent += 1
        if _sender is None or not _sender.is_alive():
            _sender = threading.Thread(
                target=_send_releases, name="distgrad-release-sender", daemon=True
            )
            _sender.start()
    _outbox.put((context_id, me, peers))


def _send_releases() -> None:
    global _outbox_unsent
    from torch.distributed import rpc as torch_rpc

    while True:
        context_id, me, peers = _outbox.get()
        futures = []
        for peer in peers:
            try:
                futures.append(
                    torch_rpc.rpc_async(
                        peer, _release_remote, args=(context_id, me), timeout=_RELEASE_TIMEOUT_S
                    )
                )
            except Exception:  # the agent is gone (shutdown): nothing left to release
                counters["release_failures"] += 1
        with _registry_lock:
            _pending_releases[:] = [f for f in _pending_releases if not f.done()]
            _pending_releases.extend(futures)
        with _outbox_done:
            _outbox_unsent -= 1
            _outbox_done.notify_all()


def wait_for_releases() -> None:
    """Wait for the releases sent in the background (each bounded by its RPC timeout)."""
    with _outbox_done:
        _outbox_done.wait_for(lambda: _outbox_unsent == 0, timeout=_RELEASE_TIMEOUT_S)
    with _registry_lock:
        futures, _pending_releases[:] = list(_pending_releases), []
    for fut in futures:
        try:
            fut.wait()
        except Exception:
            counters["release_failures"] += 1


def release(context_id: int, sender: str | None) -> list[str]:
    """Drop the context here and on every worker it touched (except ``sender``), transitively.

    Returns one line per worker that could not be reached.
    """
    from torch.distributed import rpc as torch_rpc

    ctx = _pop(context_id)
    if ctx is None:
        return []
    with ctx.lock:
        peers = sorted(ctx.known_workers - {sender, _agent.worker_name()})
        ctx.sends.clear()
        ctx.recvs.clear()
    me = _agent.worker_name()
    futures = [
        (
            peer,
            torch_rpc.rpc_async(
                peer, _release_remote, args=(context_id, me), timeout=_RELEASE_TIMEOUT_S
            ),
        )
        for peer in peers
    ]
    errors: list[str] = []
    for peer, fut in futures:
        try:
            errors.extend(fut.wait())
        except Exception as exc:
            errors.append(f"{peer}: {type(exc).__name__}: {str(exc).splitlines()[0][:200]}")
    return errors


def _release_remote(context_id: int, sender: str) -> list[str]:
    return release(context_id, sender)


def get_gradients(context_id: int) -> dict[Tensor, Tensor]:
    """This worker's gradients in the context: a dict from each tensor to its gradient.

    Only tensors of this worker that a distributed backward reached appear; their ``.grad`` is
    untouched. Raises :class:`~distgrad.errors.UnknownContextError` for an unknown id.
    """
    return lookup(context_id).gradients()


def debug_state() -> dict[str, int]:
    """Counts on this worker, for leak checks and message accounting.

    ``contexts`` (live), ``passes_in_flight`` (backward work running or waiting for answers),
    ``smart_passes`` (SMART state held), ``sends`` and ``recvs`` (records in live contexts), and
    running totals since the worker started: ``gradient_messages_sent``,
    ``gradient_tensors_sent`` (``None`` gradients are not counted: they travel as ``None``),
    ``gradient_messages_received``, ``gradient_replies_sent`` and ``gradient_replies_received``
    (FAST: gradients that rode back inside the answer to a gradient message),
    ``lineage_messages_sent``, ``engine_runs`` (calls of the local autograd engine) and
    ``release_failures``.
    """
    with _registry_lock:
        contexts = list(_registry.values())
    return {
        **dict.fromkeys(_COUNTER_NAMES, 0),
        **counters,
        "contexts": len(contexts),
        "passes_in_flight": sum(c.passes_in_flight for c in contexts),
        "smart_passes": sum(len(c.smart_passes) for c in contexts),
        "sends": sum(len(c.sends) for c in contexts),
        "recvs": sum(len(c.recvs) for c in contexts),
    }
