"""lightly #1977 / PR #1980: Barlow Twins with ``gather_distributed=True``, gradient x1/W
under DDP.

Threads: github.com/lightly-ai/lightly/issues/1977 and github.com/lightly-ai/lightly/pull/1980.
The cross-correlation ``c = z1n^T z2n / N`` was summed over ranks with the raw
``torch.distributed.all_reduce`` (as the official Barlow Twins script does): the value is the
global one, but autograd sees only this rank's part of ``c``, so each rank's embeddings get
1/W of the gradient DDP's averaging needs. (Fixed with ``torch.distributed.nn.all_reduce``.)

This reproduction leaves out the batch normalisation (the embeddings are taken as already
standardised, as a SyncBatchNorm would give), so that only the gradient bug remains.
The checker: "every gradient is scaled by 1/2 (z1 and z2)".
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import Tensor

import distgrad as dg


def loss(z1: Tensor, z2: Tensor) -> Tensor:
    world = dist.get_world_size() if dist.is_initialized() else 1
    c = z1.T @ z2 / (z1.shape[0] * world)  # [D, D], this rank's part (even shards)
    if dist.is_initialized():
        with torch.no_grad():  # the bug: raw all_reduce, invisible to autograd
            dist.all_reduce(c)
    on_diagonal = (1 - c.diagonal()).pow(2).sum()
    off_diagonal = c.pow(2).sum() - c.diagonal().pow(2).sum()
    return on_diagonal + 5e-3 * off_diagonal


def make_inputs() -> dict[str, Tensor]:
    gen = torch.Generator().manual_seed(2)
    base = torch.randn(8, 4, dtype=torch.float64, generator=gen)
    return {
        "z1": base + 0.3 * torch.randn(8, 4, dtype=torch.float64, generator=gen),
        "z2": base + 0.3 * torch.randn(8, 4, dtype=torch.float64, generator=gen),
    }


def check(world_size: int = 2) -> dg.testing.GradReport:
    return dg.testing.check_against_single_process(loss, make_inputs(), world_size=world_size)


if __name__ == "__main__":
    print(check())
