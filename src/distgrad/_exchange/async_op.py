"""``async_op=True``: a collective's result that waits for its data on first use.

An op called with ``async_op=True`` starts its exchange on the calling thread, in call order (so
every rank's collectives stay in the same order whatever runs in between), and returns at once
an :class:`AsyncTensor`: a tensor whose shape, dtype and device are known and whose data is
still on its way. Any operation that reads it waits first; the wait and the op's last steps (the
copies after the exchange, the guard's check) run then, on the thread that reads it.

Inside the op itself, between the exchange and the return, the library's own code keeps
working on the result (a ``movedim``, a dtype view, an average's division). Those operations
must not wait, or the call would block after all, so while an op with ``async_op=True`` runs
(:func:`deferred`), an operation on an ``AsyncTensor`` is recorded instead of run: its output's
metadata comes from running it on ``meta`` tensors, and it runs for real on first use. Autograd
sits above this and records every step as usual, so the graph, and the gradients, are those of
the blocking call. The backward's exchange of such an op is started the same way, and the
gradient it returns waits on first use (by the next node of the backward, or by
``AccumulateGrad``).
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any, TypeVar, cast

import torch
from torch import Tensor
from torch.utils._pytree import tree_flatten, tree_unflatten

from distgrad._exchange.inflight import Pending

__all__ = ["AsyncTensor", "deferred", "deferring", "offers_async_op", "resolved", "started"]


class _State(threading.local):
    # A class default: reading an attribute a thread never set finds it here, where
    # ``getattr(local, name, default)`` raises and catches an AttributeError (0.5 us, at every
    # operation on an AsyncTensor).
    on = False


_state = _State()


def deferring() -> bool:
    """Whether an op with ``async_op=True`` is running on this thread (see the module's doc).

    Read by ``AsyncTensor``'s dispatch alone. The op path never reads it: a collective's
    ``async_op`` goes into its plan (``Plan.async_op``), which carries it to the exchange (the
    ``in_flight`` form) and to the backward."""
    return _state.on


@contextmanager
def deferred() -> Iterator[None]:
    """Run the block as the inside of an op with ``async_op=True``."""
    if deferring():  # an op built on another: one scope, the outermost
        yield
        return
    _state.on = True
    try:
        yield
    finally:
        _state.on = False


_F = TypeVar("_F", bound=Callable[..., Any])


def offers_async_op(op: _F) -> _F:
    """Give a public op its ``async_op=True``: the call runs :func:`deferred`.

    Under ``torch.compile`` the call is traced as the blocking one: the compiled graph orders
    its exchanges itself, and a tensor that waits on first use computes the same values.
    """

    @functools.wraps(op)
    def call(*args: Any, **kwargs: Any) -> Any:
        if kwargs.get("async_op") and not torch.compiler.is_compiling():
            with deferred():
                return op(*args, **kwargs)
        return op(*args, **kwargs)

    return cast(_F, call)


def started(
    pending: Pending[Any],
    like: Tensor,
    device: torch.device,
    finish: Callable[[Any], Tensor] | None = None,
) -> Tensor:
    """The result of an exchange in flight: ``finish(pending.wait())`` (or the wait's tensor),
    with the metadata of the meta tensor ``like`` on ``device``."""

    def result() -> Tensor:
        value = pending.wait()
        return finish(value) if finish is not None else cast(Tensor, value)

    return AsyncTensor(like, device, result)


def resolved(x: Tensor) -> Tensor:
    """``x``'s data as a plain tensor, waiting for it when ``x`` is an :class:`AsyncTensor`.
    Not recorded by autograd: for handing a tensor to the exchanges themselves."""
    return x._resolve() if isinstance(x, AsyncTensor) else x


class AsyncTensor(Tensor):
    """A collective's result that may still be in flight: it waits for its data on first use.

    Returned by the collectives called with ``async_op=True``. Use it as any tensor: the first
    operation that reads it waits for the exchange (and raises its error, if it failed); so
    does :meth:`wait`, which returns it as a plain tensor, still part of the autograd graph.
    ``.shape``, ``.dtype``, ``.device`` and ``.requires_grad`` never wait.

    Args:
        meta: a tensor on the meta device with the result's shape, strides and dtype.
        device: the device the result will be on.
        source: what waits for the exchange and returns the data; called once, at first use.

    Raises:
        Nothing when made (the collectives make it; users do not): the exchange's own error
        (``CollectiveMismatchError``, ``DistBackendError``, as the blocking call raises it) at the
        first use that reads the data, or at ``wait()``.

    Example:
        >>> arrived = []  # made by hand here, to show when it waits (on one rank the
        >>> def exchange():  # collectives have nothing to wait for)
        ...     arrived.append(True)
        ...     return torch.tensor([1.0, 2.0])
        >>> y = dg.AsyncTensor(torch.empty(2, device="meta"), torch.device("cpu"), exchange)
        >>> y.shape, arrived  # the shape never waits
        (torch.Size([2]), [])
        >>> y * 3, arrived  # the first use does
        (tensor([3., 6.]), [True])
        >>> y.wait()
        tensor([1., 2.])
    """

    _meta: Tensor
    _source: Callable[[], Tensor] | None
    _value: Tensor | None

    # Operations go straight to __torch_dispatch__, below autograd, which records them as usual.
    __torch_function__ = torch._C._disabled_torch_function_impl  # type: ignore[assignment]

    @staticmethod
    def __new__(
        cls, meta: Tensor, device: torch.device, source: Callable[[], Tensor]
    ) -> AsyncTensor:
        out = torch.Tensor._make_wrapper_subclass(  # type: ignore[attr-defined]
            cls,
            meta.shape,
            strides=meta.stride(),
            storage_offset=meta.storage_offset(),
            dtype=meta.dtype,
            device=device,
            requires_grad=False,
        )
        out._meta = meta
        out._source = source
        out._value = None
        return out

    def __init__(self, meta: Tensor, device: torch.device, source: Callable[[], Tensor]) -> None:
        super().__init__()

    @property
    def done(self) -> bool:
        """Whether the data is here: a :meth:`wait` or a use already waited for it."""
        return self._value is not None

    def wait(self) -> Tensor:
        """Wait for the data, and return it as a plain tensor in the same autograd graph."""
        if self.requires_grad:
            return cast(Tensor, _Waited.apply(self))  # type: ignore[no-untyped-call]
        return self._resolve()

    def _resolve(self) -> Tensor:
        if self._value is None:
            assert self._source is not None
            with torch.no_grad():
                self._value = self._source()
            self._source = None  # the exchange's buffers and steps can go
        return self._value

    def __repr__(self) -> str:  # type: ignore[override]
        return f"AsyncTensor({self._resolve()!r})"

    # What reads memory without an operation (pickling, NumPy) gets the data, waited for.
    def __reduce_ex__(self, protocol: Any) -> Any:
        return self._resolve().__reduce_ex__(protocol)  # type: ignore[no-untyped-call]

    def numpy(self, *, force: bool = False) -> Any:
        return self._resolve().numpy(force=force)

    @classmethod
    def __torch_dispatch__(  # type: ignore[override]
        cls,
        func: Any,
        types: Any,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        kwargs = kwargs or {}
        if deferring() and not func._schema.is_mutable and "device" not in kwargs:
            later = _later(func, args, kwargs)
            if later is not None:
                return later
        return func(*_map(_resolve, args), **_map_values(_resolve, kwargs))


# Arguments are flat tuples of tensors, scalars and lists of them (aten's schemas): mapped here
# directly, not through torch's pytree, which costs 20-40 us per call at this rate.
def _map(fn: Callable[[Any], Any], args: tuple[Any, ...] | list[Any]) -> list[Any]:
    return [[fn(a) for a in arg] if isinstance(arg, (list, tuple)) else fn(arg) for arg in args]


def _map_values(fn: Callable[[Any], Any], kwargs: dict[str, Any]) -> dict[str, Any]:
    return {k: fn(v) for k, v in kwargs.items()} if kwargs else kwargs


def _resolve(x: Any) -> Any:
    return x._resolve() if isinstance(x, AsyncTensor) else x


def _meta_of(x: Any) -> Any:
    if isinstance(x, AsyncTensor):
        return x._meta
    if isinstance(x, Tensor):
        return torch.empty_strided(x.shape, x.stride(), dtype=x.dtype, device="meta")
    return x


# Ops that give a new tensor object on the same data with the same metadata: recorded without
# running them on meta tensors.
_SAME_METADATA = frozenset({torch.ops.aten.detach.default, torch.ops.aten.alias.default})


def _later(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """``func`` on ``args``, recorded to run on first use: outputs with the metadata of ``func``
    on meta tensors. None when ``func`` cannot run on meta tensors (then it runs now)."""
    first = next(a for a in _flat(args, kwargs) if isinstance(a, AsyncTensor))
    run = _RunOnce(func, args, kwargs)
    if func in _SAME_METADATA and len(args) == 1:
        return AsyncTensor(first._meta, first.device, functools.partial(run.output, 0))
    if _keeps_metadata(func, first, args, kwargs):
        meta = first._meta  # (empty_like on meta tensors runs torch's Python reference: slow)
        like = torch.empty_strided(meta.shape, meta.stride(), dtype=meta.dtype, device="meta")
        return AsyncTensor(like, first.device, functools.partial(run.output, 0))
    try:
        metas = func(*_map(_meta_of, args), **_map_values(_meta_of, kwargs))
    except Exception:  # data-dependent, or not defined for meta tensors: run it now
        return None
    outputs, spec = tree_flatten(metas)
    wrapped = [
        AsyncTensor(m, first.device, functools.partial(run.output, i))
        if isinstance(m, Tensor)
        else m
        for i, m in enumerate(outputs)
    ]
    return tree_unflatten(wrapped, spec)


def _keeps_metadata(
    func: Any, first: AsyncTensor, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> bool:
    """Whether ``func`` is pointwise on floating tensors of ``first``'s shape and dtype and
    Python numbers (an average's division): its output has ``first``'s metadata. Running such
    ops on meta tensors goes through torch's Python references, 0.2-0.4 ms each."""
    if kwargs or torch.Tag.pointwise not in func.tags or not first.dtype.is_floating_point:
        return False
    return all(
        isinstance(a, (int, float))
        or (isinstance(a, Tensor) and a.shape == first.shape and a.dtype == first.dtype)
        for a in args
    )


def _flat(args: tuple[Any, ...], kwargs: dict[str, Any]) -> Iterator[Any]:
    for arg in (*args, *kwargs.values()):
        if isinstance(arg, (list, tuple)):
            yield from arg
        else:
            yield arg


class _RunOnce:
    """A recorded operation: run once, on the resolved inputs, when one of its outputs is used."""

    __slots__ = ("_args", "_func", "_kwargs", "_outputs")

    def __init__(self, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        self._func = func
        self._args = args
        self._kwargs = kwargs
        self._outputs: list[Any] | None = None

    def output(self, index: int) -> Tensor:
        if self._outputs is None:
            args, kwargs = _map(_resolve, self._args), _map_values(_resolve, self._kwargs)
            out = self._func(*args, **kwargs)
            self._outputs = [out] if isinstance(out, Tensor) else tree_flatten(out)[0]
            self._args, self._kwargs = (), {}
        return cast(Tensor, self._outputs[index])


class _Waited(torch.autograd.Function):
    """:meth:`AsyncTensor.wait` in the graph: the plain tensor, its gradient passed through."""

    @staticmethod
    def forward(ctx: Any, x: AsyncTensor) -> Tensor:
        value = x._resolve()
        return value.view_as(value)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> Tensor:
        return grad
