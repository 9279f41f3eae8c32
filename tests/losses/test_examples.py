"""Every examples/loss_*.py runs, on 2 ranks with a small batch and few steps.

Semantics asserted: the example trains (the loss after the last step is lower than after the
first) and every rank reports the same loss value at every step (each loss returns the
global-batch value on every rank).
"""

from __future__ import annotations

import importlib
import math
import sys
from pathlib import Path

import pytest

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
NAMES = ["loss_barlow_twins", "loss_clip", "loss_nt_xent", "loss_siglip"]


def test_every_loss_has_an_example() -> None:
    assert sorted(p.stem for p in EXAMPLES.glob("loss_*.py")) == NAMES


@pytest.mark.parametrize("name", NAMES)
def test_example_trains_and_every_rank_reports_the_global_loss(
    name: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.syspath_prepend(str(EXAMPLES))  # the ranks inherit sys.path, so they can import it
    module = importlib.import_module(name)
    try:
        per_rank = module.main(world_size=2, batch=16, steps=8)
    finally:
        sys.modules.pop(name, None)
    first, second = per_rank
    assert all(math.isfinite(x) for x in first)
    assert first == pytest.approx(second, rel=1e-6)
    assert first[-1] < first[0]
