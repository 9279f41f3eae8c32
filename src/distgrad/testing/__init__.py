"""Tools to test distributed code: start local ranks, compare with single-process truth."""

from __future__ import annotations

from distgrad.testing.launch import run_on_ranks

__all__ = ["run_on_ranks"]
