"""A loss to try `distgrad check` on: InfoNCE over keys gathered from every rank.

    distgrad check examples/check_info_nce.py:info_nce --world-size 2      # agrees: exit 0
    distgrad check examples/check_info_nce.py:info_nce_naive --world-size 2  # mismatch: exit 1

`distgrad check` calls make_inputs() for the global batch (split along dim 0 over the ranks)
and make_model() for the model (every rank gets the same parameters), then runs the loss on one
process and on N processes and compares the gradients.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor, nn

import distgrad as dg
from distgrad._demo.naive import LocalOnlyGather


def make_inputs() -> dict[str, Tensor]:
    gen = torch.Generator().manual_seed(0)
    return {
        "images": torch.randn(8, 6, dtype=torch.float64, generator=gen),
        "texts": torch.randn(8, 6, dtype=torch.float64, generator=gen),
    }


def make_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Linear(6, 4).double()


def _loss(queries: Tensor, keys: Tensor) -> Tensor:
    rank = dist.get_rank() if dist.is_initialized() else 0
    labels = torch.arange(len(queries)) + rank * len(queries)  # even shards
    return F.cross_entropy(F.normalize(queries, dim=1) @ F.normalize(keys, dim=1).T, labels)


def info_nce(model: nn.Module, images: Tensor, texts: Tensor) -> Tensor:
    return _loss(model(images), dg.all_gather(model(texts)))


def info_nce_naive(model: nn.Module, images: Tensor, texts: Tensor) -> Tensor:
    return _loss(model(images), LocalOnlyGather.apply(model(texts)))
