"""Differentiable collectives: each returns a new tensor and has an exact, documented adjoint."""

from __future__ import annotations

from distgrad.collectives.all_gather import all_gather, reduce_scatter
from distgrad.collectives.all_reduce import all_reduce
from distgrad.collectives.all_to_all import all_to_all
from distgrad.collectives.broadcast import broadcast, reduce
from distgrad.collectives.gather import gather, scatter
from distgrad.collectives.permute import permute

__all__ = [
    "all_gather",
    "all_reduce",
    "all_to_all",
    "broadcast",
    "gather",
    "permute",
    "reduce",
    "reduce_scatter",
    "scatter",
]
