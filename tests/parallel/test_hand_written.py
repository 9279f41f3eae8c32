"""The hand-written versions docs/patterns.md describes, each with the mistake such code
typically makes, and what the checker says about them.

Semantics asserted: the same check that passes for distgrad.parallel (each rank returns its
share of the loss; gradients summed over ranks) fails for each copy, and the diagnosis names
the cause docs/patterns.md quotes: a backward that misses the terms flowing through other
ranks (a gather that keeps its own rows; keys and values received with raw point-to-point
calls), or a forward that already differs (a per-rank capacity rule; per-rank statistics
averaged with equal weights over uneven batches).
"""

from __future__ import annotations

import pytest
import torch

from distgrad.testing import check_against_single_process
from tests._support import leaf
from tests.parallel import patterns as pt

DT = torch.float64
MISSES = "misses the terms that flow through other ranks"
DIFFERS = "the forward pass already differs"


def _randn(*shape: int, seed: int) -> torch.Tensor:
    return leaf(seed, *shape, requires_grad=False)  # float64, as DT


def _rows(n: int, width: int = pt.D_MODEL) -> dict[str, torch.Tensor]:
    return {"x": _randn(n, width, seed=1), "v": _randn(n, width, seed=2)}


CASES = {
    "sequence-parallel gather keeping its own rows": (
        pt.hand_tp_loss,
        _rows(8),
        {"model": pt.MLP},
        MISSES,
    ),
    "MoE capacity applied per rank": (pt.hand_moe_loss, _rows(12), {"model": pt.MoE}, DIFFERS),
    "ring attention with raw point-to-point": (
        pt.hand_ring_loss,
        {n: _randn(2, 2, 8, 3, seed=i) for i, n in enumerate(("q", "k", "v", "cot"))},
        {"shard_dim": 2},
        MISSES,
    ),
    "batch norm averaging per-rank statistics": (
        pt.hand_bn_loss,
        {
            "image": _randn(8, 3, 2, 2, seed=1),
            "flat": _randn(8, 4, seed=2),
            "v": _randn(8, 4, seed=3),
        },
        {"model": pt.Norms, "shard_sizes": [5, 3]},
        DIFFERS,
    ),
}


@pytest.mark.parametrize("case", list(CASES))
def test_the_checker_diagnoses_each_hand_written_mistake(case: str) -> None:
    fn, inputs, options, diagnosis = CASES[case]
    report = check_against_single_process(
        fn,
        inputs,
        world_size=2,
        gradients="summed",
        **options,  # type: ignore[arg-type]
    )
    assert not report.ok, f"{case}: the hand-written copy passed:\n{report}"
    assert any(diagnosis in d for d in report.diagnoses), f"{case}:\n{report}"
