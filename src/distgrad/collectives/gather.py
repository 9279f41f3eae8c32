"""gather and scatter: each one's backward is the other.

``dst`` and ``src`` are group ranks. Shapes: ``sizes[i]`` is rank i's extent along ``dim``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from distgrad._exchange import ops
from distgrad._exchange.async_op import offers_async_op
from distgrad._exchange.backend import metadata_device
from distgrad._exchange.group import Group
from distgrad._exchange.handshake import RankCall
from distgrad._mesh import GroupLike
from distgrad.collectives import _common as c
from distgrad.collectives._differentiable import Adjoint, Collective, Plan, apply
from distgrad.collectives._fields import Dim, Rank
from distgrad.collectives._list_fields import Sizes
from distgrad.collectives._signature import Bound, Signature, sizes_along
from distgrad.errors import CollectiveMismatchError

__all__ = ["apply_gather", "gather", "scatter"]

GATHER = Signature(
    "gather", fields=(Rank("dst"), Dim()), lists=(Sizes(rule="own"),), shapes="except_dim"
)
# Only the source and the receivers that pass a tensor like their part have a tensor; their
# shapes agree outside dim. The receivers' sizes are checked against the source's below.
SCATTER = Signature(
    "scatter",
    fields=(Rank("src"), Dim()),
    lists=(Sizes(rule="parts", same=False, root="src"),),
    shapes="except_dim",
    tensor_on="some",
    known_by="sizes= on every rank (and a tensor like its part on the receivers)",
    assumes_alike=False,
)


@dataclass(frozen=True)
class _Plan(Plan):
    sizes: tuple[int, ...]
    dim: int
    root: int
    trailing: tuple[int, ...]  # the shape of one rank's slice, dim moved to the front, minus dim
    dtype: torch.dtype
    device: torch.device


class _Gather(Collective):
    name = "gather"

    @staticmethod
    def run(x: Tensor, plan: _Plan) -> Tensor:
        exchange = ops.gather.in_flight if plan.async_op else ops.gather
        out = exchange(c.to_exchange(x, plan.dim), plan.sizes, plan.root, group=plan.group)
        return c.from_exchange(out, x.dtype, plan.dim)  # not the destination: 0 rows along dim

    @staticmethod
    def adjoint(plan: _Plan) -> Adjoint:
        # Other ranks' (empty) gradient is not read by the scatter, but passing it keeps their
        # result connected to it, so a double backward takes every rank through the gather.
        return _Scatter, plan


class _Scatter(Collective):
    name = "scatter"

    @staticmethod
    def run(x: Tensor | None, plan: _Plan) -> Tensor:
        moved = c.to_exchange(x, plan.dim) if x is not None else None
        trailing = c.byte_shape(plan.trailing, plan.dtype)
        dtype = torch.uint8 if trailing != plan.trailing else plan.dtype
        exchange = ops.scatter.in_flight if plan.async_op else ops.scatter
        out = exchange(moved, plan.sizes, plan.root, trailing, dtype, plan.device, group=plan.group)
        return c.from_exchange(out, plan.dtype, plan.dim)

    @staticmethod
    def adjoint(plan: _Plan) -> Adjoint:
        # A receiver's x is None or its anchor (which only describes its part): the gathered
        # gradient reaches the source's x alone.
        return _Gather, plan


def apply_gather(
    x: Tensor, group: Group, sizes: tuple[int, ...], dim: int, dst: int, async_op: bool = False
) -> Tensor:
    """gather without the checks, for ops built on it (their arguments are checked)."""
    if group.size == 1:
        return x.clone()
    plan = _plan(group, sizes, dim, dst, x.shape, x.dtype, x.device)
    return apply(_Gather, x, plan, async_op=async_op)


def _plan(
    group: Group,
    sizes: tuple[int, ...],
    dim: int,
    root: int,
    shape: Sequence[int],
    dtype: torch.dtype,
    device: torch.device,
) -> _Plan:
    """The plan of a gather or scatter whose slices (or parts) have ``shape`` outside ``dim``."""
    trailing = tuple(s for i, s in enumerate(shape) if i != dim)
    return _Plan(group, sizes, dim, root, trailing, dtype, device)


@offers_async_op
def gather(
    x: Tensor,
    dst: int,
    group: GroupLike = None,
    *,
    dim: int = 0,
    sizes: Sequence[int] | None = None,
    async_op: bool = False,
) -> Tensor:
    """Concatenate every rank's ``x`` along ``dim``, in rank order, on group rank ``dst`` only.

    Ranks may pass different sizes along ``dim``; all other dims, the dtype and the device type
    must match. ``sizes[i]`` is rank i's extent along ``dim``, the same list on every rank:
    pass it and the call sends nothing but the data; without it the ranks first exchange their
    sizes (one small all_gather and a host synchronisation), or inside ``torch.compile`` take
    them to be alike and check that on the device, as :func:`all_gather` does. ``dst`` is a
    rank within ``group``. Returns the concatenation on ``dst`` and, on every other rank, an
    empty tensor (size 0 along ``dim``). Every rank must still back-propagate through its
    result, since the backward is a collective. ``x`` is not modified.

    Gradient (the objective is the sum over ranks of each rank's loss):
    ``scatter(grad, src=dst, dim=dim, sizes=sizes)``: each rank's ``x`` gets its own slice of
    ``dst``'s incoming gradient.

    Communication: forward 1 gather of x (padded to the largest rank's size when sizes differ),
    plus the size exchange when ``sizes`` is not given; backward 1 scatter.

    ``async_op=True``: return at once an :class:`~distgrad.AsyncTensor`, which waits for the
    data on first use; the backward's exchange is started the same way (docs/semantics.md,
    "Overlap: async_op").

    Args:
        x: this rank's tensor; not modified.
        dst: the destination, a rank within ``group``.
        group: the process group (default: the default group), a DeviceMesh dimension
            (``mesh["tp"]``, ``(mesh, "tp")``, ``(mesh, 1)``); a DTensor input is refused.
        dim: the dimension to concatenate along.
        sizes: every rank's extent along ``dim``, the same list on every rank; given, the call
            sends nothing but the data.
        async_op: return at once an ``AsyncTensor`` that waits for its data on first use.

    Returns:
        On ``dst`` every rank's ``x`` concatenated along ``dim`` in rank order; on every other rank
        an empty tensor (size 0 along ``dim``).

    Raises:
        CollectiveArgumentError: an argument is invalid on some rank (``dst`` not a rank of the
            group, ``dim`` out of range, ``sizes`` of the wrong length or not this rank's extent);
            raised on every rank of the group, before any data moves, naming the rank, the argument
            and what was expected.
        CollectiveMismatchError: the ranks' arguments do not fit together (``dst``, other dims or
            dtypes that differ), found while the group's first calls are checked across ranks, in
            debug mode (``set_debug``) and, after them, by the data guard (``set_guard``).
        torch.distributed.DistBackendError: a peer's process died while this rank waited
            (``PeerGoneError``, a subclass, when distgrad's liveness check saw it first); the
            message names the op, the pass and the peer (docs/faults.md).
        RuntimeError: a peer never came within the group's timeout (the backend's timeout error,
            with distgrad's account of who waited where first).

    Example:
        >>> x = torch.tensor([1.0, 2.0], requires_grad=True)
        >>> y = dg.gather(x, dst=0, sizes=[2])  # one rank: it is dst, and gets its own rows
        >>> y
        tensor([1., 2.], grad_fn=<...>)
        >>> y.backward(torch.tensor([3.0, 4.0]))  # the gradient is scattered back
        >>> x.grad
        tensor([3., 4.])
    """
    call = GATHER.bind(group, x, dst=dst, dim=dim, sizes=sizes)
    if call.group.size == 1:
        return x.clone()
    return apply(_Gather, x, call.plan or call.keep(_gather_plan(call, x, dst)), async_op=async_op)


def _gather_plan(call: Bound, x: Tensor, dst: int) -> _Plan:
    dim = call["dim"]
    sizes = sizes_along(call, call["sizes"], c.extent(x, dim))
    return _plan(call.group, sizes, dim, dst, x.shape, x.dtype, x.device)


@offers_async_op
def scatter(
    x: Tensor | None,
    src: int,
    group: GroupLike = None,
    *,
    dim: int = 0,
    sizes: Sequence[int] | None = None,
    async_op: bool = False,
) -> Tensor:
    """Split group rank ``src``'s ``x`` along ``dim`` into one part per rank; rank i gets part i.

    On ``src``, ``x`` is the tensor to split and ``sizes[i]`` is rank i's part length (default:
    an even split, which requires ``x.shape[dim]`` to divide by the group size). Other ranks
    have two ways to call:

    * ``x=None`` and no ``sizes``: they learn the source's shape, dtype and sizes in one small
      exchange (all ranks then pass no ``sizes``, the source included);
    * ``sizes`` (the source's list) and ``x`` a tensor shaped like the part they receive, as
      torch.distributed.scatter's output tensor: its dtype, device and ``requires_grad`` match
      the source's. Every rank passes ``sizes`` and the call sends nothing but the data.

    ``src`` is a rank within ``group``. The result is on ``x``'s device (the group's default
    device when ``x`` is None: CPU for gloo, the current GPU for NCCL). ``x`` is not modified.

    Gradient (the objective is the sum over ranks of each rank's loss):
    ``gather(grad, dst=src, dim=dim)``: ``src``'s ``x`` gets every rank's incoming gradient,
    concatenated in rank order.

    Communication: forward 1 scatter, plus the exchange when ``sizes`` is not given; backward 1
    gather.

    ``async_op=True``: return at once an :class:`~distgrad.AsyncTensor`, which waits for the
    data on first use; the backward's exchange is started the same way (docs/semantics.md,
    "Overlap: async_op").

    Args:
        x: on ``src`` the tensor to split; on the other ranks ``None``, or a tensor shaped like the
            part it receives (with ``sizes``). Not modified.
        src: the source, a rank within ``group``.
        group: the process group (default: the default group), a DeviceMesh dimension
            (``mesh["tp"]``, ``(mesh, "tp")``, ``(mesh, 1)``); a DTensor input is refused.
        dim: the dimension to split along.
        sizes: every rank's part length along ``dim`` (default: an even split), passed by every
            rank or by none.
        async_op: return at once an ``AsyncTensor`` that waits for its data on first use.

    Returns:
        This rank's part of ``src``'s ``x``.

    Raises:
        CollectiveArgumentError: an argument is invalid on some rank (``src`` not a rank of the
            group, ``sizes`` that do not add up to ``x.shape[dim]``, ``x=None`` on ``src``); raised
            on every rank of the group, before any data moves, naming the rank, the argument and
            what was expected.
        CollectiveMismatchError: the ranks' arguments do not fit together (``src``, sizes given on
            some ranks only, parts shaped unlike the source's), found while the group's first calls
            are checked across ranks, in debug mode (``set_debug``) and, after them, by the data
            guard (``set_guard``).
        torch.distributed.DistBackendError: a peer's process died while this rank waited
            (``PeerGoneError``, a subclass, when distgrad's liveness check saw it first); the
            message names the op, the pass and the peer (docs/faults.md).
        RuntimeError: a peer never came within the group's timeout (the backend's timeout error,
            with distgrad's account of who waited where first).

    Example:
        >>> x = torch.tensor([1.0, 2.0, 3.0], requires_grad=True)
        >>> y = dg.scatter(x, src=0)  # one rank: the whole tensor is its part
        >>> y
        tensor([1., 2., 3.], grad_fn=<...>)
        >>> y.backward(torch.tensor([1.0, 0.0, 2.0]))  # the gradient is gathered back to src
        >>> x.grad
        tensor([1., 0., 2.])
    """
    call = SCATTER.bind(group, x, src=src, dim=dim, sizes=sizes)
    g, moved_dim, mine = call.group, call["dim"], call["sizes"]
    if g.size == 1:
        assert isinstance(x, Tensor)
        return x.clone()
    if call.calls is not None:
        return _scatter_as_the_source_says(x, g, src, dim, call.calls, call.desc, async_op)
    is_src = g.rank == src
    assert mine is not None and isinstance(x, Tensor)
    plan = call.plan or call.keep(_plan(g, mine, moved_dim, src, x.shape, x.dtype, x.device))
    if is_src:
        return apply(_Scatter, x, plan, async_op=async_op)
    # A receiver's x only describes its part, and requires grad when the source's does: as the
    # anchor it makes autograd record the op here (its own gradient stays None).
    return apply(_Scatter, None, plan, x if x.requires_grad else None, async_op)


def _scatter_as_the_source_says(
    x: Tensor | None,
    g: Group,
    src: int,
    dim: int,
    calls: list[RankCall],
    desc: str,
    async_op: bool,
) -> Tensor:
    """Scatter with the source's shape, dtype and sizes, learned in the exchange; every rank
    checks every receiver's sizes against the source's."""
    source = calls[src]
    assert source.dtype is not None and source.lists[0] is not None
    sizes = source.lists[0]
    for call in calls:
        if call.lists[0] is not None and call.lists[0] != sizes:
            raise CollectiveMismatchError(
                f"{desc} on rank {g.rank}: rank {call.rank} passes sizes {list(call.lists[0])}, "
                f"but the source (rank {src}) splits into {list(sizes)}"
            )
    dim = dim % len(source.shape)
    is_src = g.rank == src
    device = x.device if isinstance(x, Tensor) else metadata_device(g)
    plan = _plan(g, sizes, dim, src, source.shape, source.dtype, device)
    mine = x if is_src else None
    if not is_src and isinstance(x, Tensor) and x.requires_grad:
        # A receiver's x shaped like its part is its anchor, as in unchecked calls, so that
        # torch.autograd.grad can ask for it (and so run this rank's half of the backward).
        return apply(_Scatter, None, plan, x, async_op)
    required = source.requires_grad and source.grad_mode
    return apply(_Scatter, mine, plan, c.anchor(mine, required, device), async_op)
