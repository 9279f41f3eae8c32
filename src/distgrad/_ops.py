"""Raw communication that ``torch.compile`` can trace: ``_comm`` as ``torch.library`` custom ops.

The differentiable collectives call these functions in forward and backward. In eager mode each
one calls ``_comm`` directly: eager speed must not pay for compilation, and even a lean custom
op (``distgrad._library``) adds a trip through the dispatcher to every call. While ``torch.compile``
traces, each one emits a ``distgrad::`` custom op instead: an opaque node with a fake kernel
that gives its output's shape, so the whole step compiles to one graph with no break, and the
node runs the same ``_comm`` code when the graph runs. The autograd formulas stay where they
are (the ``autograd.Function`` of each collective, which the compiler traces through): one
definition of every adjoint for both modes.

Why custom ops rather than torch's functional collectives underneath: those take no uneven
sizes for all_gather and reduce_scatter, have no gather, scatter or point-to-point, and would
be a second implementation of every exchange beside the eager one; a custom op runs the very
code the eager tests check. The process group travels by its registered name (a custom op
takes no Python objects), as in torch's functional collectives.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

import torch
import torch.distributed.distributed_c10d as c10d
from torch import Tensor

from distgrad import _comm
from distgrad._async import deferring, resolved, started
from distgrad._group import Group, resolve
from distgrad._library import op

__all__ = [
    "all_gather",
    "group_named",
    "order_token",
    "traced",
    "all_reduce",
    "all_to_all",
    "broadcast",
    "gather",
    "permute",
    "reduce",
    "reduce_scatter",
    "scatter",
]


# One tensor per device that every distgrad custom op declares it mutates (it never does).
# Every rank must run every exchange, in the same order. The compiler removes an op whose output
# a rank does not use (a gather's empty result off the destination) and reorders independent
# ones by their buffer sizes, which differ between ranks: measured, a compiled gather hung its
# destination, and a step whose exchanges had rank-dependent sizes ran them in different orders
# on two ranks. Ops that write one tensor can be neither removed nor reordered (torch's ordered
# effects did not stop the reordering in torch 2.13's inductor; a shared mutated argument does).
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


def _meta(shape: Sequence[int], dtype: torch.dtype) -> Tensor:
    """The metadata of an output in flight (``async_op=True``): its shape, dtype, contiguous."""
    return torch.empty(tuple(shape), dtype=dtype, device="meta")


def traced(group: Group) -> bool:
    """Whether to emit a custom op: while compiling, for a real group (alone is plain torch)."""
    return group.pg is not None and torch.compiler.is_compiling()


def group_named(name: str) -> Group:
    """The group a custom op names (its registered name, as torch's functional collectives)."""
    # torch's own registry of groups by name, which its functional collectives use too.
    found = c10d._resolve_process_group(name)  # type: ignore[attr-defined,arg-type]
    return resolve(found)


def all_gather(x: Tensor, sizes: Sequence[int], group: Group) -> Tensor:
    if traced(group):
        out: Tensor = torch.ops.distgrad.all_gather(x, list(sizes), group.name, order_token(x))
        return out
    x = resolved(x)
    if deferring():
        like = _meta((sum(sizes), *x.shape[1:]), x.dtype)
        return started(_comm.all_gather.start(x, sizes, group), like, x.device)
    return _comm.all_gather(x, sizes, group)


@op("all_gather")
def _all_gather(x: Tensor, sizes: list[int], group: str, token: Tensor) -> Tensor:
    return _comm.all_gather(x, sizes, group_named(group))


@_all_gather.register_fake
def _(x: Tensor, sizes: list[int], group: str, token: Tensor) -> Tensor:
    return x.new_empty((sum(sizes), *x.shape[1:]))


def reduce_scatter(x: Tensor, sizes: Sequence[int], group: Group) -> Tensor:
    if traced(group):
        out: Tensor = torch.ops.distgrad.reduce_scatter(
            x, list(sizes), group.rank, group.name, order_token(x)
        )
        return out
    x = resolved(x)
    if deferring():
        like = _meta((sizes[group.rank], *x.shape[1:]), x.dtype)
        return started(_comm.reduce_scatter.start(x, sizes, group), like, x.device)
    return _comm.reduce_scatter(x, sizes, group)


@op("reduce_scatter")
def _reduce_scatter(x: Tensor, sizes: list[int], rank: int, group: str, token: Tensor) -> Tensor:
    return _comm.reduce_scatter(x, sizes, group_named(group))


@_reduce_scatter.register_fake
def _(x: Tensor, sizes: list[int], rank: int, group: str, token: Tensor) -> Tensor:
    return x.new_empty((sizes[rank], *x.shape[1:]))


def all_to_all(
    x: Tensor, input_sizes: Sequence[int], output_sizes: Sequence[int], group: Group
) -> Tensor:
    if traced(group):
        out: Tensor = torch.ops.distgrad.all_to_all(
            x, list(input_sizes), list(output_sizes), group.name, order_token(x)
        )
        return out
    x = resolved(x)
    if deferring():
        like = _meta((sum(output_sizes), *x.shape[1:]), x.dtype)
        pending = _comm.all_to_all.start(x, input_sizes, output_sizes, group)
        return started(pending, like, x.device)
    return _comm.all_to_all(x, input_sizes, output_sizes, group)


@op("all_to_all")
def _all_to_all(
    x: Tensor, input_sizes: list[int], output_sizes: list[int], group: str, token: Tensor
) -> Tensor:
    return _comm.all_to_all(x, input_sizes, output_sizes, group_named(group))


@_all_to_all.register_fake
def _(
    x: Tensor, input_sizes: list[int], output_sizes: list[int], group: str, token: Tensor
) -> Tensor:
    return x.new_empty((sum(output_sizes), *x.shape[1:]))


def all_reduce(x: Tensor, op: str, group: Group) -> Tensor:
    if traced(group):
        out: Tensor = torch.ops.distgrad.all_reduce(x, op, group.name, order_token(x))
        return out
    x = resolved(x)
    if deferring():
        like = _meta(x.shape, x.dtype)
        return started(_comm.all_reduce.start(x, op, group), like, x.device)
    return _comm.all_reduce(x, op, group)


@op("all_reduce")
def _all_reduce(x: Tensor, op: str, group: str, token: Tensor) -> Tensor:
    return _comm.all_reduce(x, op, group_named(group))


@_all_reduce.register_fake
def _(x: Tensor, op: str, group: str, token: Tensor) -> Tensor:
    return torch.empty_like(x, memory_format=torch.contiguous_format)


def broadcast(x: Tensor, src: int, group: Group) -> Tensor:
    if traced(group):
        out: Tensor = torch.ops.distgrad.broadcast(x, src, group.name, order_token(x))
        return out
    x = resolved(x)
    if deferring():
        like = _meta(x.shape, x.dtype)
        return started(_comm.broadcast.start(x, src, group), like, x.device)
    return _comm.broadcast(x, src, group)


@op("broadcast")
def _broadcast(x: Tensor, src: int, group: str, token: Tensor) -> Tensor:
    return _comm.broadcast(x, src, group_named(group))


@_broadcast.register_fake
def _(x: Tensor, src: int, group: str, token: Tensor) -> Tensor:
    return torch.empty_like(x, memory_format=torch.contiguous_format)


def reduce(x: Tensor, dst: int, group: Group) -> Tensor:
    """The sum over ranks on ``dst``; zeros (a constant) on every other rank."""
    if traced(group):
        out: Tensor = torch.ops.distgrad.reduce(x, dst, group.name, order_token(x))
        return out
    x = resolved(x)
    if deferring():
        pending = _comm.reduce.start(x, dst, group)
        finish = functools.partial(_or_zeros, like=x)
        return started(pending, _meta(x.shape, x.dtype), x.device, finish)
    return _reduce_or_zeros(x, dst, group)


def _reduce_or_zeros(x: Tensor, dst: int, group: Group) -> Tensor:
    return _or_zeros(_comm.reduce(x, dst, group), x)


def _or_zeros(out: Tensor | None, like: Tensor) -> Tensor:
    return out if out is not None else torch.zeros_like(like, memory_format=torch.contiguous_format)


@op("reduce")
def _reduce(x: Tensor, dst: int, group: str, token: Tensor) -> Tensor:
    return _reduce_or_zeros(x, dst, group_named(group))


@_reduce.register_fake
def _(x: Tensor, dst: int, group: str, token: Tensor) -> Tensor:
    return torch.empty_like(x, memory_format=torch.contiguous_format)


def gather(x: Tensor, sizes: Sequence[int], dst: int, group: Group) -> Tensor:
    """Every rank's ``x`` concatenated on ``dst``; an empty slice (0 rows) on every other rank."""
    if traced(group):
        out: Tensor = torch.ops.distgrad.gather(
            x, list(sizes), dst, group.rank, group.name, order_token(x)
        )
        return out
    x = resolved(x)
    if deferring():
        rows = sum(sizes) if group.rank == dst else 0
        pending = _comm.gather.start(x, sizes, dst, group)
        finish = functools.partial(_or_empty, like=x)
        return started(pending, _meta((rows, *x.shape[1:]), x.dtype), x.device, finish)
    return _gather_or_empty(x, sizes, dst, group)


def _gather_or_empty(x: Tensor, sizes: Sequence[int], dst: int, group: Group) -> Tensor:
    return _or_empty(_comm.gather(x, sizes, dst, group), x)


def _or_empty(out: Tensor | None, like: Tensor) -> Tensor:
    return out if out is not None else like.new_empty((0, *like.shape[1:]))


@op("gather")
def _gather(x: Tensor, sizes: list[int], dst: int, rank: int, group: str, token: Tensor) -> Tensor:
    return _gather_or_empty(x, sizes, dst, group_named(group))


@_gather.register_fake
def _(x: Tensor, sizes: list[int], dst: int, rank: int, group: str, token: Tensor) -> Tensor:
    return x.new_empty((sum(sizes) if rank == dst else 0, *x.shape[1:]))


def scatter(
    x: Tensor | None,
    sizes: Sequence[int],
    src: int,
    trailing: Sequence[int],
    dtype: torch.dtype,
    device: torch.device,
    group: Group,
) -> Tensor:
    if traced(group):
        token = order_token(device)
        out: Tensor = torch.ops.distgrad.scatter(
            x, list(sizes), src, list(trailing), dtype, device, group.rank, group.name, token
        )
        return out
    x = None if x is None else resolved(x)
    if deferring():
        like = _meta((sizes[group.rank], *trailing), dtype)
        pending = _comm.scatter.start(x, sizes, src, trailing, dtype, device, group)
        return started(pending, like, device)
    return _comm.scatter(x, sizes, src, trailing, dtype, device, group)


@op("scatter")
def _scatter(
    x: Tensor | None,
    sizes: list[int],
    src: int,
    trailing: list[int],
    dtype: torch.dtype,
    device: torch.device,
    rank: int,
    group: str,
    token: Tensor,
) -> Tensor:
    # A slice of the receive buffer would share its storage, which a custom op's output may
    # not do with anything the caller can see; it is the buffer's only view, so this is cheap.
    return _comm.scatter(x, sizes, src, trailing, dtype, device, group_named(group)).clone()


@_scatter.register_fake
def _(
    x: Tensor | None,
    sizes: list[int],
    src: int,
    trailing: list[int],
    dtype: torch.dtype,
    device: torch.device,
    rank: int,
    group: str,
    token: Tensor,
) -> Tensor:
    return torch.empty((sizes[rank], *trailing), dtype=dtype, device=device)


def permute(x: Tensor, perm: Sequence[int], recv_shape: Sequence[int], group: Group) -> Tensor:
    if traced(group):
        out: Tensor = torch.ops.distgrad.permute(
            x, list(perm), list(recv_shape), group.name, order_token(x)
        )
        return out
    x = resolved(x)
    if deferring():
        like = _meta(recv_shape, x.dtype)
        return started(_comm.permute.start(x, perm, recv_shape, group), like, x.device)
    return _comm.permute(x, perm, recv_shape, group)


@op("permute")
def _permute(
    x: Tensor, perm: list[int], recv_shape: list[int], group: str, token: Tensor
) -> Tensor:
    return _comm.permute(x, perm, recv_shape, group_named(group))


@_permute.register_fake
def _(x: Tensor, perm: list[int], recv_shape: list[int], group: str, token: Tensor) -> Tensor:
    return x.new_empty(recv_shape)
