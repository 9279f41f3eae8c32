"""RPC calls that record send/recv pairs inside a distributed autograd context.

Outside a context these are torch's ``rpc_sync``, ``rpc_async`` and ``remote`` unchanged.
Inside one, the request carries the context id; tensors that require grad in the arguments
get a send record here and a recv node on the callee, and tensors that require grad in the
result get a send record on the callee and a recv node here. The callee runs ``func`` inside
the same context, so RPCs it makes in turn are recorded too (chains and loops). TorchScript
functions travel by their qualified name and are looked up on the callee, as torch does.

Cost per call inside a context: no extra message; one record per direction that carries
tensors requiring grad; the tensors are detached before they are sent. A call inside a context
also carries the releases of contexts this worker closed that wait for its callee (see
``_release``), so that a training loop's releases cost no message of their own.
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Generic, TypeAlias, TypeVar

import torch
from torch._C._distributed_rpc import WorkerInfo
from torch.distributed import rpc as torch_rpc
from torch.futures import Future

from distgrad.errors import RpcAutogradError
from distgrad.rpc import _identity, _liveness, _release, _transport
from distgrad.rpc._context import get_or_create, lookup
from distgrad.rpc._local import use_process_threads
from distgrad.rpc._pass import HOP_MARGIN_S
from distgrad.rpc._wire import Envelope, RRefBackward
from distgrad.rpc.backward import backward
from distgrad.rpc.send_recv import attach_recv, detach_for_send

__all__ = ["RRef", "remote", "rpc_async", "rpc_sync"]

T = TypeVar("T")
# torch's decorator (untyped): the callee answers when the returned future completes.
_async_execution: Callable[[Callable[..., Any]], Callable[..., Any]] = (
    torch_rpc.functions.async_execution
)
_UNSET = -1.0  # torch's "use the agent's default timeout"
Worker: TypeAlias = "str | int | WorkerInfo"


def rpc_sync(
    to: Worker,
    func: Callable[..., T],
    args: tuple[Any, ...] | None = None,
    kwargs: dict[str, Any] | None = None,
    timeout: float = _UNSET,
) -> T:
    """Run ``func(*args, **kwargs)`` on worker ``to`` and return its result.

    Inside a context, records a send/recv pair for the request and one for the response
    wherever they carry tensors that require grad. ``timeout`` in seconds (default: the RPC
    group's). An exception raised by ``func`` is raised here with its type, as torch does.

    Args:
        to: the worker, by name, ``WorkerInfo`` or rank.
        func: what to run there: a picklable callable, a builtin or a TorchScript function.
        args: its positional arguments.
        kwargs: its keyword arguments.
        timeout: seconds (default: the RPC group's).

    Returns:
        ``func``'s result.

    Raises:
        Exception: what ``func`` raised on ``to``, with its type, as torch raises it.
        RpcAutogradError: inside a context, recording the call failed (a TorchScript function no
            worker defines, a dead or unreachable worker).
        RuntimeError: RPC is not initialised, or the call timed out (torch's).

    Example:
        >>> dg.rpc.rpc_sync("worker0", torch.add, args=(torch.ones(2), 1))
        tensor([2., 2.])
    """
    context_id = _identity.current_context_id()
    if context_id is None:
        result: T = torch_rpc.rpc_sync(to, func, args, kwargs, timeout)
        return result
    # The answer is opened on this thread, not in a callback on an RPC thread: one thread
    # hand-off less per call.
    to_name, fut = _send_call(context_id, to, func, args, kwargs, timeout)
    opened: T = _open(fut.wait(), to_name)
    return opened


def rpc_async(
    to: Worker,
    func: Callable[..., T],
    args: tuple[Any, ...] | None = None,
    kwargs: dict[str, Any] | None = None,
    timeout: float = _UNSET,
) -> Future[T]:
    """Like :func:`rpc_sync`, but return a ``torch.futures.Future`` of the result; its
    ``wait()`` raises ``func``'s exception with its type.

    Args:
        to: the worker, by name, ``WorkerInfo`` or rank.
        func: what to run there: a picklable callable, a builtin or a TorchScript function.
        args: its positional arguments.
        kwargs: its keyword arguments.
        timeout: seconds (default: the RPC group's).

    Returns:
        A ``torch.futures.Future`` of ``func``'s result.

    Raises:
        Exception: what ``func`` raised on ``to``, with its type, as torch raises it.
        RpcAutogradError: inside a context, recording the call failed (a TorchScript function no
            worker defines, a dead or unreachable worker).
        RuntimeError: RPC is not initialised, or the call timed out (torch's).

    Example:
        >>> future = dg.rpc.rpc_async("worker0", torch.mul, args=(torch.ones(2), 3))
        >>> future.wait()
        tensor([3., 3.])
    """
    context_id = _identity.current_context_id()
    if context_id is None:
        return torch_rpc.rpc_async(to, func, args, kwargs, timeout)  # type: ignore[no-any-return]
    to_name, fut = _send_call(context_id, to, func, args, kwargs, timeout)
    result: Future[T] = Future()

    def opened(done: Future[Envelope]) -> None:
        # set_exception keeps the exception's type, where an error raised in a then()
        # callback would reach wait() as a RuntimeError.
        try:
            result.set_result(_open(done.wait(), to_name))
        except Exception as exc:
            result.set_exception(exc)  # type: ignore[arg-type]

    fut.add_done_callback(opened)
    return result


def remote(
    to: Worker,
    func: Callable[..., T],
    args: tuple[Any, ...] | None = None,
    kwargs: dict[str, Any] | None = None,
    timeout: float = _UNSET,
) -> RRef[T]:
    """Run ``func`` on ``to`` and return an :class:`RRef` to the result, which stays there.

    Inside a context, the request records a send/recv pair as in :func:`rpc_sync`; the result
    keeps its autograd history on its owner, and :meth:`RRef.to_here` records the fetch.

    Args:
        to: the worker, by name, ``WorkerInfo`` or rank.
        func: what to run there: a picklable callable, a builtin or a TorchScript function.
        args: its positional arguments.
        kwargs: its keyword arguments.
        timeout: seconds (default: the RPC group's).

    Returns:
        An ``RRef`` to the result, owned by ``to``.

    Raises:
        Exception: what ``func`` raised on ``to``, with its type, as torch raises it.
        RpcAutogradError: inside a context, recording the call failed (a TorchScript function no
            worker defines, a dead or unreachable worker).
        RuntimeError: RPC is not initialised, or the call timed out (torch's).

    Example:
        >>> rref = dg.rpc.remote("worker0", torch.add, args=(torch.ones(2), 1))
        >>> rref.owner_name(), rref.to_here()
        ('worker0', tensor([2., 2.]))
    """
    context_id = _identity.current_context_id()
    if context_id is None:
        return RRef._wrap(torch_rpc.remote(to, func, args, kwargs, timeout))
    to_name = _identity.name_of(to)
    request = _envelope(context_id, to_name, (tuple(args or ()), dict(kwargs or {})))
    wire_func = _by_reference(func)
    serve = _serve_async_remote if _is_async(func) else _serve_remote
    return RRef._wrap(_transport.remote(to_name, serve, (request, wire_func), timeout))


class RRef(Generic[T]):
    """A reference to a value owned by one worker; ``to_here()`` fetches a copy.

    Wraps ``torch.distributed.rpc.RRef``. ``RRef(value)`` makes a reference owned by this
    worker. Inside a context, ``to_here()`` records a send on the owner and a recv here for the
    tensors that require grad, so gradients flow back to the owner's graph.

    Args:
        value: the value this worker owns and the reference points to.

    Raises:
        RuntimeError: RPC is not initialised (torch's ``RRef``).

    Example:
        >>> rref = dg.rpc.RRef(torch.ones(2))
        >>> rref.is_owner(), rref.to_here()
        (True, tensor([1., 1.]))
    """

    def __init__(self, value: T) -> None:
        self._rref: torch_rpc.RRef[T] = torch_rpc.RRef(value)

    @classmethod
    def _wrap(cls, rref: torch_rpc.RRef[T]) -> RRef[T]:
        obj = cls.__new__(cls)
        obj._rref = rref
        return obj

    @property
    def torch_rref(self) -> torch_rpc.RRef[T]:
        """The wrapped ``torch.distributed.rpc.RRef``."""
        return self._rref

    def owner(self) -> WorkerInfo:
        """The ``WorkerInfo`` of the worker that owns the value."""
        return self._rref.owner()

    def owner_name(self) -> str:
        """The name of the worker that owns the value."""
        return self._rref.owner_name()

    def is_owner(self) -> bool:
        """Whether this worker owns the value."""
        return self._rref.is_owner()

    def local_value(self) -> T:
        """The value itself; only on its owner."""
        value: T = self._rref.local_value()
        return value

    def to_here(self, timeout: float = _UNSET) -> T:
        """A copy of the value on this worker (the value itself on the owner).

        Cost: one RPC to the owner, unless this worker owns it.
        """
        if self.is_owner():
            return self.local_value()
        if _identity.current_context_id() is None:
            return self._rref.to_here(timeout)
        fetched: T = rpc_sync(self.owner_name(), _local_value, args=(self._rref,), timeout=timeout)
        return fetched

    def rpc_sync(self, timeout: float = _UNSET) -> Any:
        """A proxy: ``rref.rpc_sync().method(*args)`` runs ``method`` on the value, on its
        owner, as :func:`rpc_sync` does (recorded inside a context)."""
        return _Proxy(self, rpc_sync, timeout)

    def rpc_async(self, timeout: float = _UNSET) -> Any:
        """A proxy: ``rref.rpc_async().method(*args)`` is a future of ``method``'s result."""
        return _Proxy(self, rpc_async, timeout)

    def remote(self, timeout: float = _UNSET) -> Any:
        """A proxy: ``rref.remote().method(*args)`` is an :class:`RRef` to ``method``'s
        result, which stays on the owner."""
        return _Proxy(self, remote, timeout)

    def backward(
        self,
        dist_autograd_ctx_id: int = -1,
        retain_graph: bool = False,
        *,
        mode: str = "fast",
    ) -> None:
        """Run a backward pass from the value, a tensor (a scalar), on its owner.

        With a context id: a distributed backward in that context, started on the owner as
        :func:`distgrad.rpc.backward` would be there (``mode`` as there); gradients land in
        the context on every worker the pass reaches. The owner must know the context (the
        value was made by a call in it, or a call in it reached the owner), as in torch.
        With the default ``-1``: torch's local ``backward`` on the owner, which writes
        ``.grad``; only for an RRef this worker owns. A user RRef needs a context id, as
        torch's does. The value must be a tensor, else a ``RuntimeError`` in torch's words.

        Cost: the backward's; from a user RRef, one more RPC to the owner, answered when the
        pass is over.
        """
        if self.is_owner():
            _backward_from(self.local_value(), dist_autograd_ctx_id, retain_graph, mode, None)
            return
        if dist_autograd_ctx_id == -1:
            raise RpcAutogradError(
                "User RRefs require 'dist_autograd_ctx_id' to be specified: the value lives on "
                f"{self.owner_name()}, and a backward started from {_identity.worker_name()} "
                "runs there in a distributed autograd context"
            )
        budget = _identity.rpc_timeout()
        request = RRefBackward(self._rref, dist_autograd_ctx_id, retain_graph, mode, budget)
        # Not a recorded call: the owner learns no context from it, as torch's RRefBackwardReq.
        owner = self.owner_name()
        fut = _transport.call_async(owner, _serve_rref_backward, (request,), budget + HOP_MARGIN_S)
        failed: Exception | None = fut.wait()
        if failed is not None:
            raise failed

    def __repr__(self) -> str:
        return f"distgrad.rpc.RRef(owner={self.owner_name()!r})"


class _Proxy:
    """``rref.rpc_sync()`` and its siblings: attribute ``name`` is a call of the value's
    method ``name`` on its owner."""

    def __init__(self, rref: RRef[Any], call: Callable[..., Any], timeout: float) -> None:
        self._rref = rref
        self._call = call
        self._timeout = timeout

    def __getattr__(self, name: str) -> Callable[..., Any]:
        def method(*args: Any, **kwargs: Any) -> Any:
            try:
                invoke = _invoke_async if _method_is_async(self._rref, name) else _invoke
            except AttributeError as missing:
                if self._call is not rpc_async:
                    raise
                failed: Future[Any] = Future()  # as torch's: the future holds the error
                failed.set_exception(missing)
                return failed
            args = (self._rref.torch_rref, name, args, kwargs)
            return self._call(self._rref.owner_name(), invoke, args=args, timeout=self._timeout)

        return method


def _invoke(
    rref: torch_rpc.RRef[Any], name: str, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> Any:
    return getattr(rref.local_value(), name)(*args, **kwargs)


@_async_execution
def _invoke_async(
    rref: torch_rpc.RRef[Any], name: str, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> Any:
    return getattr(rref.local_value(), name)(*args, **kwargs)


def _method_is_async(rref: RRef[Any], name: str) -> bool:
    """Whether the value's method ``name`` is marked ``async_execution`` (its type is asked
    of the owner once, by torch, as torch's proxies do). A name the value does not have
    raises torch's AttributeError (``type object 'Tensor' has no attribute 'x'``) here, before
    any call; one the value has but its type lacks (a submodule, an attribute set in
    ``__init__``), which torch's proxies refuse, is called (the owner is asked, one RPC)."""
    with _transport.marked():  # torch's own queries, allowed inside a context
        value_type = rref.torch_rref._get_type(blocking=True)  # type: ignore[call-arg]
        if issubclass(value_type, torch.jit.ScriptModule | torch._C.ScriptModule):
            return False  # as torch's: script methods are not on the type
        found = getattr(value_type, name, None)
        if found is None and not _value_has(rref, name):
            getattr(value_type, name)  # torch's error, in torch's words
    return _is_async(found)


def _value_has(rref: RRef[Any], name: str) -> bool:
    if rref.is_owner():
        return _has_attribute(rref.torch_rref, name)
    found: bool = torch_rpc.rpc_sync(rref.owner_name(), _has_attribute, (rref.torch_rref, name))
    return found


def _has_attribute(rref: torch_rpc.RRef[Any], name: str) -> bool:
    return hasattr(rref.local_value(), name)


def _serve_rref_backward(request: RRefBackward) -> Exception | None:
    """On the owner: the backward a user RRef asked for (its budget is the sender's, less a
    hop's margin, so a timeout is reported here first). Its error is the answer, not raised:
    torch's RPC would hand the sender a RuntimeError for any type not built into Python
    (``UnknownContextError: On WorkerInfo...``); the sender raises it with its type."""
    budget = max(request.budget - HOP_MARGIN_S, 0.1)
    try:
        value = request.rref.local_value()
        _backward_from(value, request.context_id, request.retain_graph, request.mode, budget)
    except Exception as exc:
        return exc
    return None


def _backward_from(
    value: Any, context_id: int, retain_graph: bool, mode: str, timeout: float | None
) -> None:
    if not isinstance(value, torch.Tensor):
        raise RpcAutogradError(
            "RRef should contain a tensor for .backward(), got a "
            f"{type(value).__name__} on {_identity.worker_name()}"
        )
    if context_id == -1:
        torch.autograd.backward([value], retain_graph=retain_graph)
    else:
        backward(context_id, [value], retain_graph, mode=mode, timeout=timeout)  # type: ignore[arg-type]


def _local_value(rref: torch_rpc.RRef[T]) -> T:
    value: T = rref.local_value()
    return value


@dataclass(frozen=True)
class _ScriptFunctionRef:
    """A TorchScript function named by its qualified name (script functions do not pickle)."""

    qualified_name: str

    def resolve(self) -> Callable[..., Any]:
        name = self.qualified_name.removeprefix("__torch__.")
        module_name, _, attr = name.rpartition(".")
        try:
            module = sys.modules.get(module_name) or importlib.import_module(module_name)
            found = getattr(module, attr)
        except (ImportError, AttributeError):
            found = None
        if not isinstance(found, torch.jit.ScriptFunction):
            raise RpcAutogradError(
                f"TorchScript function {self.qualified_name} is not defined on "
                f"{_identity.worker_name()}: define it (with @torch.jit.script) in a module that "
                "every worker can import"
            )
        return found


# What a call sends as its function: the function, or a TorchScript function's name.
_WireFunction: TypeAlias = "Callable[..., Any] | _ScriptFunctionRef"


def _by_reference(func: Callable[..., Any]) -> _WireFunction:
    if isinstance(func, torch.jit.ScriptFunction):
        return _ScriptFunctionRef(torch._jit_internal._qualified_name(func))
    return func


def _send_call(
    context_id: int,
    to: Worker,
    func: Callable[..., Any],
    args: tuple[Any, ...] | None,
    kwargs: dict[str, Any] | None,
    timeout: float,
) -> tuple[str, Future[Envelope]]:
    """Send the request of a call made inside a context; the future's value is the answer."""
    to_name = _identity.name_of(to)
    request = _envelope(context_id, to_name, (tuple(args or ()), dict(kwargs or {})))
    wire_func = _by_reference(func)

    serve = _serve_async_call if _is_async(func) else _serve_call

    def send(releases: list[int] | None) -> Future[Envelope]:
        request.releases = releases
        return _transport.call_async(to_name, serve, (request, wire_func), timeout)

    return to_name, _release.carry(to_name, send)


def _envelope(context_id: int, to_name: str, payload: Any) -> Envelope:
    ctx = lookup(context_id)
    sent, message_id, positions, lineage = detach_for_send(ctx, to_name, payload)
    return Envelope(context_id, _identity.worker_name(), sent, message_id, positions, lineage)


def _open(envelope: Envelope, from_worker: str) -> Any:
    """Unpack an envelope on its receiver, attaching a recv node where tensors required grad."""
    ctx = get_or_create(envelope.context_id)
    e = envelope
    return attach_recv(ctx, from_worker, e.payload, e.message_id, e.positions, e.lineage)


def _run_inside(request: Envelope, func: _WireFunction) -> Any:
    use_process_threads()  # the same bits whichever agent thread serves the call (_local)
    _transport.install_guard()
    _liveness.ensure_started()
    if request.releases:
        _release.drop_riding(request.releases, request.sender)
    if isinstance(func, _ScriptFunctionRef):
        func = func.resolve()
    args, kwargs = _open(request, request.sender)
    previous = _identity.set_current(request.context_id)
    try:
        return func(*args, **kwargs)
    finally:
        _identity.set_current(previous)


def _serve_call(request: Envelope, func: _WireFunction) -> Envelope:
    result = _run_inside(request, func)
    return _envelope(request.context_id, request.sender, result)


def _serve_remote(request: Envelope, func: _WireFunction) -> Any:
    return _run_inside(request, func)


@_async_execution
def _serve_async_call(request: Envelope, func: _WireFunction) -> Future[Envelope]:
    """A function marked ``async_execution`` returns a future; the answer goes when it
    completes, with what its value requires grad recorded as any call's result."""
    pending: Future[Any] = _run_inside(request, func)
    return pending.then(lambda done: _envelope(request.context_id, request.sender, done.wait()))


@_async_execution
def _serve_async_remote(request: Envelope, func: _WireFunction) -> Future[Any]:
    return _run_inside(request, func)  # type: ignore[no-any-return]


def _is_async(func: object) -> bool:
    return hasattr(func, "_wrapped_async_rpc_function")
