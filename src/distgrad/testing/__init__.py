"""Tools to test distributed code: start local ranks, compare with single-process truth (a
loss: check_against_single_process; a parallelized model's training step: check_parallel_model)."""

from __future__ import annotations

from distgrad.testing._report import GradReport, TensorCheck
from distgrad.testing.gradcheck import check_against_single_process
from distgrad.testing.launch import run_on_ranks
from distgrad.testing.model_check import ModelReport, ParameterCheck, check_parallel_model

__all__ = [
    "GradReport",
    "ModelReport",
    "ParameterCheck",
    "TensorCheck",
    "check_against_single_process",
    "check_parallel_model",
    "run_on_ranks",
]
