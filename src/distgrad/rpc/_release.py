"""Releasing a context on every worker it touched.

A context is dropped on the worker that opened it when its ``with`` block exits, and a release
message goes to every worker it exchanged messages with; each of them drops its copy and
forwards the release to the workers it knows of, so the release is transitive. By default the
releases travel on a background thread, as torch's do: sending an RPC costs the calling thread
about 0.1 ms (pickling, handing the message to the transport), which stays out of the step.
That thread gathers the releases of a few milliseconds into one message per worker: a training
loop closes a context every few milliseconds, and a message each is an RPC handled on every
peer per step.
"""

from __future__ import annotations

import queue
import threading
import time
from typing import Any

from distgrad.rpc import _context, _identity, _transport
from distgrad.rpc._wire import Release

__all__ = ["release", "release_in_background", "wait_for_releases"]

_RELEASE_TIMEOUT_S = 10.0
_GATHER_S = 0.005  # how long the sender thread gathers releases before sending them

_pending: list[Any] = []  # futures of releases sent in the background
_pending_lock = threading.Lock()
# Releases waiting for the sender thread: (context id, this worker's name, peers to tell).
_outbox: queue.SimpleQueue[tuple[int, str, list[str]]] = queue.SimpleQueue()
_unsent = 0  # entries put in the outbox and not yet sent; guarded by _done
_done = threading.Condition()
_sender: threading.Thread | None = None


def _peers_of(ctx: _context.DistAutogradContext, sender: str | None) -> list[str]:
    me = _identity.worker_name()
    with ctx.lock:
        peers = sorted(ctx.known_workers - {sender, me})
        ctx.sends.clear()
        ctx.recvs.clear()
        ctx.pass_states.clear()
    return peers


def release_in_background(context_id: int) -> None:
    """Drop the context here; the sender thread tells the workers it touched."""
    global _unsent, _sender
    ctx = _context.pop(context_id)
    if ctx is None:
        return
    peers = _peers_of(ctx, None)
    if not peers:
        return
    with _done:
        _unsent += 1
        if _sender is None or not _sender.is_alive():
            _sender = threading.Thread(target=_send_loop, name="distgrad-releases", daemon=True)
            _sender.start()
    _outbox.put((context_id, _identity.worker_name(), peers))


def _send_loop() -> None:
    global _unsent
    while True:
        batch = [_outbox.get()]
        time.sleep(_GATHER_S)
        while True:
            try:
                batch.append(_outbox.get_nowait())
            except queue.Empty:
                break
        by_peer: dict[tuple[str, str], list[int]] = {}
        for context_id, me, peers in batch:
            for peer in peers:
                by_peer.setdefault((peer, me), []).append(context_id)
        futures = []
        for (peer, me), context_ids in by_peer.items():
            try:
                futures.append(_send(peer, context_ids, me))
            except Exception:  # the agent is gone (shutdown): nothing left to release
                _context.counters["release_failures"] += 1
        with _pending_lock:
            _pending[:] = [f for f in _pending if not f.done()]
            _pending.extend(futures)
        with _done:
            _unsent -= len(batch)
            _done.notify_all()


def _send(peer: str, context_ids: list[int], me: str) -> Any:
    message = Release(context_ids, me)
    return _transport.call_async(peer, receive, (message,), _RELEASE_TIMEOUT_S)


def wait_for_releases(timeout: float = _RELEASE_TIMEOUT_S) -> None:
    """Wait for the releases sent in the background (each bounded by ``timeout``)."""
    with _done:
        _done.wait_for(lambda: _unsent == 0, timeout=timeout)
    with _pending_lock:
        futures, _pending[:] = list(_pending), []
    for fut in futures:
        try:
            fut.wait()
        except Exception:
            _context.counters["release_failures"] += 1


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
