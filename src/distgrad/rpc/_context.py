"""A distributed autograd context as one worker holds it, and the registry of live contexts.

A context holds, on each worker, what that worker recorded during the forward pass (its send
and recv records, keyed by autograd message id), the workers it exchanged messages with, the
gradients backward passes stored for this worker's tensors, and which backward phase is
running. A context exists on the worker that opened it and, lazily, on every worker that
received a message carrying its id.
"""

from __future__ import annotations

import collections
import threading
from collections.abc import Sequence
from typing import Protocol

import torch
from torch import Tensor

from distgrad.errors import RpcAutogradError, UnknownContextError
from distgrad.rpc import _identity
from distgrad.rpc._records import RecvRecord, SendRecord
from distgrad.rpc._reductions import Reductions
from distgrad.rpc._storage import GradientStore

__all__ = [
    "ANCHOR",
    "DistAutogradContext",
    "GradientSink",
    "PassState",
    "counters",
    "forget_all",
    "get_or_create",
    "live_contexts",
    "lookup",
    "pop",
]


class GradientSink(Protocol):
    """Where a recv node hands the gradients of its outputs during a backward phase."""

    def take(self, record: RecvRecord, grads: list[Tensor | None]) -> None: ...


class PassState:
    """Base of what an engine keeps on a worker for one backward pass (SMART subclasses it)."""

    def __init__(self, pass_id: int) -> None:
        self.pass_id = pass_id


class DistAutogradContext:
    """What one worker knows about one distributed autograd context.

    All fields are guarded by ``lock``; backward phases of one context run one at a time.

    Args:
        context_id: the context's id.

    Raises:
        Nothing: made by ``context()`` and by the messages of recorded calls, not by users.

    Example:
        >>> record = dg.rpc.DistAutogradContext(7)
        >>> record.context_id, record.sends, record.passes_in_flight
        (7, {}, 0)
    """

    def __init__(self, context_id: int) -> None:
        self.context_id = context_id
        self.lock = threading.RLock()
        self.sends: dict[int, SendRecord] = {}
        self.recvs: dict[int, RecvRecord] = {}
        # Replaced, never changed in place, so that it can be read without the lock.
        self.known_workers: frozenset[str] = frozenset()
        self.grads = GradientStore()
        self.active_pass: GradientSink | None = None
        self.passes_in_flight = 0
        self.graph_freed = False
        self.pass_states: dict[int, PassState] = {}  # pass id -> an engine's state here
        self.aborted_passes: set[int] = set()
        self.ddp: Reductions | None = None  # once a DDP or FSDP2 forward ran in this context

    def know(self, worker: str) -> None:
        """Remember that this context exchanged messages with ``worker``. Holds the lock."""
        if worker not in self.known_workers:
            self.known_workers = self.known_workers | {worker}

    def hand_back(self, message_id: int, grads: list[Tensor | None]) -> None:
        """A recv node ran in backward: hand its outputs' gradients to the running phase."""
        record = self.recvs[message_id]
        sink = self.active_pass
        if sink is None:
            raise RpcAutogradError(
                f"the recv node of message {message_id} (tensors from {record.from_worker}) "
                f"ran outside a distributed backward of context {self.context_id}: call "
                "distgrad.rpc.backward(context_id, roots), not Tensor.backward(), on graphs "
                "that contain RPCs"
            )
        sink.take(record, grads)

    def store(self, pairs: Sequence[tuple[Tensor, Tensor]], foreign: frozenset[int]) -> None:
        """Keep the leaves' gradients of one backward phase (see ``_storage``)."""
        if not pairs:  # most phases off the root reach no leaf
            return
        with self.lock:
            self.grads.add_all(pairs, foreign)

    def gradients(self) -> dict[Tensor, Tensor]:
        with self.lock:
            return dict(self.grads.items())


# A leaf every recv node hangs from: a FAST phase asks the engine for its gradient so that
# every recv node below the phase's start runs (torch only runs nodes on a path to a requested
# input). No gradient ever reaches it, so one serves every context.
ANCHOR = torch.zeros((), requires_grad=True)
# Running totals on this worker, for tests and the benchmark (see debug_state).
counters: collections.Counter[str] = collections.Counter()
_registry: dict[int, DistAutogradContext] = {}
_registry_lock = threading.Lock()
# Contexts dropped because a peer was gone, with the reason (the last 1,000), so that a late
# message for one gets an error that says why.
_dropped: collections.OrderedDict[int, str] = collections.OrderedDict()


def lookup(context_id: int) -> DistAutogradContext:
    """The context with this id on this worker; :class:`UnknownContextError` if there is none."""
    with _registry_lock:
        ctx = _registry.get(context_id)
        why = _dropped.get(context_id)
    if ctx is None:
        why = why or (
            "it was never created here or it has already been released (contexts live only "
            "inside their `with distgrad.rpc.context()` block)"
        )
        raise UnknownContextError(  # torch's words first (programs match them), then why
            f"Could not find autograd context with id: {context_id} (on "
            f"{_identity.worker_name()}: {why})"
        )
    return ctx


def get_or_create(context_id: int) -> DistAutogradContext:
    """The context with this id, created on this worker if it is new here."""
    with _registry_lock:
        ctx = _registry.get(context_id)
        if ctx is None:
            ctx = _registry[context_id] = DistAutogradContext(context_id)
        return ctx


def pop(context_id: int, reason: str | None = None) -> DistAutogradContext | None:
    """Remove a context from this worker; ``reason`` is kept for late messages' errors."""
    with _registry_lock:
        if reason is not None:
            _dropped[context_id] = reason
            while len(_dropped) > 1000:
                _dropped.popitem(last=False)
        return _registry.pop(context_id, None)


def live_contexts() -> list[DistAutogradContext]:
    with _registry_lock:
        return list(_registry.values())


def forget_all() -> None:
    with _registry_lock:
        _registry.clear()
        _dropped.clear()
