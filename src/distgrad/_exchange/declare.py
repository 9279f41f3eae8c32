"""One declaration per exchange, and its call forms.

Each exchange (``distgrad._exchange.ops``, one file each) is declared once, by
``@exchange(meta, traced=...)`` on its steps (a generator, ``distgrad._exchange.inflight``): its
traced form (torch's functional collectives, ``distgrad._exchange.functional``), its output's
metadata as one function of its arguments, and what becomes of a rank's empty result.

**Types.** An :class:`Exchange` is generic over its steps' parameters (a ``ParamSpec``) and
result: every call form takes exactly the steps' arguments, the group last and by keyword
(``group=``), so strict mypy checks each call site against the steps. ``meta`` and ``traced``
are typed with the same parameters, so the type checker holds the three argument lists to one
(names, kinds and types).

**Call forms**, one object's methods; the caller picks one (nothing is read from a thread-local
here: the collectives carry ``async_op`` in their plan):

* ``ex(x, ..., group=g)``: the op path, blocking: the eager steps driven through at once, or
  while ``torch.compile`` traces, the traced form: nodes of ``torch.ops._c10d_functional``
  (the collective, then its ``wait_tensor``), one family with torch's own collectives, which
  the compiler orders, buckets and overlaps with compute (docs/semantics.md, "Inside
  ``torch.compile``");
* ``ex.in_flight(...)``: ``async_op=True``: an ``AsyncTensor`` of the declared shape whose data
  waits on first use (traced: as the blocking call);
* ``ex.start(...)``: started, waited for by the caller (:class:`InFlight`), to overlap a ring's
  step with compute (traced: the traced form, whose wait is a node the compiler places);
* ``ex.eager(...)``: blocking and never traced: what must stay raw (debug mode's checks);
* ``ex.steps(...)``: the steps themselves, for an exchange built on another (``yield from``).

Eager mode calls the steps directly: eager speed must not pay for compilation, and the steps
carry what a traced graph cannot (the dead-peer watch's ticks, the data guard, staging). The
autograd formulas stay where they are (the ``autograd.Function`` of each collective, which the
compiler traces through): one definition of every adjoint for both modes, so a backward's
exchanges are functional collectives in a compiled graph too.
``tests/exchange/test_exchanges.py`` checks the declared shape, the traced form (run
eagerly: torch's functional collectives run outside a graph too) and the started form against
the eager steps.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, Generic, ParamSpec, TypeVar

import torch
from torch import Tensor

from distgrad._exchange.async_op import resolved, started
from distgrad._exchange.backend import on_host
from distgrad._exchange.group import Group
from distgrad._exchange.inflight import Done, InFlight, Pending, Steps, drive, through_host

__all__ = ["Exchange", "Meta", "exchange", "like", "no_rows", "rows", "zeros"]


_is_compiling = torch.compiler.is_compiling

# What an exchange's output is, from its arguments: (shape, dtype, device).
Meta = tuple[Sequence[int], torch.dtype, torch.device]

P = ParamSpec("P")
R = TypeVar("R", Tensor, Tensor | None)  # what the steps return (None off a root)


class Exchange(Generic[P, R]):
    """One exchange, declared once (see the module's docstring for its call forms).

    * ``name``: the exchange's name (its steps' function name);
    * ``steps``: its steps, ``steps(x, ..., group=g)``, a generator;
    * ``traced``: the same exchange written with torch's functional collectives;
    * ``meta(x, ..., group=g)``: the output's shape, dtype and device;
    * ``empty``: what a rank whose steps return ``None`` (off a reduce's or gather's
      destination) gets instead, from the input: zeros or an empty slice;
    * ``staged``: a CUDA ``x`` on gloo goes through host memory (``distgrad._exchange.inflight``).
    """

    __slots__ = ("_steps", "empty", "meta", "name", "staged", "steps", "traced")

    def __init__(
        self,
        steps: Callable[P, Steps[R]],
        traced: Callable[P, R],
        meta: Callable[P, Meta],
        *,
        staged: bool,
        empty: Callable[[Tensor], Tensor] | None,
    ) -> None:
        self.name = steps.__name__
        self.steps: Callable[P, Steps[R]] = steps
        self.traced: Callable[P, R] = traced
        self.meta: Callable[P, Meta] = meta
        self.staged = staged
        self.empty = empty
        self._steps: Callable[..., Steps[R]] = steps  # called with a rebuilt argument tuple

    def __call__(self, *args: P.args, **kwargs: P.kwargs) -> Tensor:
        """The exchange, blocking: eagerly its steps, while ``torch.compile`` traces its traced
        form."""
        a: tuple[Any, ...] = args
        k: dict[str, Any] = kwargs
        group: Group = k["group"]
        if group.pg is not None and (_is_compiling() or group.rank_is_data):
            return self._result(self._trace(a, k), a[0])
        x = a[0]
        if x is not None and type(x) is not Tensor:  # (_resolved, inline: every call)
            x = resolved(x)
            a = (x, *a[1:])
        if self.staged and not x.is_cpu and on_host(group, x.device):
            steps = self._steps_of(x, a, k)
        else:
            steps = self._steps(*a, **k)
        try:  # drive(steps), inline: one Python call less on every exchange
            waiting = next(steps)
            while True:
                waiting.wait()
                waiting = steps.send(None)
        except StopIteration as finished:
            out: Tensor | None = finished.value
        return out if out is not None else self._result(out, x)

    def in_flight(self, *args: P.args, **kwargs: P.kwargs) -> Tensor:
        """``async_op=True``: the exchange started, its result an ``AsyncTensor`` of the
        declared shape that waits for its data on first use (traced: as the blocking call)."""
        a: tuple[Any, ...] = args
        k: dict[str, Any] = kwargs
        group: Group = k["group"]
        if group.pg is not None and (_is_compiling() or group.rank_is_data):
            return self._result(self._trace(a, k), a[0])
        x, a = self._resolved(a)
        meta: Callable[..., Meta] = self.meta
        shape, dtype, device = meta(*a, **k)
        like = torch.empty(tuple(shape), dtype=dtype, device="meta")
        pending = Pending(self._steps_of(x, a, k))
        return started(pending, like, device, self._finisher(x))

    def start(self, *args: P.args, **kwargs: P.kwargs) -> InFlight[R]:
        """The exchange started; its ``wait()`` gives the steps' result. To overlap it with
        compute (a ring's step); traced: the traced form, whose wait the compiler places."""
        k: dict[str, Any] = kwargs
        group: Group = k["group"]
        if group.pg is not None and (_is_compiling() or group.rank_is_data):
            return Done(self._trace(args, k))
        x, a = self._resolved(args)
        return Pending(self._steps_of(x, a, k), later=False)

    def eager(self, *args: P.args, **kwargs: P.kwargs) -> R:
        """The steps driven through, never traced: what must stay raw (debug mode's checks)."""
        x, a = self._resolved(args)
        return drive(self._steps_of(x, a, kwargs))

    def _resolved(self, args: tuple[Any, ...]) -> tuple[Any, tuple[Any, ...]]:
        """``x`` and the arguments, an ``AsyncTensor`` ``x`` waited for."""
        x = args[0]
        if x is not None and type(x) is not Tensor:
            x = resolved(x)
            return x, (x, *args[1:])
        return x, args

    def _steps_of(self, x: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Steps[R]:
        if self.staged and not x.is_cpu and on_host(kwargs["group"], x.device):
            return through_host(self._steps(x.cpu(), *args[1:], **kwargs), x.device)
        return self._steps(*args, **kwargs)

    def _trace(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> R:
        group: Group = kwargs["group"]
        x = args[0]
        traced: Callable[..., R] = self.traced
        meta: Callable[..., Meta] = self.meta
        device = x.device if x is not None else meta(*args, **kwargs)[2]  # scatter's receivers
        if group.is_nccl or device.type == "cpu":
            return traced(*args, **kwargs)
        # gloo moves host memory: a CUDA tensor goes through the host, as the eager steps
        # stage it (distgrad._exchange.inflight).
        host = x.cpu() if x is not None else None
        cpu = torch.device("cpu")
        rest = [cpu if isinstance(a, torch.device) else a for a in args[1:]]
        out = traced(host, *rest, **kwargs)
        return out if out is None else out.to(device)

    def _result(self, out: Tensor | None, x: Tensor | None) -> Tensor:
        if out is None:
            assert self.empty is not None and x is not None, self.name
            return self.empty(x)
        return out

    def _finisher(self, x: Tensor | None) -> Callable[[Any], Tensor] | None:
        if self.empty is None:
            return None
        return lambda out: self._result(out, x)


def exchange(
    meta: Callable[P, Meta],
    *,
    traced: Callable[P, R],
    staged: bool = True,
    empty: Callable[[Tensor], Tensor] | None = None,
) -> Callable[[Callable[P, Steps[R]]], Exchange[P, R]]:
    """Declare the exchange whose steps the decorated generator is (named after it); see
    :class:`Exchange` for the arguments. ``meta``, ``traced`` and the steps take the same
    parameters (the type checker holds them to one), ``group`` last, by keyword."""

    def declare(steps: Callable[P, Steps[R]]) -> Exchange[P, R]:
        return Exchange(steps, traced, meta, staged=staged, empty=empty)

    return declare


def like(x: Tensor, shape: Sequence[int]) -> Meta:
    """An output of ``shape`` with ``x``'s dtype and device."""
    return shape, x.dtype, x.device


def rows(x: Tensor, count: int) -> Meta:
    """An output of ``count`` rows of ``x``'s row shape, dtype and device."""
    return like(x, (count, *x.shape[1:]))


def zeros(x: Tensor) -> Tensor:
    """Zeros like ``x``: a reduce's result off its destination (a constant)."""
    return torch.zeros_like(x, memory_format=torch.contiguous_format)


def no_rows(x: Tensor) -> Tensor:
    """An empty slice of ``x``'s rows: a gather's result off its destination."""
    return x.new_empty((0, *x.shape[1:]))
