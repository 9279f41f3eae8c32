"""all_to_all: its own adjoint, with the input and output sizes swapped."""

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

__all__ = ["all_to_all", "apply_all_to_all"]


@dataclass(frozen=True)
class _Plan:
    group: Group
    input_sizes: tuple[int, ...]
    output_sizes: tuple[int, ...]
    dim: int

    def swapped(self) -> _Plan:
        return _Plan(self.group, self.output_sizes, self.input_sizes, self.dim)


class _AllToAll(torch.autograd.Function):
    @staticmethod
    def forward(ctx: FunctionCtx, x: Tensor, plan: _Plan, anchor: Tensor | None) -> Tensor:
        ctx.plan = plan  # type: ignore[attr-defined]
        moved = c.to_front(x, plan.dim)
        out = _comm.all_to_all(moved, plan.input_sizes, plan.output_sizes, plan.group)
        return c.output(c.from_front(out, plan.dim))

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor | None, None, None]:
        plan: _Plan = ctx.plan
        check_backward_order("all_to_all", plan.group, grad)
        back = c.apply(_AllToAll, grad, plan.swapped(), None)
        return (back if ctx.needs_input_grad[0] else None), None, None


def apply_all_to_all(
    x: Tensor,
    group: Group,
    input_sizes: tuple[int, ...],
    output_sizes: tuple[int, ...],
    dim: int,
    required: bool,
) -> Tensor:
    """all_to_all without the handshake, for ops built on it (their arguments are checked)."""
    if group.size == 1:
        return x.clone()
    plan = _Plan(group, input_sizes, output_sizes, dim)
    return c.apply(_AllToAll, x, plan, c.anchor(x, required))


def all_to_all(
    x: Tensor,
    group: ProcessGroup | None = None,
    *,
    dim: int = 0,
    input_sizes: list[int] | tuple[int, ...] | None = None,
    output_sizes: list[int] | tuple[int, ...] | None = None,
) -> Tensor:
    """Split ``x`` along ``dim`` into one part per rank, send part i to rank i, concatenate what
    arrives, in rank order.

    ``input_sizes[i]`` is the length of the part sent to rank i (default: an even split, which
    requires ``x.shape[dim]`` to divide by the group size). ``output_sizes[i]`` is the length
    received from rank i; it is learned from the other ranks when not given, and checked against
    them when given. Other dims, dtype and device type must match across ranks. ``x`` is not
    modified.

    Gradient (the objective is the sum over ranks of each rank's loss): ``all_to_all`` of the
    gradient with ``input_sizes`` and ``output_sizes`` swapped: every slice goes back to the rank
    that sent it.

    Communication: forward 1 all_to_all of x after a small metadata handshake and one all_gather
    of 2N ints (every rank's sizes); backward 1 all_to_all of the gradient.
    """
    g = resolve(group)
    desc = f"all_to_all(dim={dim})"
    dim, problem = c.normalize_dim(dim, x.dim())
    total = x.shape[dim] if x.dim() else 0
    sent, size_problem = c.split_sizes("input_sizes", input_sizes, total, g.size)
    problem = problem or size_problem
    if problem is None and output_sizes is not None:
        problem = _output_sizes_problem(output_sizes, g.size)
    calls = c.handshake("all_to_all", desc, g, x, [c.Arg("dim", dim)], problem)
    g = c.at_call(g, calls)
    c.check_shapes_except(desc, g, calls, dim)
    received = _exchange_sizes(desc, g, sent, output_sizes)
    return apply_all_to_all(x, g, sent, received, dim, c.needs_grad(calls))


def _output_sizes_problem(sizes: list[int] | tuple[int, ...], parts: int) -> str | None:
    if len(sizes) != parts or any(not isinstance(s, int) or s < 0 for s in sizes):
        return f"output_sizes must be {parts} non-negative ints (one per rank), got {list(sizes)}"
    return None


def _exchange_sizes(
    desc: str,
    group: Group,
    sent: tuple[int, ...],
    expected: list[int] | tuple[int, ...] | None,
) -> tuple[int, ...]:
    """What this rank receives from each rank; every rank checks every rank's expectation."""
    if group.size == 1:
        return sent
    n = group.size
    mine = list(sent) + (list(expected) if expected is not None else [-1] * n)
    table = _comm.share(mine, group)
    # table[s][:n] = what rank s sends to each rank; table[r][n:] = what rank r expects.
    for r in range(n):
        for s in range(n):
            want, got = table[r][n + s], table[s][r]
            if want >= 0 and want != got:
                raise CollectiveMismatchError(
                    f"{desc} on rank {group.rank}: rank {r} expects {want} entries from rank "
                    f"{s} (output_sizes[{s}]), but rank {s} sends {got} (input_sizes[{r}])"
                )
    return tuple(table[s][group.rank] for s in range(n))
