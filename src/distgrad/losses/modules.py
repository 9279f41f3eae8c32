"""The losses as ``nn.Module``s that own their learnable scalars.

Each module keeps its scalars in log space where they must stay positive (temperature, logit
scale) and calls the functional loss. Its parameters get the **single-process gradient on
every rank**, whether or not the module sits inside DistributedDataParallel: the forward passes
each parameter through :func:`_replicated`, whose backward averages the ranks' gradients (one
scalar all_reduce). Inside DDP, averaging equal gradients changes nothing; outside DDP (a loss
module built next to the DDP model, its parameters in the same optimizer) the ranks still take
identical steps. Cost: one scalar all_reduce per parameter, forward and backward.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor, nn

from distgrad._group import ProcessGroup
from distgrad.collectives.all_reduce import all_reduce
from distgrad.losses.barlow_twins import barlow_twins
from distgrad.losses.contrastive import clip_loss, info_nce, nt_xent, siglip_loss

__all__ = ["BarlowTwinsLoss", "CLIPLoss", "InfoNCELoss", "NTXentLoss", "SigLIPLoss"]


def _replicated(p: Tensor, group: ProcessGroup | None) -> Tensor:
    """``p`` (the same on every rank); its gradient becomes the average over ranks."""
    averaged = all_reduce(p, "avg", group)
    return averaged + (p - averaged).detach()


def _log_parameter(value: float, name: str) -> nn.Parameter:
    if not (math.isfinite(value) and value > 0):
        raise ValueError(f"{name} must be finite and positive, got {value}")
    return nn.Parameter(torch.tensor(math.log(value)))


class _Temperature(nn.Module):
    def __init__(
        self,
        temperature: float,
        learnable: bool,
        group: ProcessGroup | None,
        block_size: int | None,
    ) -> None:
        super().__init__()
        self.group, self.block_size = group, block_size
        self.log_temperature = _log_parameter(temperature, "temperature")
        self.log_temperature.requires_grad_(learnable)

    def temperature(self) -> Tensor:
        return _replicated(self.log_temperature, self.group).exp()


class NTXentLoss(_Temperature):
    """:func:`~distgrad.losses.nt_xent` with a temperature (learnable with ``learnable=True``,
    stored as its log)."""

    def __init__(
        self,
        temperature: float = 0.5,
        *,
        learnable: bool = False,
        group: ProcessGroup | None = None,
        block_size: int | None = None,
    ) -> None:
        super().__init__(temperature, learnable, group, block_size)

    def forward(self, view1: Tensor, view2: Tensor) -> Tensor:
        t = self.temperature()
        return nt_xent(view1, view2, temperature=t, group=self.group, block_size=self.block_size)


class InfoNCELoss(_Temperature):
    """:func:`~distgrad.losses.info_nce` with a temperature (learnable with ``learnable=True``,
    stored as its log)."""

    def __init__(
        self,
        temperature: float = 0.1,
        *,
        learnable: bool = False,
        group: ProcessGroup | None = None,
        block_size: int | None = None,
    ) -> None:
        super().__init__(temperature, learnable, group, block_size)

    def forward(self, query: Tensor, key: Tensor) -> Tensor:
        t = self.temperature()
        return info_nce(query, key, temperature=t, group=self.group, block_size=self.block_size)


class CLIPLoss(nn.Module):
    """:func:`~distgrad.losses.clip_loss` with CLIP's learnable logit scale, stored as its log
    (initialised to ``log(1/0.07)``) and clamped at ``max_logit_scale`` (100, as in CLIP)."""

    def __init__(
        self,
        logit_scale: float = 1 / 0.07,
        *,
        max_logit_scale: float = 100.0,
        group: ProcessGroup | None = None,
        block_size: int | None = None,
    ) -> None:
        super().__init__()
        self.group, self.block_size = group, block_size
        self.max_logit_scale = max_logit_scale
        self.log_logit_scale = _log_parameter(logit_scale, "logit_scale")

    def forward(self, image: Tensor, text: Tensor) -> Tensor:
        scale = _replicated(self.log_logit_scale, self.group).exp().clamp(max=self.max_logit_scale)
        return clip_loss(
            image, text, logit_scale=scale, group=self.group, block_size=self.block_size
        )


class SigLIPLoss(nn.Module):
    """:func:`~distgrad.losses.siglip_loss` with SigLIP's learnable scale (stored as its log,
    initialised to 10) and bias (initialised to -10)."""

    def __init__(
        self,
        scale: float = 10.0,
        bias: float = -10.0,
        *,
        group: ProcessGroup | None = None,
        block_size: int | None = None,
    ) -> None:
        super().__init__()
        self.group, self.block_size = group, block_size
        self.log_scale = _log_parameter(scale, "scale")
        self.bias = nn.Parameter(torch.tensor(float(bias)))

    def forward(self, image: Tensor, text: Tensor) -> Tensor:
        scale = _replicated(self.log_scale, self.group).exp()
        bias = _replicated(self.bias, self.group)
        return siglip_loss(
            image, text, scale=scale, bias=bias, group=self.group, block_size=self.block_size
        )


class BarlowTwinsLoss(nn.Module):
    """:func:`~distgrad.losses.barlow_twins` as a module (no learnable state)."""

    def __init__(
        self, lambda_offdiag: float = 5e-3, *, eps: float = 1e-5, group: ProcessGroup | None = None
    ) -> None:
        super().__init__()
        self.lambda_offdiag, self.eps, self.group = lambda_offdiag, eps, group

    def forward(self, view1: Tensor, view2: Tensor) -> Tensor:
        return barlow_twins(
            view1, view2, lambda_offdiag=self.lambda_offdiag, eps=self.eps, group=self.group
        )
