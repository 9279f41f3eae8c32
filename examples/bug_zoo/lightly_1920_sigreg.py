"""lightly #1920: SIGReg with ``gather_distributed=True``, gradient x1/W under DDP.

Thread: github.com/lightly-ai/lightly/issues/1920. SIGReg (LeJEPA) compares the empirical
characteristic function of projected embeddings with a Gaussian's; with
``gather_distributed`` its cos/sin sums were summed over ranks with the raw
``torch.distributed.all_reduce``, which autograd does not see: each rank's embeddings get
the gradient of the global statistic through their own rows' terms only, 1/W of what DDP's
averaging needs. (Fixed with the autograd-aware ``torch.distributed.nn.all_reduce``.)

This reproduction: the same statistic, ours, on 2 directions and 6 frequencies.
The checker: "every gradient is scaled by 1/2 (z)".
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import Tensor

import distgrad as dg


def loss(z: Tensor) -> Tensor:
    t = torch.linspace(0.5, 3.0, 6, dtype=z.dtype)  # the frequencies
    directions = torch.eye(z.shape[1], 2, dtype=z.dtype)
    arg = (z @ directions)[:, :, None] * t  # [B_l, 2, 6]
    cos_sum, sin_sum = arg.cos().sum(0), arg.sin().sum(0)
    count = torch.tensor(float(z.shape[0]), dtype=z.dtype)
    if dist.is_initialized():
        with torch.no_grad():  # the bug: raw all_reduce, invisible to autograd
            for s in (cos_sum, sin_sum, count):
                dist.all_reduce(s)
    error = (cos_sum / count - torch.exp(-(t**2) / 2)) ** 2 + (sin_sum / count) ** 2
    return error.sum()


def make_inputs() -> dict[str, Tensor]:
    gen = torch.Generator().manual_seed(1)
    return {"z": 1.5 * torch.randn(8, 3, dtype=torch.float64, generator=gen)}


def check(world_size: int = 2) -> dg.testing.GradReport:
    return dg.testing.check_against_single_process(loss, make_inputs(), world_size=world_size)


if __name__ == "__main__":
    print(check())
