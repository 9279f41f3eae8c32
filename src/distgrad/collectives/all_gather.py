"""all_gather and reduce_scatter: under the sum objective, each one's backward is the other.

Shapes: ``sizes[i]`` is rank i's extent along ``dim``; the gathered tensor stacks the ranks'
slices in rank order, so rank i's slice starts at ``offsets(sizes)[i]``.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

import torch
from torch import Tensor
from torch.autograd.function import FunctionCtx

from distgrad import _comm
from distgrad._group import Group, ProcessGroup, resolve
from distgrad.collectives import _common as c
from distgrad.collectives._debug import check_backward_order, check_replicated
from distgrad.collectives.all_to_all import apply_all_to_all

__all__ = ["all_gather", "apply_all_gather", "apply_reduce_scatter", "reduce_scatter"]


@dataclass(frozen=True)
class _Plan:
    group: Group
    sizes: tuple[int, ...]
    dim: int
    objective: c.Objective = "sum"


class _AllGather(torch.autograd.Function):
    @staticmethod
    def forward(ctx: FunctionCtx, x: Tensor, plan: _Plan, anchor: Tensor | None) -> Tensor:
        ctx.plan = plan  # type: ignore[attr-defined]
        gathered = _comm.all_gather(c.to_front(x, plan.dim), plan.sizes, plan.group)
        return c.output(c.from_front(gathered, plan.dim))

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor | None, None, None]:
        plan: _Plan = ctx.plan
        check_backward_order("all_gather", plan.group)
        if plan.objective == "replicated":
            # Every rank holds the same gradient of one shared loss: keep this rank's slice.
            check_replicated("all_gather", plan.group, grad)
            start = c.offsets(plan.sizes)[plan.group.rank]
            local = grad.narrow(plan.dim, start, plan.sizes[plan.group.rank])
        else:
            local = c.apply(_ReduceScatterSum, grad, plan, None)
        return (local if ctx.needs_input_grad[0] else None), None, None


class _ReduceScatterSum(torch.autograd.Function):
    @staticmethod
    def forward(ctx: FunctionCtx, x: Tensor, plan: _Plan, anchor: Tensor | None) -> Tensor:
        ctx.plan = plan  # type: ignore[attr-defined]
        summed = _comm.reduce_scatter(c.to_front(x, plan.dim), plan.sizes, plan.group)
        return c.output(c.from_front(summed, plan.dim))

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor | None, None, None]:
        plan: _Plan = ctx.plan
        check_backward_order("reduce_scatter", plan.group)
        full = c.apply(_AllGather, grad, replace(plan, objective="sum"), None)
        return (full if ctx.needs_input_grad[0] else None), None, None


def apply_all_gather(
    x: Tensor,
    group: Group,
    sizes: tuple[int, ...],
    dim: int,
    objective: c.Objective,
    required: bool,
) -> Tensor:
    """all_gather without the handshake, for ops built on it (their arguments are checked)."""
    if group.size == 1:
        return x.clone()
    return c.apply(_AllGather, x, _Plan(group, sizes, dim, objective), c.anchor(x, required))


def apply_reduce_scatter(
    x: Tensor, group: Group, sizes: tuple[int, ...], dim: int, op: str, required: bool
) -> Tensor:
    """reduce_scatter without the handshake, for ops built on it (their arguments are checked)."""
    if op == "avg":
        return apply_reduce_scatter(x, group, sizes, dim, "sum", required) / group.size
    if group.size == 1:
        return x.clone()
    if op == "sum":
        plan = _Plan(group, sizes, dim)
        return c.apply(_ReduceScatterSum, x, plan, c.anchor(x, required))
    # prod, max, min: every rank receives the N slices of its part and reduces them locally, so
    # the gradient is torch's own for a local amax/amin/prod over the stacked slices (ties split
    # evenly, zeros exact) and all_to_all (self-adjoint) routes it back to the owners.
    mine = sizes[group.rank]
    moved = c.to_front(x, dim)
    slices = apply_all_to_all(moved, group, sizes, (mine,) * group.size, 0, required)
    stacked = slices.view(group.size, mine, *moved.shape[1:])
    if op == "max":
        reduced = stacked.amax(0)
    elif op == "min":
        reduced = stacked.amin(0)
    else:
        reduced = stacked.prod(0)
    return c.from_front(reduced, dim)


def all_gather(
    x: Tensor,
    group: ProcessGroup | None = None,
    *,
    dim: int = 0,
    objective: c.Objective = "sum",
) -> Tensor:
    """Concatenate every rank's ``x`` along ``dim``, in rank order, on every rank.

    Ranks may pass different sizes along ``dim`` (a different batch per rank); all other dims,
    the dtype and the device type must match. ``x`` is not modified.

    Gradient (``objective="sum"``: the objective is the sum over ranks of each rank's loss):
    ``reduce_scatter(grad, op="sum", dim=dim)``; each rank receives the sum, over all ranks, of
    the gradient for its own slice. With ``objective="replicated"`` (every rank computes the
    same loss from the gathered tensor and it counts once) each rank keeps its own slice of its
    incoming gradient, with no communication.

    Communication: forward 1 all_gather of x (padded to the largest rank's size when sizes
    differ) after a small metadata handshake; backward 1 all_to_all moving (N-1)/N of the
    gradient, then a local sum (nothing with ``objective="replicated"``).
    """
    g = resolve(group)
    desc = f"all_gather(dim={dim})"
    ndim = x.dim() if isinstance(x, Tensor) else 0
    dim, problem = c.normalize_dim(dim, ndim)
    problem = problem or c.objective_problem(objective)
    calls = c.handshake(
        "all_gather",
        desc,
        g,
        x,
        [
            c.Arg("dim", dim),
            c.Arg(
                "objective",
                c.OBJECTIVES.index(objective) if not problem else 0,
                lambda i: c.OBJECTIVES[i],
            ),
        ],
        problem,
    )
    g = c.at_call(g, calls)
    c.check_shapes_except(desc, g, calls, dim)
    sizes = tuple(call.shape[dim] for call in calls)
    return apply_all_gather(x, g, sizes, dim, objective, c.needs_grad(calls))


def reduce_scatter(
    x: Tensor,
    op: c.ReduceOp = "sum",
    group: ProcessGroup | None = None,
    *,
    dim: int = 0,
    sizes: list[int] | tuple[int, ...] | None = None,
) -> Tensor:
    """Reduce ``x`` over ranks with ``op`` and give each rank its slice of the result along ``dim``.

    Every rank passes a tensor of the same shape. ``sizes[i]`` is rank i's slice length along
    ``dim`` (uneven sizes allowed; they must add up to ``x.shape[dim]`` and be the same on every
    rank); the default splits evenly and requires ``x.shape[dim]`` to divide by the group size.
    ``op`` is one of "sum", "avg", "prod", "max", "min". ``x`` is not modified.

    Gradient (the objective is the sum over ranks of each rank's loss):

    * sum: ``all_gather(grad, dim=dim)``; avg: the same divided by the group size;
    * prod: each entry's gradient is the incoming gradient times the product of the *other*
      ranks' entries, computed without division (exact when entries are zero);
    * max, min: the incoming gradient goes to the ranks holding the extreme value, split evenly
      among ties, as ``torch.amax``/``torch.amin`` do on the stacked inputs.

    Communication: forward 1 all_to_all moving (N-1)/N of x, then a local reduction, after a
    small metadata handshake; backward 1 all_gather of the gradient (sum, avg) or 1 all_to_all
    of the same size as the forward's (prod, max, min).
    """
    g = resolve(group)
    desc = f"reduce_scatter(op={op!r}, dim={dim})"
    dim, problem = c.normalize_dim(dim, x.dim())
    problem = problem or c.op_problem(op)
    total = x.shape[dim] if x.dim() else 0
    plan_sizes, size_problem = c.split_sizes("sizes", sizes, total, g.size)
    problem = problem or size_problem
    op_code = c.REDUCE_OPS.index(op) if op in c.REDUCE_OPS else 0
    calls = c.handshake(
        "reduce_scatter",
        desc,
        g,
        x,
        [
            c.Arg("op", op_code, lambda i: c.REDUCE_OPS[i]),
            c.Arg("dim", dim),
            c.Arg("sizes (as a hash)", hash(plan_sizes)),
        ],
        problem,
    )
    g = c.at_call(g, calls)
    c.check_shapes_equal(desc, g, calls)
    required = c.needs_grad(calls)
    c.check_grad_dtype(desc, op, x.dtype, required)
    return apply_reduce_scatter(x, g, plan_sizes, dim, op, required)
