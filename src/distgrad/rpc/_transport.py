"""The one door to ``torch.distributed.rpc`` for distgrad's own messages, and a guard on torch's.

Every message distgrad sends (call requests, gradient messages, lineage queries, releases,
pings) goes out through :func:`call_async` or :func:`remote`, which mark the calling thread for
the duration of the send. While a thread is inside a distgrad context, a call to torch's own
``rpc_sync``, ``rpc_async`` or ``remote`` that is not so marked is refused with an error: it
would record nothing for distgrad's backward, so the gradients through it would be silently
missing. The guard wraps ``torch.distributed.rpc.api._to_worker_info``, the one function all
three call first; outside distgrad contexts it costs one thread-local read per call.
"""

from __future__ import annotations

import contextlib
import sys
import threading
from collections.abc import Callable, Iterator
from typing import Any

from torch.distributed import rpc as torch_rpc
from torch.futures import Future

from distgrad.errors import RpcAutogradError
from distgrad.rpc import _identity

__all__ = ["call_async", "describe_error", "install_guard", "marked", "ping", "remote"]

_marked = threading.local()


@contextlib.contextmanager
def marked() -> Iterator[None]:
    """Let torch's RPC calls through on this thread (distgrad's own, or torch's shutdown)."""
    previous = getattr(_marked, "on", False)
    _marked.on = True
    try:
        yield
    finally:
        _marked.on = previous


def call_async(
    to: str, fn: Callable[..., Any], args: tuple[Any, ...], timeout: float
) -> Future[Any]:
    """Send one of distgrad's messages: ``fn(*args)`` on ``to``; a future of its answer."""
    previous = getattr(_marked, "on", False)  # marked() inlined: this runs on every message
    _marked.on = True
    try:
        return torch_rpc.rpc_async(to, fn, args=args, timeout=timeout)  # type: ignore[no-any-return]
    finally:
        _marked.on = previous


def remote(to: str, fn: Callable[..., Any], args: tuple[Any, ...], timeout: float) -> Any:
    """``torch.distributed.rpc.remote`` for distgrad's own use; returns torch's RRef."""
    with marked():
        return torch_rpc.remote(to, fn, args=args, timeout=timeout)


def _pong() -> bool:
    return True


def ping(to: str, timeout: float) -> Future[Any]:
    """A future that completes when ``to`` answers, or fails when it cannot be reached."""
    return call_async(to, _pong, (), timeout)


def describe_error(exc: BaseException) -> str:
    """``Type: message`` of an error, unwrapping the text torch's RPC adds to remote errors."""
    lines = [line for line in str(exc).strip().splitlines() if line.strip()]
    if len(lines) >= 2 and "On WorkerInfo(" in lines[0]:
        return lines[1][:300]  # the remote exception's repr, e.g. ValueError('...')
    return f"{type(exc).__name__}: {lines[0][:300] if lines else ''}"


_original: Callable[[Any], Any] | None = None
_install_lock = threading.Lock()


def install_guard() -> None:
    """Refuse torch's own RPC calls on threads inside a distgrad context (idempotent)."""
    global _original
    if _original is not None:
        return
    from torch.distributed.rpc import api

    with _install_lock:
        if _original is None:
            _original = api._to_worker_info  # type: ignore[attr-defined]
            api._to_worker_info = _guarded  # type: ignore[attr-defined]


def _guarded(to: Any) -> Any:
    context_id = _identity.current_context_id()
    if context_id is not None and not getattr(_marked, "on", False):
        raise RpcAutogradError(_refusal(context_id))
    assert _original is not None
    return _original(to)


def _refusal(context_id: int) -> str:
    # Frames: _refusal <- _guarded <- remote or _invoke_rpc <- rpc_sync or rpc_async.
    caller = sys._getframe(2).f_code.co_name
    if caller == "_invoke_rpc":
        caller = sys._getframe(3).f_code.co_name
    name = caller if caller in ("rpc_sync", "rpc_async", "remote") else "rpc_sync/rpc_async/remote"
    return (
        f"torch.distributed.rpc.{name} was called on {_identity.worker_name()} inside "
        f"distgrad.rpc context {context_id}: torch's own calls record nothing for distgrad's "
        "distributed backward, so gradients through them would be silently missing. Call "
        f"distgrad.rpc.{name} instead (same signature), or make the call outside the "
        "`with distgrad.rpc.context()` block"
    )
