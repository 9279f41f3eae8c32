"""One declaration per exchange, and the three forms made from it.

Each exchange (``distgrad._exchange.ops``, one file each) is declared once as an
:class:`Exchange`: its steps (a generator, ``distgrad._exchange.inflight``), its traced form
(torch's functional collectives, ``distgrad._exchange.functional``), its output's metadata as
one function of its arguments, and what becomes of a rank's empty result. The three forms:

* the eager call: the steps driven through at once;
* the ``async_op=True`` branch: an in-flight result whose shape is the declared one;
* while ``torch.compile`` traces: the traced form, nodes of ``torch.ops._c10d_functional``
  (the collective, then its ``wait_tensor``), one family with torch's own collectives, which
  the compiler orders, buckets and overlaps with compute (docs/semantics.md, "Inside
  ``torch.compile``").

Eager mode calls the steps directly: eager speed must not pay for compilation, and the steps
carry what a traced graph cannot (the dead-peer watch's ticks, the data guard, staging). The
autograd formulas stay where they are (the ``autograd.Function`` of each collective, which the
compiler traces through): one definition of every adjoint for both modes, so a backward's
exchanges are functional collectives in a compiled graph too.
``tests/collectives/test_exchanges.py`` checks the declared shape and the traced form (run
eagerly: torch's functional collectives run outside a graph too) against the eager steps.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from distgrad._exchange.async_op import deferring, resolved, started
from distgrad._exchange.backend import on_host
from distgrad._exchange.group import Group
from distgrad._exchange.inflight import Done, ExchangeOp, InFlight, Pending, Steps

__all__ = [
    "Exchange",
    "Meta",
    "exchange",
    "like",
    "no_rows",
    "rows",
    "traced",
    "zeros",
]


_is_compiling = torch.compiler.is_compiling


def traced(group: Group) -> bool:
    """Whether to emit the traced form: while compiling, for a real group (alone is plain
    torch, traced as it is)."""
    return group.pg is not None and torch.compiler.is_compiling()


# What an exchange's output is, from its arguments: (shape, dtype, device).
Meta = tuple[Sequence[int], torch.dtype, torch.device]


@dataclass(frozen=True)
class Exchange:
    """One exchange, declared once; calling it runs it (eagerly, in flight, or traced).

    * ``name``: the exchange's name (its steps' function name);
    * ``run``: its steps as a blocking call, ``run(x, *args, group)``, with ``run.start`` for
      ``async_op=True`` and ``run.steps`` for an exchange built on it; never traced (the
      callers that must stay raw, such as debug mode's checks, call it);
    * ``traced``: the same exchange written with torch's functional collectives,
      ``traced(x, *args, group)``, what a call emits while ``torch.compile`` traces;
    * ``meta(x, *args, rank)``: the output's shape, dtype and device;
    * ``empty``: what a rank whose steps return ``None`` (off a reduce's or gather's
      destination) gets instead, from the input: zeros or an empty slice;
    * ``takes_none``: ``x`` may be ``None`` (scatter's receivers).
    """

    name: str
    run: ExchangeOp[..., Any]
    traced: Callable[..., Tensor | None]
    meta: Callable[..., Meta]
    empty: Callable[[Tensor], Tensor] | None = None
    takes_none: bool = False

    def __call__(self, x: Tensor | None, *passed: Any) -> Tensor:
        group = passed[-1]  # after the op's arguments
        if group.pg is not None and _is_compiling():  # traced(group), inline: every call
            return self._trace(x, passed)
        if x is not None and type(x) is not Tensor:
            x = resolved(x)
        if deferring():
            shape, dtype, device = self.meta(x, *passed[:-1], group.rank)
            like = torch.empty(tuple(shape), dtype=dtype, device="meta")
            pending = self.run.start(x, *passed)
            return started(pending, like, device, self._finisher(x))
        out = self.run(x, *passed)
        return out if out is not None else self._result(out, x)

    def start(self, x: Tensor, *passed: Any) -> InFlight[Any]:
        """Start the exchange and return what :meth:`~InFlight.wait` s for its result, to
        overlap it with compute (a ring's step): eagerly its steps in flight, and while
        ``torch.compile`` traces the traced form (its wait a node that the compiler moves)."""
        group: Group = passed[-1]
        if group.pg is not None and _is_compiling():
            return Done(self._trace(x, passed))
        run = self.run
        if run.staged and not x.is_cpu and on_host(group, x.device):
            return Pending(run._through_host(x, *passed), later=False)
        return Pending(run.steps(x, *passed), later=False)

    def _trace(self, x: Tensor | None, passed: tuple[Any, ...]) -> Tensor:
        group: Group = passed[-1]
        device = x.device if x is not None else passed[-2]  # scatter's receivers: its device
        if group.is_nccl or device.type == "cpu":
            return self._result(self.traced(x, *passed), x)
        # gloo moves host memory: a CUDA tensor goes through the host, as the eager steps
        # stage it (distgrad._exchange.inflight).
        host = x.cpu() if x is not None else None
        args = [torch.device("cpu") if isinstance(a, torch.device) else a for a in passed]
        return self._result(self.traced(host, *args), host).to(device)

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
    meta: Callable[..., Meta],
    *,
    traced: Callable[..., Tensor | None],
    staged: bool = True,
    empty: Callable[[Tensor], Tensor] | None = None,
    takes_none: bool = False,
) -> Callable[[Callable[..., Steps[Any]]], Exchange]:
    """Declare the exchange whose steps the decorated generator is (named after it); see
    :class:`Exchange` for the arguments. ``staged``: the steps are ``steps(x, ..., group)``,
    and a CUDA ``x`` on gloo goes through host memory (``distgrad._exchange.inflight``)."""

    def declare(steps: Callable[..., Steps[Any]]) -> Exchange:
        run: ExchangeOp[..., Any] = ExchangeOp(steps, staged=staged)
        return Exchange(steps.__name__, run, traced, meta, empty, takes_none)

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
