"""examples/parallel_patterns.py runs and its distributed training follows one process.

Semantics asserted: every pattern together in one model, 2 ranks, two SGD steps with the
gradients summed over ranks (the sum contract): each step's global loss and the parameters
after the last step equal the one-process run's to float64 rounding (1e-12; measured
2e-16), and the checker agrees on the first batch.
"""

from __future__ import annotations

import importlib
import sys
from pathlib import Path

import pytest

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


def test_the_example_trains_like_one_process(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.syspath_prepend(str(EXAMPLES))  # the ranks inherit sys.path, so they can import it
    module = importlib.import_module("parallel_patterns")
    try:
        agree, one, many, distance = module.main(world_size=2, steps=2)
    finally:
        sys.modules.pop("parallel_patterns", None)
    assert agree
    assert one == pytest.approx(many, rel=0, abs=1e-12)
    assert distance < 1e-12
