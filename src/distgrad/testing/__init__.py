"""Tools to test distributed code: start local ranks, compare with single-process truth."""

from __future__ import annotations

from distgrad.testing._report import GradReport, TensorCheck
from distgrad.testing.gradcheck import check_against_single_process
from distgrad.testing.launch import run_on_ranks

__all__ = ["GradReport", "TensorCheck", "check_against_single_process", "run_on_ranks"]
