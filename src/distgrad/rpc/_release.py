"""Releasing a context on every worker it touched.

A context is dropped on the worker that opened it when its ``with`` block exits, and every
worker it exchanged messages with must drop its copy; each of them forwards the release to the
workers it knows of, so the release is transitive.

By default releases travel in the background, as torch's do, and in a training loop they cost
no message of their own: a release waits in an outbox for its worker and rides on the next call
this worker makes to it (usually the next step's first call), which drops it before serving
the call, and queues the forward to the workers it knows of in its own outbox the same way.
Releases still waiting after ``_GATHER_S`` go out from a background thread, one message per
worker. A release message is an RPC that every peer handles: measured on a 2-core machine, a
3x3 round trip step spent 0.4-0.5 ms more CPU on each of its two workers when each step's
release went out as a message (gathered every 5 ms) than when it rode on the next call.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any, TypeVar

from torch.futures import Future

from distgrad.rpc import _context, _identity, _transport
from distgrad.rpc._wire import Release

__all__ = [
    "carry",
    "drop_riding",
    "forget",
    "receive",
    "release",
    "release_in_background",
    "wait_for_releases",
]

T = TypeVar("T")

_RELEASE_TIMEOUT_S = 10.0
_GATHER_S = 0.005  # how long a release waits for a call to ride on before it is sent alone


class _Releases:
    """Every release this worker still owes, and what it takes to deliver them: one per process
    (``_state``).

    It owns the outbox (worker -> (context id, ``time.monotonic()`` when queued) of the
    releases waiting for that worker), the calls carrying releases until they settle, the
    workers that took releases riding on calls since the last wait, the futures of release
    messages sent and not yet waited for, the sender thread and the count of outbox batches
    taken and not yet sent.

    Locking: ``lock`` guards ``outbox``, ``rides``, ``rode`` and starting ``sender`` (the
    outbox is read without it only to ask whether a worker has an entry); ``pending_lock``
    guards ``pending``; the condition ``done`` guards ``sending``; ``wake`` is set when the
    outbox has something for the sender thread.
    """

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.outbox: dict[str, list[tuple[int, float]]] = {}
        self.rides: list[_Ride] = []
        self.rode: set[str] = set()
        self.wake = threading.Event()
        self.sender: threading.Thread | None = None
        self.pending: list[Future[list[str]]] = []
        self.pending_lock = threading.Lock()
        self.sending = 0
        self.done = threading.Condition()


_state = _Releases()


def _peers_of(ctx: _context.DistAutogradContext, sender: str | None) -> list[str]:
    me = _identity.worker_name()
    with ctx.lock:
        peers = sorted(ctx.known_workers - {sender, me})
        ctx.sends.clear()
        ctx.recvs.clear()
        ctx.pass_states.clear()
    return peers


def release_in_background(context_id: int) -> None:
    """Drop the context here; its workers learn it on the next call or from the sender thread."""
    ctx = _context.pop(context_id)
    if ctx is not None:
        _queue(ctx, None)


def _queue(ctx: _context.DistAutogradContext, sender: str | None) -> None:
    peers = _peers_of(ctx, sender)
    if peers:
        _put({peer: [ctx.context_id] for peer in peers})


def _put(by_peer: dict[str, list[int]]) -> None:
    """Add releases to the outbox, and make sure the sender thread will send what stays."""
    state = _state
    now = time.monotonic()
    with state.lock:
        for peer, context_ids in by_peer.items():
            state.outbox.setdefault(peer, []).extend((cid, now) for cid in context_ids)
        if state.sender is None or not state.sender.is_alive():
            state.sender = threading.Thread(
                target=_send_loop, name="distgrad-releases", daemon=True
            )
            state.sender.start()
    state.wake.set()


def carry(peer: str, send: Callable[[list[int] | None], Future[T]]) -> Future[T]:
    """Make a call to ``peer`` with ``send(releases)``, the releases waiting for ``peer`` riding
    on it (``None`` if there are none); returns ``send``'s future.

    The receiver drops them before serving the call (:func:`drop_riding`). If the call fails
    (it may not have reached ``peer``), they go back to the outbox and are sent alone; a
    release that arrives twice finds nothing the second time.
    """
    context_ids = _riding(peer)
    if context_ids is None:
        return send(None)
    try:
        fut = send(context_ids)
    except BaseException:
        _put({peer: context_ids})
        raise
    ride = _Ride(peer, context_ids, fut)
    with _state.lock:
        _state.rides[:] = [r for r in _state.rides if not r.settled]
        _state.rides.append(ride)
    fut.add_done_callback(ride.settle)
    return fut


def _riding(peer: str) -> list[int] | None:
    """Take the releases waiting for ``peer``."""
    state = _state
    if peer not in state.outbox:  # read without the lock: the common case is one dict lookup
        return None
    with state.lock:
        waiting = state.outbox.pop(peer, None)
        if not waiting:
            return None
        state.rode.add(peer)
    return [cid for cid, _ in waiting]


class _Ride:
    """Releases riding on a call: settled when the call's answer (or failure) arrives."""

    def __init__(self, peer: str, context_ids: list[int], fut: Future[Any]) -> None:
        self.peer = peer
        self.context_ids = context_ids
        self.fut = fut
        self.settled = False

    def settle(self, _: object = None) -> None:
        """Wait for the call; if it failed, put its releases back in the outbox (once)."""
        try:
            self.fut.wait()
            failed = False
        except Exception:
            failed = True
        with _state.lock:
            if self.settled:
                return
            self.settled = True
        if failed:
            _put({self.peer: self.context_ids})


def drop_riding(context_ids: list[int], sender: str) -> None:
    """A call from ``sender`` carried these releases: drop the contexts here and queue the
    release for the workers they involve (except ``sender``)."""
    for context_id in context_ids:
        ctx = _context.pop(context_id)
        if ctx is not None:
            _queue(ctx, sender)


def _send_loop() -> None:
    while True:
        _state.wake.wait()
        _state.wake.clear()
        pause: float | None = _GATHER_S
        while pause is not None:
            time.sleep(pause)
            pause = _flush(_GATHER_S)


def _flush(min_age: float = 0.0) -> float | None:
    """Send the releases that have waited ``min_age`` seconds, one message per worker.

    Returns how long until the next one left has waited that long (``None``: none left).
    """
    state = _state
    with state.done:
        state.sending += 1
    try:
        batch: dict[str, list[int]] = {}
        cutoff = time.monotonic() - min_age
        oldest_left: float | None = None
        with state.lock:
            for peer in list(state.outbox):
                waiting = state.outbox[peer]
                due = [cid for cid, queued in waiting if queued <= cutoff]
                if due:
                    batch[peer] = due
                left = [(cid, queued) for cid, queued in waiting if queued > cutoff]
                if left:
                    state.outbox[peer] = left
                    first = left[0][1]
                    oldest_left = first if oldest_left is None else min(oldest_left, first)
                else:
                    del state.outbox[peer]
        me = _identity.worker_name() if batch else ""
        futures = []
        for peer, context_ids in batch.items():
            try:
                futures.append(_send(peer, context_ids, me))
            except Exception:  # the agent is gone (shutdown): nothing left to release
                _context.counters["release_failures"] += 1
        with state.pending_lock:
            state.pending[:] = [f for f in state.pending if not f.done()]
            state.pending.extend(futures)
    finally:
        with state.done:
            state.sending -= 1
            state.done.notify_all()
    if oldest_left is None:
        return None
    return max(oldest_left + min_age - time.monotonic(), 0.0)


def _send(peer: str, context_ids: list[int], me: str) -> Future[list[str]]:
    message = Release(context_ids, me)
    _context.counters["release_messages_sent"] += 1
    return _transport.call_async(peer, receive, (message,), _RELEASE_TIMEOUT_S)


def wait_for_releases(timeout: float = _RELEASE_TIMEOUT_S, *, transitive: bool = True) -> None:
    """Send the releases waiting here and wait until the workers they go to have dropped the
    contexts (each wait bounded by ``timeout``); calls still carrying releases are waited for
    first.

    ``transitive``: also ask every worker that took releases riding on calls since the last
    wait to do the same, since it may still hold forwards of them in its own outbox (then, when
    this returns, no worker holds a context released here). ``shutdown`` uses it, so that a
    worker leaves only once the contexts it released are gone everywhere, as before releases
    rode on calls (a release message's handler forwards it and waits).
    """
    state = _state
    with state.lock:
        rides, state.rides[:] = list(state.rides), []
    for ride in rides:  # a failed call puts its releases back before the flush below
        ride.settle()
    _flush()
    with state.done:
        state.done.wait_for(lambda: state.sending == 0, timeout=timeout)
    with state.pending_lock:
        futures: list[Future[Any]] = list(state.pending)
        state.pending[:] = []
    if transitive:
        with state.lock:
            rode, state.rode = state.rode, set()
        for peer in sorted(rode):
            try:
                futures.append(_transport.call_async(peer, _finish, (timeout,), timeout))
            except Exception:
                _context.counters["release_failures"] += 1
    for fut in futures:
        try:
            fut.wait()
        except Exception:
            _context.counters["release_failures"] += 1


def forget() -> None:
    """Drop the releases still waiting (this worker left its RPC group)."""
    with _state.lock:
        _state.outbox.clear()
        _state.rides.clear()
        _state.rode = set()


def _finish(timeout: float) -> None:
    """RPC handler: finish this worker's releases (see :func:`wait_for_releases`)."""
    wait_for_releases(timeout)


def release(context_id: int, sender: str | None) -> list[str]:
    """Drop the context here and on every worker it touched (except ``sender``), transitively,
    and wait for them. Returns one line per worker that could not be reached."""
    ctx = _context.pop(context_id)
    if ctx is None:
        return []
    me = _identity.worker_name()
    futures = [(peer, _send(peer, [context_id], me)) for peer in _peers_of(ctx, sender)]
    errors: list[str] = []
    for peer, fut in futures:
        try:
            errors.extend(fut.wait())
        except Exception as exc:
            errors.append(f"{peer}: {_transport.describe_error(exc)}")
    return errors


def receive(message: Release) -> list[str]:
    """RPC handler of a :class:`Release`."""
    return [line for cid in message.context_ids for line in release(cid, message.sender)]
