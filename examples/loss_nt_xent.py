"""SimCLR's NT-Xent on N local CPU processes: one small encoder under DDP, two noisy "views"
of each sample, dg.losses.NTXentLoss over the global batch (2B - 2 negatives per anchor).

    python examples/loss_nt_xent.py         # 2 ranks, global batch 64, 30 steps

Only rank 0 prints; every rank gets the same (global) loss value.
"""

from __future__ import annotations

import argparse

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel

import distgrad as dg
from distgrad.testing import run_on_ranks


def train(rank: int, world_size: int, batch: int, steps: int) -> list[float]:
    torch.manual_seed(0)  # the same initial weights on every rank
    model = DistributedDataParallel(nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 8)))
    criterion = dg.losses.NTXentLoss(temperature=0.5, block_size=16)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    gen = torch.Generator().manual_seed(1)  # the same synthetic global batch on every rank
    samples = torch.randn(batch, 16, generator=gen)
    mine = slice(rank * batch // world_size, (rank + 1) * batch // world_size)
    noise = torch.Generator().manual_seed(2 + rank)
    losses = []
    for _ in range(steps):
        x = samples[mine]
        view1 = x + 0.3 * torch.randn(x.shape, generator=noise)  # two augmentations
        view2 = x + 0.3 * torch.randn(x.shape, generator=noise)
        loss = criterion(model(view1), model(view2))
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    return losses


def main(world_size: int = 2, batch: int = 64, steps: int = 30) -> list[list[float]]:
    per_rank = run_on_ranks(train, world_size, args=(batch, steps), timeout=300)
    print(f"NT-Xent loss on {world_size} ranks: {per_rank[0][0]:.4f} -> {per_rank[0][-1]:.4f}")
    return per_rank


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--world-size", type=int, default=2)
    main(parser.parse_args().world_size)
