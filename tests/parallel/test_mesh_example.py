"""examples/mesh_2d.py: a 2x2 DeviceMesh (dp=2 x tp=2) on 4 ranks trains like one process.

Semantics asserted: FSDP2 over "dp", dg.parallel's column and row linears over "tp"
(replicated contract), clip_loss over "dp": three SGD steps, every parameter's gradient and
its update and value after each step equal one float64 process on the whole batch
(check_parallel_model's float64 tolerances, rtol 1e-7 and atol 1e-10; measured below 1e-15),
and every rank's loss equals the single-process loss at every step.
"""

from __future__ import annotations

import importlib
import sys
from pathlib import Path

import pytest

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


def test_the_2d_mesh_example_trains_like_one_process(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.syspath_prepend(str(EXAMPLES))  # the ranks inherit sys.path, so they can import it
    module = importlib.import_module("mesh_2d")
    try:
        report = module.check(steps=3)
    finally:
        sys.modules.pop("mesh_2d", None)
    assert report.ok, str(report)
    assert {c.name for c in report.checks} == {"fc1.weight", "fc1.bias", "fc2.weight", "fc2.bias"}
    assert len(report.checks) == 3 * 4 * 2  # steps x parameters x (gradient, update)
    for want, got in zip(report.reference_losses, report.rank_losses, strict=True):
        assert got == pytest.approx([want] * 4, rel=1e-12)
