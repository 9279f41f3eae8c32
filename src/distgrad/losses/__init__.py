"""Losses over the global batch whose distributed gradients equal single-process gradients.

Every loss returns the global mean loss on every rank, and gradients such that
DistributedDataParallel's averaging gives exactly the gradient of one process on the whole
batch (docs/losses.md).
"""

from __future__ import annotations

from distgrad.losses.barlow_twins import barlow_twins
from distgrad.losses.contrastive import clip_loss, info_nce, nt_xent, siglip_loss

__all__ = ["barlow_twins", "clip_loss", "info_nce", "nt_xent", "siglip_loss"]
