"""permute: point-to-point exchange along a permutation; its adjoint is the inverse permutation."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor
from torch.autograd.function import FunctionCtx

from distgrad import _comm
from distgrad._group import Group, ProcessGroup, resolve
from distgrad.collectives import _common as c
from distgrad.collectives._debug import check_backward_order

__all__ = ["permute"]


@dataclass(frozen=True)
class _Plan:
    group: Group
    perm: tuple[int, ...]
    recv_shape: tuple[int, ...]  # the shape this rank receives
    send_shape: tuple[int, ...]  # the shape this rank sends

    def inverse(self) -> _Plan:
        inverse = [0] * len(self.perm)
        for source, target in enumerate(self.perm):
            inverse[target] = source
        return _Plan(self.group, tuple(inverse), self.send_shape, self.recv_shape)


class _Permute(torch.autograd.Function):
    @staticmethod
    def forward(ctx: FunctionCtx, x: Tensor, plan: _Plan, anchor: Tensor | None) -> Tensor:
        ctx.plan = plan  # type: ignore[attr-defined]
        return c.output(_comm.permute(x, plan.perm, plan.recv_shape, plan.group))

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor | None, None, None]:
        plan: _Plan = ctx.plan
        check_backward_order("permute", plan.group, grad)
        back = c.apply(_Permute, grad, plan.inverse(), None)
        return (back if ctx.needs_input_grad[0] else None), None, None


def permute(x: Tensor, perm: Sequence[int], group: ProcessGroup | None = None) -> Tensor:
    """Send ``x`` to group rank ``perm[rank]`` and return what arrives from the rank that maps
    here.

    ``perm`` is a permutation of the group ranks 0..size-1, the same on every rank; a ring shift
    is ``[(r + 1) % size for r in range(size)]``. Ranks may send tensors of different shapes
    (each receives its source's shape); dtype and device type must match. ``x`` is not modified.

    Gradient (the objective is the sum over ranks of each rank's loss): ``permute`` of the
    gradient with the inverse permutation: every gradient goes back to the rank that sent the
    value.

    Communication: forward 1 send and 1 receive of x per rank, after a small metadata handshake;
    backward the same with the inverse permutation.
    """
    g = resolve(group)
    perm = tuple(perm)
    desc = "permute"
    problem = None
    if sorted(perm) != list(range(g.size)) or not all(isinstance(p, int) for p in perm):
        problem = f"perm must be a permutation of the group ranks 0..{g.size - 1}, got {list(perm)}"
    calls = c.handshake(
        "permute",
        desc,
        g,
        x,
        [c.Arg("perm (as a hash)", hash(perm) if problem is None else 0)],
        problem,
    )
    g = c.at_call(g, calls)
    if g.size == 1:
        return x.clone()
    source = perm.index(g.rank)
    plan = _Plan(g, perm, calls[source].shape, tuple(x.shape))
    return c.apply(_Permute, x, plan, c.anchor(x, c.needs_grad(calls)))
