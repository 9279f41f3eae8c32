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
import copyreg
import io
import pickle
import sys
import threading
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import Tensor
from torch._C._distributed_rpc import PyRRef, WorkerInfo, _invoke_rpc_python_udf
from torch.distributed import rpc as torch_rpc
from torch.distributed.rpc import api, internal
from torch.distributed.rpc.internal import PythonUDF
from torch.futures import Future

from distgrad.errors import RpcAutogradError
from distgrad.rpc import _identity
from distgrad.rpc._patch import Patch

__all__ = [
    "call_async",
    "describe_error",
    "forget",
    "install_guard",
    "marked",
    "ping",
    "remote",
]

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


_workers: dict[str, WorkerInfo] = {}  # name -> for the current RPC group


def call_async(
    to: str, fn: Callable[..., Any], args: tuple[Any, ...], timeout: float
) -> Future[Any]:
    """Send one of distgrad's messages: ``fn(*args)`` on ``to``; a future of its answer.

    What ``torch.distributed.rpc.rpc_async`` does for a Python function, minus its Python
    layers (initialization check, builtin lookup, worker lookup by name, profiler scope): the
    same pickler and the same C++ call. Those layers cost the sending thread 0.12-0.13 ms per
    message (0.43-0.45 ms against 0.56-0.58 ms, paired, on a loaded 2-core machine), and a
    round trip's step sends two from its root. With torch's legacy profiler on, the
    message goes through torch's ``rpc_async``, which records it.
    """
    info = _workers.get(to)
    if info is None or torch.autograd._profiler_enabled():  # type: ignore[attr-defined]
        return _torch_call_async(to, fn, args, timeout)
    pickled, tensors = _serializer.serialize(PythonUDF(fn, args, {}))
    is_async = hasattr(fn, "_wrapped_async_rpc_function")  # torch's async_execution mark
    return _invoke_rpc_python_udf(info, pickled, tensors, timeout, is_async)  # type: ignore[arg-type,no-any-return]


def _tensor_at(index: int) -> Tensor:
    """Unpickling a message: its ``index``-th tensor, which torch's RPC carried beside it."""
    return internal._thread_local_tensor_tables.recv_tables[index]  # type: ignore[no-any-return]


class _Serializer(threading.local):
    """torch's RPC pickling (bytes plus a table of the tensors, which travel beside them), with
    one buffer and one dispatch table per thread kept between messages.

    torch's ``_InternalRPCPickler.serialize`` builds its dispatch table per message, and
    pickles each tensor as ``getattr(_InternalRPCPickler, '_tensor_receiver')``, two globals;
    here a tensor is one global, :func:`_tensor_at`. The receiver is torch's own
    ``deserialize``. The same reducers are used (RRefs, and those registered with torch's
    pickler); a message pickled while one is being pickled on this thread goes to torch's.

    The pickler itself is made per message and dropped before the answer returns. A pickler
    kept between messages segfaulted the process (4 of 64 runs of the trainers-and-servers
    test; a core showed the garbage collector, on another thread, visiting a freed object in
    the kept pickler's memo): ``clear_memo()`` drops each memoized object before it empties
    the table, and dropping the previous message's last tensor may let another thread run
    and collect while the table still names it. A dropped pickler leaves the collector's
    view before its memo is freed.
    """

    def __init__(self) -> None:
        self.buffer = io.BytesIO()
        self.table: dict[type, Callable[..., Any]] = {}  # a pickler dispatch table
        self.tensors: list[Tensor] = []
        self.busy = False
        self.registered = -1  # how many reducers torch's pickler had when the table was made

    def _reduce_tensor(self, tensor: Tensor) -> tuple[Callable[[int], Tensor], tuple[int]]:
        self.tensors.append(tensor)
        return _tensor_at, (len(self.tensors) - 1,)

    def _table(self) -> None:
        torch_pickler: Any = internal._internal_rpc_pickler
        table = copyreg.dispatch_table.copy()
        table[Tensor] = self._reduce_tensor
        table[PyRRef] = torch_pickler._py_rref_reducer
        table[torch_rpc.RRef] = torch_pickler._rref_reducer
        table.update(torch_pickler._class_reducer_dict)
        self.table = table
        self.registered = len(torch_pickler._class_reducer_dict)

    def serialize(self, obj: Any) -> tuple[bytes, list[Tensor]]:
        if self.busy:
            return api._default_pickler.serialize(obj)  # type: ignore[no-any-return,no-untyped-call]
        if self.registered != len(internal._internal_rpc_pickler._class_reducer_dict):
            self._table()
        self.busy = True
        try:
            self.buffer.seek(0)
            self.buffer.truncate()
            self.tensors = []
            pickler = pickle.Pickler(self.buffer)
            pickler.dispatch_table = self.table  # type: ignore[assignment]
            pickler.dump(obj)
            del pickler  # while every object its memo names is still alive (see above)
            return self.buffer.getvalue(), self.tensors
        finally:
            self.tensors = []
            self.busy = False


_serializer = _Serializer()


def _torch_call_async(
    to: str, fn: Callable[..., Any], args: tuple[Any, ...], timeout: float
) -> Future[Any]:
    previous = getattr(_marked, "on", False)  # marked() inlined: this runs on every message
    _marked.on = True
    try:
        fut = torch_rpc.rpc_async(to, fn, args=args, timeout=timeout)
    finally:
        _marked.on = previous
    if to not in _workers:
        _workers[to] = api._get_current_rpc_agent().get_worker_info(to)  # type: ignore[attr-defined]
    return fut  # type: ignore[no-any-return]


def forget() -> None:
    """Forget the workers of the RPC group (this worker left it, or joins another)."""
    _workers.clear()


def remote(
    to: str, fn: Callable[..., Any], args: tuple[Any, ...], timeout: float
) -> torch_rpc.RRef[Any]:
    """``torch.distributed.rpc.remote`` for distgrad's own use; returns torch's RRef."""
    with marked():
        return torch_rpc.remote(to, fn, args=args, timeout=timeout)  # type: ignore[no-any-return]


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


_GUARD: Patch[Callable[[str | int | WorkerInfo], WorkerInfo]] = Patch()  # torch's, once wrapped


def install_guard() -> None:
    """Refuse torch's own RPC calls on threads inside a distgrad context (idempotent)."""
    _GUARD.install(api, "_to_worker_info", _guarded)


def _guarded(to: str | int | WorkerInfo) -> WorkerInfo:
    context_id = _identity.current_context_id()
    if context_id is not None and not getattr(_marked, "on", False):
        raise RpcAutogradError(_refusal(context_id))
    original = _GUARD.original
    assert original is not None
    return original(to)


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
