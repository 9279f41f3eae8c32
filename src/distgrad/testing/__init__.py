"""Tools to test distributed code: start local ranks, compare with single-process truth (a
loss: check_against_single_process; a parallelized model's training step:
check_parallel_model; a model split into pipeline stages: check_pipeline)."""

from __future__ import annotations

from distgrad.testing._report import GradReport, PipelineReport, TensorCheck
from distgrad.testing.gradcheck import check_against_single_process
from distgrad.testing.launch import run_on_ranks
from distgrad.testing.model_check import ModelReport, ParameterCheck, check_parallel_model
from distgrad.testing.pipeline_check import Microbatches, PipelineProgram, check_pipeline

__all__ = [
    "GradReport",
    "Microbatches",
    "ModelReport",
    "ParameterCheck",
    "PipelineProgram",
    "PipelineReport",
    "TensorCheck",
    "check_against_single_process",
    "check_parallel_model",
    "check_pipeline",
    "run_on_ranks",
]
