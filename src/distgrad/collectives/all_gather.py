"""all_gather and reduce_scatter: under the sum objective, each one's backward is the other.

Shapes: ``sizes[i]`` is rank i's extent along ``dim``; the gathered tensor stacks the ranks'
slices in rank order, so rank i's slice starts at ``sum(sizes[:i])``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from torch import Tensor

from distgrad._exchange import ops
from distgrad._exchange.async_op import offers_async_op
from distgrad._exchange.group import Group, first_row, own_rows
from distgrad._mesh import GroupLike
from distgrad.collectives import _common as c
from distgrad.collectives._differentiable import Adjoint, Collective, Plan, apply
from distgrad.collectives._fields import Choice, Dim, Reduction
from distgrad.collectives._list_fields import Sizes
from distgrad.collectives._reduce_slices import reduce_stacked
from distgrad.collectives._signature import Bound, Signature, sizes_along
from distgrad.collectives.all_to_all import apply_all_to_all

__all__ = ["all_gather", "apply_all_gather", "apply_reduce_scatter", "reduce_scatter"]

ALL_GATHER = Signature(
    "all_gather",
    fields=(Dim(), Choice("objective", c.OBJECTIVES)),
    lists=(Sizes(rule="own"),),
    shapes="except_dim",
)
REDUCE_SCATTER = Signature(
    "reduce_scatter", fields=(Reduction(), Dim()), lists=(Sizes(rule="split"),), shapes="equal"
)


@dataclass(frozen=True)
class _Plan(Plan):
    sizes: tuple[int, ...]
    dim: int


class _AllGather(Collective):
    name = "all_gather"

    @staticmethod
    def run(x: Tensor, plan: _Plan) -> Tensor:
        exchange = ops.all_gather.in_flight if plan.async_op else ops.all_gather
        gathered = exchange(c.to_exchange(x, plan.dim), plan.sizes, group=plan.group)
        return c.from_exchange(gathered, x.dtype, plan.dim)

    @staticmethod
    def adjoint(plan: _Plan) -> Adjoint:
        return _ReduceScatterSum, plan

    @staticmethod
    def replicated(grad: Tensor, plan: _Plan) -> Tensor:
        # Every rank holds the same gradient of one shared loss: keep this rank's slice.
        rank = plan.group.rank
        return grad.narrow(plan.dim, first_row(plan.sizes, rank), own_rows(plan.sizes, rank))


class _ReduceScatterSum(Collective):
    name = "reduce_scatter"

    @staticmethod
    def run(x: Tensor, plan: _Plan) -> Tensor:
        exchange = ops.reduce_scatter.in_flight if plan.async_op else ops.reduce_scatter
        summed = exchange(c.to_front(x, plan.dim), plan.sizes, group=plan.group)
        return c.output(c.from_front(summed, plan.dim))

    @staticmethod
    def adjoint(plan: _Plan) -> Adjoint:
        return _AllGather, plan


def apply_all_gather(
    x: Tensor,
    group: Group,
    sizes: tuple[int, ...],
    dim: int,
    objective: c.Objective = "sum",
    async_op: bool = False,
) -> Tensor:
    """all_gather without the checks, for ops built on it (their arguments are checked)."""
    if group.size == 1:
        return x.clone()
    return apply(_AllGather, x, _Plan(group, sizes, dim, objective=objective), async_op=async_op)


def apply_reduce_scatter(
    x: Tensor, group: Group, sizes: tuple[int, ...], dim: int, op: str, async_op: bool = False
) -> Tensor:
    """reduce_scatter without the checks, for ops built on it (their arguments are checked)."""
    if op == "avg":
        return apply_reduce_scatter(x, group, sizes, dim, "sum", async_op) / group.size
    if group.size == 1:
        return x.clone()
    if op == "sum":
        return apply(_ReduceScatterSum, x, _Plan(group, sizes, dim), async_op=async_op)
    # prod, max, min: every rank receives the N slices of its part and reduces them locally, so
    # the gradient is the local reduction's (ties split evenly, zeros exact) and all_to_all
    # (self-adjoint) routes it back to the owners.
    mine = own_rows(sizes, group.rank)
    moved = c.to_front(x, dim)
    slices = apply_all_to_all(moved, group, sizes, (mine,) * group.size, 0, async_op)
    stacked = slices.view(group.size, mine, *moved.shape[1:])
    return c.from_front(reduce_stacked(stacked, op), dim)


@offers_async_op
def all_gather(
    x: Tensor,
    group: GroupLike = None,
    *,
    dim: int = 0,
    sizes: Sequence[int] | None = None,
    objective: c.Objective = "sum",
    async_op: bool = False,
) -> Tensor:
    """Concatenate every rank's ``x`` along ``dim``, in rank order, on every rank.

    Ranks may pass different sizes along ``dim`` (a different batch per rank); all other dims,
    the dtype and the device type must match. ``sizes[i]`` is rank i's extent along ``dim``,
    the same list on every rank: pass it when you know it (``[n] * world_size`` for even
    shards) and the call sends nothing but the data; without it, the ranks first exchange
    their sizes (one small all_gather and a host synchronisation). Inside ``torch.compile``,
    where shapes cannot depend on data, a call without ``sizes`` takes every rank's extent to
    be this rank's and checks that on the device (one all_gather of 1 int64, no host
    synchronisation; the assertion fails when they differ). ``x`` is not modified.

    Gradient (``objective="sum"``: the objective is the sum over ranks of each rank's loss):
    ``reduce_scatter(grad, op="sum", dim=dim)``; each rank receives the sum, over all ranks, of
    the gradient for its own slice. With ``objective="replicated"`` (every rank computes the
    same loss from the gathered tensor and it counts once) each rank keeps its own slice of its
    incoming gradient, with no communication.

    Communication: forward 1 all_gather of x (padded to the largest rank's size when sizes
    differ, on NCCL), plus the size exchange when ``sizes`` is not given; backward 1 all_to_all
    moving (N-1)/N of the gradient, then a local sum (NCCL with equal sizes: its
    reduce-scatter; nothing with ``objective="replicated"``). Which exchange runs on gloo at
    each size: docs/semantics.md, "How the data moves on gloo".

    ``async_op=True``: return at once an :class:`~distgrad.AsyncTensor`, which waits for the
    data on first use; the backward's exchange is started the same way (docs/semantics.md,
    "Overlap: async_op").

    Args:
        x: this rank's tensor; not modified.
        group: the process group (default: the default group), a DeviceMesh dimension
            (``mesh["tp"]``, ``(mesh, "tp")``, ``(mesh, 1)``); a DTensor input is refused.
        dim: the dimension to concatenate along.
        sizes: every rank's extent along ``dim``, the same list on every rank; given, the call
            sends nothing but the data.
        objective: ``"sum"`` (the losses of every rank add up) or ``"replicated"`` (every rank
            computes the same loss, counted once).
        async_op: return at once an ``AsyncTensor`` that waits for its data on first use.

    Returns:
        The concatenation of every rank's ``x`` along ``dim``, in rank order, on every rank.

    Raises:
        CollectiveArgumentError: an argument is invalid on some rank (``dim`` out of range,
            ``sizes`` of the wrong length or not this rank's extent, an unknown ``objective``);
            raised on every rank of the group, before any data moves, naming the rank, the argument
            and what was expected.
        CollectiveMismatchError: the ranks' arguments do not fit together (other dims, dtype,
            device type or ``sizes`` that differ), found while the group's first calls are checked
            across ranks, in debug mode (``set_debug``) and, after them, by the data guard
            (``set_guard``).
        torch.distributed.DistBackendError: a peer's process died while this rank waited
            (``PeerGoneError``, a subclass, when distgrad's liveness check saw it first); the
            message names the op, the pass and the peer (docs/faults.md).
        RuntimeError: a peer never came within the group's timeout (the backend's timeout error,
            with distgrad's account of who waited where first).

    Example:
        >>> def gathered(rank, world_size):  # every rank sends one row: its rank
        ...     return dg.all_gather(torch.ones(1) * rank, sizes=[1] * world_size)
        >>> dg.testing.run_on_ranks(gathered, 2, simulate=True)  # 2 ranks, simulated here
        [tensor([0., 1.]), tensor([0., 1.])]
    """
    call = ALL_GATHER.bind(group, x, dim=dim, objective=objective, sizes=sizes)
    if call.group.size == 1:
        return x.clone()
    plan = call.plan or call.keep(_all_gather_plan(call, x, objective))
    return apply(_AllGather, x, plan, async_op=async_op)


def _all_gather_plan(call: Bound, x: Tensor, objective: c.Objective) -> _Plan:
    dim = call["dim"]
    sizes = sizes_along(call, call["sizes"], c.extent(x, dim))
    return _Plan(call.group, sizes, dim, objective=objective)


@offers_async_op
def reduce_scatter(
    x: Tensor,
    op: c.ReduceOp = "sum",
    group: GroupLike = None,
    *,
    dim: int = 0,
    sizes: Sequence[int] | None = None,
    async_op: bool = False,
) -> Tensor:
    """Reduce ``x`` over ranks with ``op`` and give each rank its slice of the result along ``dim``.

    Every rank passes a tensor of the same shape. ``sizes[i]`` is rank i's slice length along
    ``dim`` (uneven sizes allowed; they must add up to ``x.shape[dim]`` and be the same on every
    rank); the default splits evenly and requires ``x.shape[dim]`` to divide by the group size.
    ``op`` is one of "sum", "avg", "prod", "max", "min", or the matching
    ``torch.distributed.ReduceOp``. ``x`` is not modified.

    Gradient (the objective is the sum over ranks of each rank's loss):

    * sum: ``all_gather(grad, dim=dim)``; avg: the same divided by the group size;
    * prod: each entry's gradient is the incoming gradient times the product of the *other*
      ranks' entries, computed without division (exact with zeros, infinities, overflow);
    * max, min: the incoming gradient goes to the ranks holding the extreme value, split evenly
      among ties, as ``torch.amax``/``torch.amin`` do on the stacked inputs.

    Communication: forward 1 all_to_all moving (N-1)/N of x, then a local reduction (sum and
    avg on NCCL with equal slices: its reduce-scatter); backward 1 all_gather of the gradient
    (sum, avg) or 1 all_to_all of the same size as the forward's (prod, max, min). No metadata
    once the first calls on the group are checked.

    ``async_op=True``: return at once an :class:`~distgrad.AsyncTensor`, which waits for the
    data on first use; the backward's exchange is started the same way (docs/semantics.md,
    "Overlap: async_op").

    Args:
        x: this rank's tensor, the same shape on every rank; not modified.
        op: ``"sum"``, ``"avg"``, ``"prod"``, ``"max"``, ``"min"`` or the matching
            ``torch.distributed.ReduceOp``.
        group: the process group (default: the default group), a DeviceMesh dimension
            (``mesh["tp"]``, ``(mesh, "tp")``, ``(mesh, 1)``); a DTensor input is refused.
        dim: the dimension to split along.
        sizes: every rank's slice length along ``dim``, adding up to ``x.shape[dim]``, the same
            list on every rank (default: an even split).
        async_op: return at once an ``AsyncTensor`` that waits for its data on first use.

    Returns:
        This rank's slice, along ``dim``, of the reduction over ranks.

    Raises:
        CollectiveArgumentError: an argument is invalid on some rank (an unknown ``op``, ``sizes``
            that do not add up to ``x.shape[dim]``, an extent that does not divide evenly); raised
            on every rank of the group, before any data moves, naming the rank, the argument and
            what was expected.
        CollectiveMismatchError: the ranks' arguments do not fit together (shapes, dtypes or
            ``sizes`` that differ), found while the group's first calls are checked across ranks,
            in debug mode (``set_debug``) and, after them, by the data guard (``set_guard``).
        torch.distributed.DistBackendError: a peer's process died while this rank waited
            (``PeerGoneError``, a subclass, when distgrad's liveness check saw it first); the
            message names the op, the pass and the peer (docs/faults.md).
        RuntimeError: a peer never came within the group's timeout (the backend's timeout error,
            with distgrad's account of who waited where first).

    Example:
        >>> def summed(rank, world_size):  # each rank holds [1, 2] * (rank + 1)
        ...     return dg.reduce_scatter(torch.tensor([1.0, 2.0]) * (rank + 1))
        >>> dg.testing.run_on_ranks(summed, 2, simulate=True)  # rank 0: 1 + 2; rank 1: 2 + 4
        [tensor([3.]), tensor([6.])]
    """
    call = REDUCE_SCATTER.bind(group, x, op=op, dim=dim, sizes=sizes)
    if call["op"] == "sum" and call.group.size > 1:
        plan = call.plan or call.keep(_Plan(call.group, call["sizes"], call["dim"]))
        return apply(_ReduceScatterSum, x, plan, async_op=async_op)
    return apply_reduce_scatter(x, call.group, call["sizes"], call["dim"], call["op"], async_op)
