"""Each loss as a function of (model, *shards) for the checker; the model holds the learnable
parameters (module level, so everything pickles)."""

from __future__ import annotations

import torch
from torch import Tensor, nn

import distgrad as dg


class Learnable(nn.Module):
    """An encoder and the losses' learnable scalars: a log-temperature, a log-scale, a bias."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.encoder = nn.Linear(5, 4).double()
        self.log_t = nn.Parameter(torch.tensor(-1.0, dtype=torch.float64))
        self.log_scale = nn.Parameter(torch.tensor(2.0, dtype=torch.float64))
        self.bias = nn.Parameter(torch.tensor(-3.0, dtype=torch.float64))

    def forward(self, a: Tensor, b: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """Both views' embeddings and the temperature (what DDP wraps)."""
        return self.encoder(a), self.encoder(b), self.log_t.exp()


def nt_xent(m: Learnable, a: Tensor, b: Tensor, block_size: int | str | None = None) -> Tensor:
    return dg.losses.nt_xent(
        m.encoder(a), m.encoder(b), temperature=m.log_t.exp(), block_size=block_size
    )


def info_nce(m: Learnable, a: Tensor, b: Tensor, block_size: int | str | None = None) -> Tensor:
    return dg.losses.info_nce(
        m.encoder(a), m.encoder(b), temperature=m.log_t.exp(), block_size=block_size
    )


def clip_loss(m: Learnable, a: Tensor, b: Tensor, block_size: int | str | None = None) -> Tensor:
    return dg.losses.clip_loss(m.encoder(a), m.encoder(b), m.log_scale.exp(), block_size=block_size)


def siglip_loss(m: Learnable, a: Tensor, b: Tensor, block_size: int | str | None = None) -> Tensor:
    return dg.losses.siglip_loss(
        m.encoder(a), m.encoder(b), m.log_scale.exp(), m.bias, block_size=block_size
    )


def barlow_twins(m: Learnable, a: Tensor, b: Tensor) -> Tensor:
    return dg.losses.barlow_twins(m.encoder(a), m.encoder(b), lambda_offdiag=0.1)


ALL = [nt_xent, info_nce, clip_loss, siglip_loss, barlow_twins]
