"""One declaration per exchange, and the four forms made from it.

Each exchange (``distgrad._exchange.ops``, one file each) is declared once as an
:class:`Exchange`: its steps (a generator, ``distgrad._exchange.inflight``), the schema of its
arguments, its output's metadata as one function of its arguments, and what becomes of a rank's
empty result. From that declaration come the four forms an exchange takes:

* the eager call: the steps driven through at once;
* the ``async_op=True`` branch: an in-flight result whose shape is the declared one;
* the ``distgrad::<name>`` custom op, which ``torch.compile`` records as one opaque node;
* its fake kernel: the declared shape again.

So a shape is written once, and the async result and the compiled graph cannot disagree about it
(``tests/collectives/test_exchanges.py`` checks the declaration against the eager result).

Eager mode calls the steps directly: eager speed must not pay for compilation, and even a lean
custom op (``distgrad._library``) adds a trip through the dispatcher to every call. While
``torch.compile`` traces, each call emits the custom op instead, so the whole step compiles to
one graph with no break, and the node runs the same steps when the graph runs. The autograd
formulas stay where they are (the ``autograd.Function`` of each collective, which the compiler
traces through): one definition of every adjoint for both modes.

Why custom ops rather than torch's functional collectives underneath: those take no uneven
sizes for all_gather and reduce_scatter, have no gather, scatter or point-to-point, and would
be a second implementation of every exchange beside the eager one; a custom op runs the very
code the eager tests check. The process group travels by its registered name (a custom op
takes no Python objects), as in torch's functional collectives.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from distgrad._exchange.async_op import deferring, resolved, started
from distgrad._exchange.group import Group, resolve_named
from distgrad._exchange.inflight import ExchangeOp, Steps
from distgrad._library import define

__all__ = [
    "Exchange",
    "Meta",
    "exchange",
    "like",
    "no_rows",
    "order_token",
    "rows",
    "traced",
    "zeros",
]


# One tensor per device that every distgrad custom op declares it mutates (it never does).
# Every rank must run every exchange, in the same order. The compiler removes an op whose output
# a rank does not use (a gather's empty result off the destination) and reorders independent
# ones by their buffer sizes, which differ between ranks: measured, a compiled gather hung its
# destination, and a step whose exchanges had rank-dependent sizes ran them in different orders
# on two ranks. Ops that write one tensor can be neither removed nor reordered (torch's ordered
# effects did not stop the reordering in torch 2.13's inductor; a shared mutated argument does).
# torch's own functional collectives (torch.ops._c10d_functional) take no such argument: put in
# the same graph as these ops, inductor moved them (a compiled step with a permute after an
# all_reduce hung, each rank in a different exchange), so every exchange here is a custom op.
_tokens: dict[torch.device, Tensor] = {}


def order_token(like: Tensor | torch.device) -> Tensor:
    """The tensor every distgrad custom op on ``like``'s device declares it mutates."""
    device = like if isinstance(like, torch.device) else like.device
    token: Tensor = _token_on(str(device))
    return token


# Run eagerly even while tracing, its tensor taken as a constant of the graph: a token the graph
# itself created and stored away would leave the graph as an output, which AOTAutograd's
# partitioner refuses ("Node ... was invalid, but is output") for a graph that also trains.
@torch._dynamo.assume_constant_result  # type: ignore[untyped-decorator]
def _token_on(device: str) -> Tensor:
    found = _tokens.get(torch.device(device))
    if found is None:
        found = _tokens[torch.device(device)] = torch.zeros(1, device=device)
    return found


_is_compiling = torch.compiler.is_compiling


def traced(group: Group) -> bool:
    """Whether to emit a custom op: while compiling, for a real group (alone is plain torch)."""
    return group.pg is not None and torch.compiler.is_compiling()


# What an exchange's output is, from its arguments: (shape, dtype, device).
Meta = tuple[Sequence[int], torch.dtype, torch.device]


@dataclass(frozen=True)
class Exchange:
    """One exchange, declared once; calling it runs it (eagerly, in flight, or traced).

    * ``name``: the custom op's name (``distgrad::<name>``);
    * ``run``: its steps as a blocking call, ``run(x, *args, group)``, with ``run.start`` for
      ``async_op=True`` and ``run.steps`` for an exchange built on it; it never emits a
      custom op (the callers that must stay raw, inside a backward, call it);
    * ``schema``: its arguments after ``x``, in ``torch.library`` schema words (``int[] sizes,
      int dst``); every custom op also takes this rank's group rank, the group's registered
      name and the order token;
    * ``meta(x, *args, rank)``: the output's shape, dtype and device;
    * ``empty``: what a rank whose steps return ``None`` (off a reduce's or gather's
      destination) gets instead, from the input: zeros or an empty slice;
    * ``takes_none``: ``x`` may be ``None`` (scatter's receivers).
    """

    name: str
    run: ExchangeOp[..., Any]
    schema: str
    meta: Callable[..., Meta]
    empty: Callable[[Tensor], Tensor] | None = None
    takes_none: bool = False

    def __post_init__(self) -> None:
        x = "Tensor? x" if self.takes_none else "Tensor x"
        define(
            self.name,
            f"({x}, {self.schema}, int rank, str group, Tensor(a!) token) -> Tensor",
            self._kernel,
            self._fake,
        )

    def __call__(self, x: Tensor | None, *passed: Any) -> Tensor:
        group = passed[-1]  # after the op's arguments
        if group.pg is not None and _is_compiling():  # traced(group), inline: every call
            args = passed[:-1]
            token = order_token(x if x is not None else args[-1])  # scatter: its device
            custom = getattr(torch.ops.distgrad, self.name)
            out: Tensor = custom(x, *map(_listed, args), group.rank, group.name, token)
            return out
        if x is not None and type(x) is not Tensor:
            x = resolved(x)
        if deferring():
            shape, dtype, device = self.meta(x, *passed[:-1], group.rank)
            like = torch.empty(tuple(shape), dtype=dtype, device="meta")
            pending = self.run.start(x, *passed)
            return started(pending, like, device, self._finisher(x))
        out = self.run(x, *passed)
        return out if out is not None else self._result(out, x)

    def _result(self, out: Tensor | None, x: Tensor | None) -> Tensor:
        if out is None:
            assert self.empty is not None and x is not None, self.name
            return self.empty(x)
        return out

    def _finisher(self, x: Tensor | None) -> Callable[[Any], Tensor] | None:
        if self.empty is None:
            return None
        return lambda out: self._result(out, x)

    def _kernel(self, x: Tensor | None, *passed: Any) -> Tensor:
        *args, _rank, group, _token = passed
        out = self._result(self.run(x, *args, resolve_named(group)), x)
        # A custom op's output may share memory with nothing the caller can see: a view of a
        # receive buffer (scatter's slice) is copied; it is the buffer's only view, so cheaply.
        return out if out._base is None else out.clone()

    def _fake(self, x: Tensor | None, *passed: Any) -> Tensor:
        *args, rank, _group, _token = passed
        shape, dtype, device = self.meta(x, *args, rank)
        return torch.empty(tuple(shape), dtype=dtype, device=device)


def exchange(
    schema: str,
    meta: Callable[..., Meta],
    *,
    staged: bool = True,
    empty: Callable[[Tensor], Tensor] | None = None,
    takes_none: bool = False,
) -> Callable[[Callable[..., Steps[Any]]], Exchange]:
    """Declare the exchange whose steps the decorated generator is (named after it); see
    :class:`Exchange` for the arguments. ``staged``: the steps are ``steps(x, ..., group)``,
    and a CUDA ``x`` on gloo goes through host memory (``distgrad._exchange.inflight``)."""

    def declare(steps: Callable[..., Steps[Any]]) -> Exchange:
        run: ExchangeOp[..., Any] = ExchangeOp(steps, staged=staged)
        return Exchange(steps.__name__, run, schema, meta, empty, takes_none)

    return declare


def _listed(arg: Any) -> Any:
    """A custom op takes lists where the eager call takes any sequence of ints."""
    return list(arg) if isinstance(arg, tuple) else arg


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
