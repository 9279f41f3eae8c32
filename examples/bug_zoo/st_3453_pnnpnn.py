"""sentence-transformers PR #3453: gathered columns laid out P N N | P N N, so anchors train
toward their hard negatives.

Thread: github.com/huggingface/sentence-transformers/pull/3453 (docs/losses.md, "Hard
negatives"). Each rank's positives and hard negatives were gathered as one block, giving the
columns ``P N N | P N N | ...`` per rank, while the labels (``arange + rank * B_l``) were
written for ``P P ... | N N ...``: every anchor of rank 1 points at a column in rank 0's
block, one of its hard negatives. The loss runs and goes down; on data with hard negatives
the forward already differs from one process (here a column layout; a gradient check
cannot say more once the forward is wrong).

The checker: "the forward pass already differs: the ranks' losses [...] fit no convention".
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor

import distgrad as dg


def loss(query: Tensor, positive: Tensor, negative: Tensor) -> Tensor:
    rank = dist.get_rank() if dist.is_initialized() else 0
    candidates = dg.all_gather(torch.cat([positive, negative]))  # the bug: P N | P N
    labels = torch.arange(query.shape[0]) + rank * query.shape[0]  # written for P P | N N
    logits = 20.0 * F.normalize(query, dim=1) @ F.normalize(candidates, dim=1).T
    return F.cross_entropy(logits, labels)


def make_inputs() -> dict[str, Tensor]:
    gen = torch.Generator().manual_seed(3)
    base = torch.randn(8, 4, dtype=torch.float64, generator=gen)

    def near() -> Tensor:
        return base + 0.3 * torch.randn(8, 4, dtype=torch.float64, generator=gen)

    return {"query": near(), "positive": near(), "negative": base + 0.8 * near()}


def check(world_size: int = 2) -> dg.testing.GradReport:
    return dg.testing.check_against_single_process(loss, make_inputs(), world_size=world_size)


if __name__ == "__main__":
    print(check())
