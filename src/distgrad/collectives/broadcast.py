"""broadcast and reduce: under the sum objective, each one's backward is the other.

``src`` and ``dst`` are group ranks (0 to size-1 within ``group``), not global ranks.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from distgrad._exchange import ops
from distgrad._exchange.async_op import offers_async_op
from distgrad._exchange.group import Group
from distgrad._mesh import GroupLike
from distgrad.collectives import _common as c
from distgrad.collectives._differentiable import Adjoint, Collective, Plan, apply
from distgrad.collectives._fields import Choice, Rank, Reduction
from distgrad.collectives._signature import Signature
from distgrad.collectives.all_gather import apply_reduce_scatter
from distgrad.collectives.gather import apply_gather

__all__ = ["broadcast", "reduce"]

BROADCAST = Signature("broadcast", fields=(Rank("src"), Choice("objective", c.OBJECTIVES)))
REDUCE = Signature("reduce", fields=(Rank("dst"), Reduction()))


@dataclass(frozen=True)
class _Plan(Plan):
    root: int


class _Broadcast(Collective):
    name = "broadcast"

    @staticmethod
    def run(x: Tensor, plan: _Plan) -> Tensor:
        exchange = ops.broadcast.in_flight if plan.async_op else ops.broadcast
        out = exchange(c.as_bytes(x), plan.root, group=plan.group)
        return c.from_exchange(out, x.dtype)

    @staticmethod
    def adjoint(plan: _Plan) -> Adjoint:
        # Non-source ranks get _ReduceSum's constant zeros: the right value, and connected to
        # the graph, so a double backward takes them through the broadcast it starts.
        return _ReduceSum, plan

    @staticmethod
    def replicated(grad: Tensor, plan: _Plan) -> Tensor | None:
        # One shared loss: the source's input gets the incoming gradient, nobody sums.
        return grad if plan.group.rank == plan.root else None


class _ReduceSum(Collective):
    name = "reduce"

    @staticmethod
    def run(x: Tensor, plan: _Plan) -> Tensor:
        # Other ranks get a constant zero tensor: its gradient is zero and is never read.
        exchange = ops.reduce.in_flight if plan.async_op else ops.reduce
        return c.output(exchange(x, plan.root, group=plan.group))

    @staticmethod
    def adjoint(plan: _Plan) -> Adjoint:
        return _Broadcast, plan


@offers_async_op
def broadcast(
    x: Tensor,
    src: int,
    group: GroupLike = None,
    *,
    objective: c.Objective = "sum",
    async_op: bool = False,
) -> Tensor:
    """Every rank gets a copy of group rank ``src``'s ``x``.

    Every rank passes a tensor of the same shape, dtype and device type; only ``src``'s values
    are read. ``src`` is a rank within ``group`` (torch.distributed's ``group_src``, not its
    global ``src``). ``x`` is not modified.

    Gradient with ``objective="sum"`` (the objective is the sum over ranks of each rank's loss):
    ``reduce(grad, dst=src, op="sum")``: the source's ``x`` gets the sum of every rank's incoming
    gradient; the other ranks' ``x`` get zeros (their values are not used). With
    ``objective="replicated"`` (every rank computes the same loss, counted once) the source keeps
    its own incoming gradient, with no communication.

    Communication: forward 1 broadcast of x; backward 1 reduce (none when replicated). No
    metadata once the first calls on the group are checked.

    ``async_op=True``: return at once an :class:`~distgrad.AsyncTensor`, which waits for the
    data on first use; the backward's exchange is started the same way (docs/semantics.md,
    "Overlap: async_op").

    Args:
        x: this rank's tensor (only ``src``'s values are read), the same shape on every rank; not
            modified.
        src: the source, a rank within ``group``.
        group: the process group (default: the default group), a DeviceMesh dimension
            (``mesh["tp"]``, ``(mesh, "tp")``, ``(mesh, 1)``); a DTensor input is refused.
        objective: ``"sum"`` (the losses of every rank add up) or ``"replicated"`` (every rank
            computes the same loss, counted once).
        async_op: return at once an ``AsyncTensor`` that waits for its data on first use.

    Returns:
        A copy of ``src``'s ``x``, on every rank.

    Raises:
        CollectiveArgumentError: an argument is invalid on some rank (``src`` not a rank of the
            group, an unknown ``objective``); raised on every rank of the group, before any data
            moves, naming the rank, the argument and what was expected.
        CollectiveMismatchError: the ranks' arguments do not fit together (``src``, shapes or
            dtypes that differ), found while the group's first calls are checked across ranks, in
            debug mode (``set_debug``) and, after them, by the data guard (``set_guard``).
        torch.distributed.DistBackendError: a peer's process died while this rank waited
            (``PeerGoneError``, a subclass, when distgrad's liveness check saw it first); the
            message names the op, the pass and the peer (docs/faults.md).
        RuntimeError: a peer never came within the group's timeout (the backend's timeout error,
            with distgrad's account of who waited where first).

    Example:
        >>> def copied(rank, world_size):
        ...     return dg.broadcast(torch.full((2,), 7.0) + rank, src=1)  # rank 1 holds 8s
        >>> dg.testing.run_on_ranks(copied, 2, simulate=True)
        [tensor([8., 8.]), tensor([8., 8.])]
    """
    call = BROADCAST.bind(group, x, src=src, objective=objective)
    if call.group.size == 1:
        return x.clone()
    plan = call.plan or call.keep(_Plan(call.group, src, objective=objective))
    return apply(_Broadcast, x, plan, async_op=async_op)


@offers_async_op
def reduce(
    x: Tensor,
    dst: int,
    op: c.ReduceOp = "sum",
    group: GroupLike = None,
    *,
    async_op: bool = False,
) -> Tensor:
    """Reduce ``x`` elementwise over the ranks of ``group`` with ``op``; group rank ``dst`` gets it.

    Returns the result on ``dst`` and, on every other rank, a tensor of zeros of the same shape
    (a constant: nothing flows back through it). ``op`` is one of "sum", "avg", "prod", "max",
    "min", or the matching ``torch.distributed.ReduceOp``. Every rank passes a tensor of the
    same shape, dtype and device type. ``dst`` is a rank within ``group`` (torch.distributed's
    ``group_dst``). ``x`` is not modified. Every rank must still back-propagate through its
    result (the zeros included), since the backward is a collective.

    Gradient (the objective is the sum over ranks of each rank's loss): sum:
    ``broadcast(grad, src=dst)``, so every rank's ``x`` gets ``dst``'s incoming gradient; avg: the
    same divided by the group size; prod, max, min: as in :func:`all_reduce` with ``dst``'s
    incoming gradient (the product of the other ranks' entries; the extreme value's holders,
    split evenly among ties).

    Communication: forward 1 reduce (sum, avg) or 1 all_to_all plus 1 gather (prod, max, min);
    backward 1 broadcast (sum, avg) or 1 scatter plus 1 all_to_all (prod, max, min). No metadata
    once the first calls on the group are checked.

    ``async_op=True``: return at once an :class:`~distgrad.AsyncTensor`, which waits for the
    data on first use; the backward's exchange is started the same way (docs/semantics.md,
    "Overlap: async_op").

    Args:
        x: this rank's tensor, the same shape on every rank; not modified.
        dst: the destination, a rank within ``group``.
        op: ``"sum"``, ``"avg"``, ``"prod"``, ``"max"``, ``"min"`` or the matching
            ``torch.distributed.ReduceOp``.
        group: the process group (default: the default group), a DeviceMesh dimension
            (``mesh["tp"]``, ``(mesh, "tp")``, ``(mesh, 1)``); a DTensor input is refused.
        async_op: return at once an ``AsyncTensor`` that waits for its data on first use.

    Returns:
        On ``dst`` the reduction of every rank's ``x``; on every other rank zeros of its shape.

    Raises:
        CollectiveArgumentError: an argument is invalid on some rank (``dst`` not a rank of the
            group, an unknown ``op``); raised on every rank of the group, before any data moves,
            naming the rank, the argument and what was expected.
        CollectiveMismatchError: the ranks' arguments do not fit together (``dst``, ops, shapes or
            dtypes that differ), found while the group's first calls are checked across ranks, in
            debug mode (``set_debug``) and, after them, by the data guard (``set_guard``).
        torch.distributed.DistBackendError: a peer's process died while this rank waited
            (``PeerGoneError``, a subclass, when distgrad's liveness check saw it first); the
            message names the op, the pass and the peer (docs/faults.md).
        RuntimeError: a peer never came within the group's timeout (the backend's timeout error,
            with distgrad's account of who waited where first).

    Example:
        >>> def summed(rank, world_size):
        ...     return dg.reduce(torch.tensor([1.0, 2.0]) * (rank + 1), dst=0)
        >>> dg.testing.run_on_ranks(summed, 2, simulate=True)  # rank 1 gets zeros
        [tensor([3., 6.]), tensor([0., 0.])]
    """
    call = REDUCE.bind(group, x, dst=dst, op=op)
    if call.group.size == 1:
        return x.clone()
    if call["op"] == "sum":
        plan = call.plan or call.keep(_Plan(call.group, dst))
        return apply(_ReduceSum, x, plan, async_op=async_op)
    return _apply_reduce(x, call.group, dst, call["op"], async_op)


def _apply_reduce(x: Tensor, group: Group, dst: int, op: str, async_op: bool) -> Tensor:
    if op == "avg":
        return _apply_reduce(x, group, dst, "sum", async_op) / group.size
    if op == "sum":
        return apply(_ReduceSum, x, _Plan(group, dst), async_op=async_op)
    flat = x.reshape(-1)
    sizes = tuple(c.near_even(flat.numel(), group.size))
    part = apply_reduce_scatter(flat, group, sizes, 0, op, async_op)
    gathered = apply_gather(part, group, sizes, 0, dst, async_op)
    if group.rank == dst:
        return gathered.view(x.shape)
    # ``gathered`` is empty here; adding its (zero) sum keeps this rank's output connected to
    # the gather, so this rank's backward still takes part in the scatter that dst starts.
    return torch.zeros_like(x) + gathered.sum()
