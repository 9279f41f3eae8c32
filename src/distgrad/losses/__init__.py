"""Losses over the global batch whose distributed gradients equal single-process gradients."""

from __future__ import annotations

__all__: list[str] = []
