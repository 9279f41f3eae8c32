"""Functions for `distgrad check` to fail on, each wrong in one way (loaded by file path)."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import Tensor

import distgrad as dg


def make_inputs() -> dict[str, Tensor]:
    gen = torch.Generator().manual_seed(0)
    return {"x": torch.randn(6, 3, dtype=torch.float64, generator=gen)}


def wrong_names() -> dict[str, Tensor]:
    """A dict whose key is no parameter of global_loss(x)."""
    return {"y": torch.ones(4, 3, dtype=torch.float64)}


def not_tensors() -> list[int]:
    return [1, 2]


def global_loss(x: Tensor) -> Tensor:
    """Right on any shards: every rank computes the loss of the whole gathered batch."""
    return (dg.all_gather(x) ** 2).sum()


def returns_a_matrix(x: Tensor) -> Tensor:
    return x


def raises(x: Tensor) -> Tensor:
    raise RuntimeError("a bug in the user's loss")


def raises_on_rank_1(x: Tensor) -> Tensor:
    if dist.is_initialized() and dist.get_rank() == 1:
        raise RuntimeError("a bug on rank 1")
    return global_loss(x)


def unguarded_world_size(x: Tensor) -> Tensor:
    """dist.get_world_size() with no process group: fails in the single-process run."""
    return global_loss(x) / dist.get_world_size()
