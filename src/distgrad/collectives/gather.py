"""gather and scatter: each one's backward is the other.

``dst`` and ``src`` are group ranks. Shapes: ``sizes[i]`` is rank i's extent along ``dim``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor
from torch.autograd.function import FunctionCtx

from distgrad import _comm
from distgrad._group import Group, ProcessGroup, resolve
from distgrad.collectives import _common as c
from distgrad.collectives._debug import check_backward_order
from distgrad.errors import CollectiveMismatchError

__all__ = ["apply_gather", "gather", "scatter"]


@dataclass(frozen=True)
class _Plan:
    group: Group
    sizes: tuple[int, ...]
    dim: int
    root: int
    trailing: tuple[int, ...]  # the shape of one rank's slice, dim moved to the front, minus dim
    dtype: torch.dtype
    device: torch.device


class _Gather(torch.autograd.Function):
    @staticmethod
    def forward(ctx: FunctionCtx, x: Tensor, plan: _Plan, anchor: Tensor | None) -> Tensor:
        ctx.plan = plan  # type: ignore[attr-defined]
        moved = c.to_front(x, plan.dim)
        out = _comm.gather(moved, plan.sizes, plan.root, plan.group)
        if out is None:  # not the destination: an empty slice along dim
            out = moved.new_empty((0, *moved.shape[1:]))
        return c.output(c.from_front(out, plan.dim))

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor | None, None, None]:
        plan: _Plan = ctx.plan
        check_backward_order("gather", plan.group)
        # Other ranks' (empty) gradient is not read by the scatter, but passing it keeps their
        # result connected to it, so a double backward takes every rank through the gather.
        back = c.apply(_Scatter, grad, plan, None)
        return (back if ctx.needs_input_grad[0] else None), None, None


class _Scatter(torch.autograd.Function):
    @staticmethod
    def forward(ctx: FunctionCtx, x: Tensor | None, plan: _Plan, anchor: Tensor | None) -> Tensor:
        ctx.plan = plan  # type: ignore[attr-defined]
        moved = c.to_front(x, plan.dim) if x is not None else None
        out = _comm.scatter(
            moved, plan.sizes, plan.root, plan.trailing, plan.dtype, plan.device, plan.group
        )
        return c.output(c.from_front(out, plan.dim))

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor | None, None, None]:
        plan: _Plan = ctx.plan
        check_backward_order("scatter", plan.group)
        full = c.apply(_Gather, grad, plan, None)
        is_root = plan.group.rank == plan.root
        return (full if is_root and ctx.needs_input_grad[0] else None), None, None


def apply_gather(
    x: Tensor, group: Group, sizes: tuple[int, ...], dim: int, dst: int, required: bool
) -> Tensor:
    """gather without the handshake, for ops built on it (their arguments are checked)."""
    if group.size == 1:
        return x.clone()
    trailing = tuple(s for i, s in enumerate(x.shape) if i != dim)
    plan = _Plan(group, sizes, dim, dst, trailing, x.dtype, x.device)
    return c.apply(_Gather, x, plan, c.anchor(x, required))


def gather(x: Tensor, dst: int, group: ProcessGroup | None = None, *, dim: int = 0) -> Tensor:
    """Concatenate every rank's ``x`` along ``dim``, in rank order, on group rank ``dst`` only.

    Ranks may pass different sizes along ``dim``; all other dims, the dtype and the device type
    must match. Returns the concatenation on ``dst`` and, on every other rank, an empty tensor
    (size 0 along ``dim``). Every rank must still back-propagate through its result, since the
    backward is a collective. ``x`` is not modified.

    Gradient (the objective is the sum over ranks of each rank's loss):
    ``scatter(grad, src=dst, dim=dim, sizes=sizes)``: each rank's ``x`` gets its own slice of
    ``dst``'s incoming gradient.

    Communication: forward 1 gather of x (padded to the largest rank's size when sizes differ)
    after a small metadata handshake; backward 1 scatter.
    """
    g = resolve(group)
    desc = f"gather(dst={dst}, dim={dim})"
    dim, problem = c.normalize_dim(dim, x.dim())
    problem = problem or c.rank_problem("dst", dst, g.size)
    calls = c.handshake(
        "gather",
        desc,
        g,
        x,
        [c.Arg("dst", dst if problem is None else -1), c.Arg("dim", dim)],
        problem,
    )
    g = c.at_call(g, calls)
    c.check_shapes_except(desc, g, calls, dim)
    sizes = tuple(call.shape[dim] for call in calls)
    return apply_gather(x, g, sizes, dim, dst, c.needs_grad(calls))


def scatter(
    x: Tensor | None,
    src: int,
    group: ProcessGroup | None = None,
    *,
    dim: int = 0,
    sizes: list[int] | tuple[int, ...] | None = None,
) -> Tensor:
    """Split group rank ``src``'s ``x`` along ``dim`` into one part per rank; rank i gets part i.

    On ``src``, ``x`` is the tensor to split and ``sizes[i]`` is rank i's part length (default:
    an even split, which requires ``x.shape[dim]`` to divide by the group size). On every other
    rank pass ``x=None`` (a tensor is accepted and ignored) and no ``sizes`` (ignored too): the
    shape, dtype and sizes come from ``src``. The result is on ``x``'s device on ``src`` and on
    the group's default device elsewhere (CPU for gloo, the current GPU for NCCL). ``x`` is not
    modified.

    Gradient (the objective is the sum over ranks of each rank's loss):
    ``gather(grad, dst=src, dim=dim)``: ``src``'s ``x`` gets every rank's incoming gradient,
    concatenated in rank order.

    Communication: forward 1 scatter after a small metadata handshake (plus 1 broadcast of N ints
    when ``sizes`` is given); backward 1 gather.
    """
    g = resolve(group)
    desc = f"scatter(src={src}, dim={dim})"
    requested_dim = dim  # every rank must pass the same dim; only the source can check it
    problem = c.rank_problem("src", src, g.size)
    is_src = problem is None and g.rank == src
    mine = x if is_src else None
    if is_src and problem is None:
        if x is None:
            problem = "the source rank must pass the tensor to scatter, got None"
        else:
            dim, problem = c.normalize_dim(dim, x.dim())
            if problem is None and sizes is not None:
                problem = c.split_sizes("sizes", sizes, x.shape[dim], g.size)[1]
    calls = c.handshake(
        "scatter",
        desc,
        g,
        mine,
        [
            c.Arg("src", src if problem is None else -1),
            c.Arg("dim", requested_dim),
            c.Arg("uneven sizes", int(is_src and sizes is not None), same=False),
        ],
        problem,
    )
    g = c.at_call(g, calls)
    source = calls[src]
    dim = dim % len(source.shape)
    plan_sizes = _agree_sizes(desc, g, src, sizes, bool(source.args[2]), source.shape[dim])
    if g.size == 1:
        assert x is not None
        return x.clone()
    moved_shape = (source.shape[dim], *(s for i, s in enumerate(source.shape) if i != dim))
    device = x.device if is_src and x is not None else _comm.metadata_device(g)
    assert source.dtype is not None
    plan = _Plan(g, plan_sizes, dim, src, moved_shape[1:], source.dtype, device)
    return c.apply(_Scatter, mine, plan, c.anchor(mine, source.requires_grad, device))


def _agree_sizes(
    desc: str,
    group: Group,
    src: int,
    sizes: list[int] | tuple[int, ...] | None,
    uneven: bool,
    total: int,
) -> tuple[int, ...]:
    """The part lengths: an even split, or ``src``'s ``sizes`` sent to every rank."""
    if uneven:
        if group.size == 1:
            assert sizes is not None
            return tuple(sizes)
        device = _comm.metadata_device(group)
        if group.rank == src:
            assert sizes is not None
            local = torch.tensor(list(sizes), dtype=torch.int64, device=device)
        else:
            local = torch.zeros(group.size, dtype=torch.int64, device=device)
        return tuple(_comm.broadcast(local, src, group).tolist())
    if total % group.size:
        raise CollectiveMismatchError(
            f"{desc} on rank {group.rank}: the source's x has {total} entries along dim, which "
            f"does not divide evenly over {group.size} ranks; pass sizes=[...] on the source"
        )
    return (total // group.size,) * group.size
