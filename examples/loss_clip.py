"""CLIP on N local CPU processes: two small encoders under DDP, dg.losses.CLIPLoss over the
global batch with a learnable logit scale, and the memory-efficient ring path.

    python examples/loss_clip.py            # 2 ranks, global batch 64, 30 steps

Every rank prints nothing but rank 0; every rank gets the same (global) loss value.
"""

from __future__ import annotations

import argparse

import torch
from torch import Tensor, nn
from torch.nn.parallel import DistributedDataParallel

import distgrad as dg
from distgrad.testing import run_on_ranks


class TwoTowers(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.image, self.text = nn.Linear(16, 8), nn.Linear(12, 8)

    def forward(self, images: Tensor, texts: Tensor) -> tuple[Tensor, Tensor]:
        return self.image(images), self.text(texts)


def train(rank: int, world_size: int, batch: int, steps: int) -> list[float]:
    torch.manual_seed(0)  # the same initial weights on every rank
    model = DistributedDataParallel(TwoTowers())
    criterion = dg.losses.CLIPLoss(block_size=8)  # outside DDP: its gradient is replicated itself
    optimizer = torch.optim.SGD([*model.parameters(), *criterion.parameters()], lr=0.5)
    gen = torch.Generator().manual_seed(1)  # the same synthetic global batch on every rank
    concepts = torch.randn(batch, 4, generator=gen)
    images = concepts @ torch.randn(4, 16, generator=gen)  # two "modalities" of one concept
    texts = concepts @ torch.randn(4, 12, generator=gen)
    mine = slice(rank * batch // world_size, (rank + 1) * batch // world_size)
    losses = []
    for _ in range(steps):
        loss = criterion(*model(images[mine], texts[mine]))
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    return losses


def main(world_size: int = 2, batch: int = 64, steps: int = 30) -> list[list[float]]:
    per_rank = run_on_ranks(train, world_size, args=(batch, steps), timeout=300)
    print(f"CLIP loss on {world_size} ranks: {per_rank[0][0]:.4f} -> {per_rank[0][-1]:.4f}")
    return per_rank


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--world-size", type=int, default=2)
    main(parser.parse_args().world_size)
