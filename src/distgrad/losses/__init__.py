"""Losses over the global batch whose distributed gradients equal single-process gradients.

Every loss returns the global mean loss on every rank, and gradients such that
DistributedDataParallel's averaging gives exactly the gradient of one process on the whole
batch (docs/losses.md). ``block_size=`` selects the memory-efficient ring path of the
gather-based losses; the modules own the learnable temperature, logit scale and bias.
"""

from __future__ import annotations

from distgrad.losses._blockwise import set_kernels
from distgrad.losses.barlow_twins import barlow_twins
from distgrad.losses.contrastive import clip_loss, info_nce, nt_xent, siglip_loss
from distgrad.losses.modules import BarlowTwinsLoss, CLIPLoss, InfoNCELoss, NTXentLoss, SigLIPLoss

__all__ = [
    "BarlowTwinsLoss",
    "CLIPLoss",
    "InfoNCELoss",
    "NTXentLoss",
    "SigLIPLoss",
    "barlow_twins",
    "clip_loss",
    "info_nce",
    "nt_xent",
    "set_kernels",
    "siglip_loss",
]
