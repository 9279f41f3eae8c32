"""Dropping the contexts of workers that are gone.

A worker holding a context that another worker opened learns that it may drop it only from a
release, which a worker that died never sends. So a watchdog thread checks, every
``PERIOD_S`` while such contexts exist, that the workers they involve (the worker that opened
the context and every worker it exchanged messages with) still answer a ping: one ping per
worker per round, in parallel, whatever the number of contexts. A context that involves a
worker that cannot be reached (a connection error: a SIGKILLed peer fails a ping within about
a millisecond here) is dropped with its records and gradients; a slow answer is not taken for
death. A later message for the context gets an error naming the worker that was gone.
"""

from __future__ import annotations

import threading

from distgrad.rpc import _context, _identity, _transport

__all__ = ["PERIOD_S", "check_once", "ensure_started", "stop"]

PERIOD_S = 0.25
_PING_TIMEOUT_S = 5.0

_thread: threading.Thread | None = None
_stop = threading.Event()
_lock = threading.Lock()


def ensure_started() -> None:
    """Start the watchdog on this worker if it is not running (cheap when it is)."""
    global _thread
    if _thread is not None and _thread.is_alive():
        return
    with _lock:
        if _thread is None or not _thread.is_alive():
            _stop.clear()
            _thread = threading.Thread(target=_loop, name="distgrad-liveness", daemon=True)
            _thread.start()


def stop(timeout: float = 2.0) -> None:
    """Stop the watchdog (before the RPC agent goes down)."""
    global _thread
    _stop.set()
    with _lock:
        thread, _thread = _thread, None
    if thread is not None and thread is not threading.current_thread():
        thread.join(timeout)


def _loop() -> None:
    while not _stop.wait(PERIOD_S):
        try:
            check_once()
        except Exception:  # the agent is going down: the next round (if any) tries again
            _context.counters["liveness_check_failures"] += 1


def check_once() -> list[str]:
    """One round: ping the peers of the contexts opened elsewhere, drop those of dead peers.

    Returns the workers found gone.
    """
    me, my_id = _identity.worker_name(), _identity.worker_id()
    foreign = [c for c in _context.live_contexts() if _identity.creator_of(c.context_id) != my_id]
    if not foreign:
        return []
    involved: dict[int, set[str]] = {}
    for ctx in foreign:
        # No lock: a backward phase holds it as long as it runs (here, while a dead root's
        # part of the backward keeps this worker busy).
        peers = set(ctx.known_workers)
        peers.add(_identity.name_of(_identity.creator_of(ctx.context_id)))
        involved[ctx.context_id] = peers - {me}
    everyone = sorted(set().union(*involved.values()))
    pings = [(peer, _transport.ping(peer, _PING_TIMEOUT_S)) for peer in everyone]
    gone: dict[str, str] = {}
    for peer, fut in pings:
        try:
            fut.wait()
        except Exception as exc:
            why = _transport.describe_error(exc)
            if "timed out" not in why.lower() and "timeout" not in why.lower():
                gone[peer] = why
    for ctx in foreign:
        dead = sorted(involved[ctx.context_id] & gone.keys())
        if dead:
            _drop(ctx, dead[0], gone[dead[0]])
    return sorted(gone)


def _drop(ctx: _context.DistAutogradContext, worker: str, why: str) -> None:
    reason = (
        f"it was released here because {worker}, a worker of this context, stopped answering "
        f"({why})"
    )
    if _context.pop(ctx.context_id, reason) is None:
        return
    _context.counters["contexts_dropped_peer_gone"] += 1
    # A phase still running holds the lock and the context; it lets go when it ends (its answer
    # cannot be delivered), and the records go with it.
    if ctx.lock.acquire(blocking=False):
        try:
            ctx.sends.clear()
            ctx.recvs.clear()
            ctx.pass_states.clear()
        finally:
            ctx.lock.release()
