"""Wrong on purpose: the hand-written gathers that circulate, kept to show what goes wrong.

Neither is exported. The demo trains with ``LocalOnlyGather`` beside distgrad, and the checker's
tests use both to show its diagnoses. Each forward is a correct all_gather; the backward is what
is wrong.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def _world() -> int:
    return dist.get_world_size() if dist.is_initialized() else 1


def _raw_gather(x: Tensor) -> list[Tensor]:
    parts = [torch.empty_like(x) for _ in range(_world())]
    if _world() == 1:
        return [x.detach().clone()]
    dist.all_gather(parts, x.detach().contiguous())
    return parts


class _RawGather(torch.autograd.Function):
    """The forward both wrong gathers share, a correct all_gather of equal rows; each subclass
    writes its own (wrong) backward."""

    @staticmethod
    def forward(ctx: Any, x: Tensor) -> Tensor:
        ctx.rows = x.shape[0]
        return torch.cat(_raw_gather(x))


class LocalOnlyGather(_RawGather):
    """The widespread GatherLayer: backward keeps only this rank's slice of its own gradient.

    It ignores the gradient that the other ranks' losses send to this rank's rows, so when every
    rank computes the same global loss the gradient is exactly 1/world_size of the true one, and
    for other losses it is wrong by no simple factor.
    """

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> Tensor:
        start = sum(ctx.rows for _ in range(_rank()))
        return grad[start : start + ctx.rows]


def overwrite_local_slot(x: Tensor) -> Tensor:
    """The other common trick: gather raw, then put the local tensor (with its graph) back."""
    parts = _raw_gather(x)
    parts[_rank()] = x
    return torch.cat(parts)


class MisroutedGather(_RawGather):
    """Sums every rank's gradient (right) but hands each rank the next rank's rows (wrong)."""

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> Tensor:
        total = grad.contiguous().clone()
        if _world() > 1:
            dist.all_reduce(total)
        source = (_rank() + 1) % _world()
        return total[source * ctx.rows : (source + 1) * ctx.rows]
