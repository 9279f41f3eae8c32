"""The diagnosis engine both checkers share (distgrad.testing._diagnose), on hand-made rows:
no process starts, each case runs in milliseconds.

Semantics asserted: for two ranks whose truths are fixed float64 tensors, each planted
pattern of distributed values gets its finding, first match wins in the documented order
(non-finite, forward differs, agree, unreduced over a mesh dim, scaled by a group size or one
factor, no gradient, misrouted, rank-dependent, local-only, no factor); a non-finite value
names each place once; and check_parallel_model's words for the findings its two-rank tests
never produce (non-finite values, a replica with no gradient).
"""

from __future__ import annotations

import math
from collections.abc import Callable

import pytest
import torch
from torch import Tensor

from distgrad.testing._diagnose import (
    Finding,
    Misrouted,
    NoGradient,
    NonFinite,
    RankDependent,
    Row,
    Scaled,
    Tolerance,
    Unreduced,
    compare,
    diagnose,
)
from distgrad.testing._report import parameter_words

TOL = Tolerance(1e-7, 1e-10)
WANT = [
    torch.tensor([1.0, -2.0, 0.5], dtype=torch.float64),
    torch.tensor([3.0, 0.25, -1.0], dtype=torch.float64),
]


def _rows(*got: Tensor) -> list[Row]:
    """Rank r holds ``got[r]`` where the truth is ``WANT[r]``."""
    return [compare("x", (r,), g, WANT[r], TOL) for r, g in enumerate(got)]


def _finding(*got: Tensor, crossed: Callable[[], bool] | None = None) -> Finding:
    return diagnose(_rows(*got), TOL, sizes={"ranks": 2}, crossed=crossed)


def test_each_planted_pattern_gets_its_finding() -> None:
    a, b = WANT
    assert _finding(a, b) == "agree"
    half = _finding(a / 2, b / 2)
    assert isinstance(half, Scaled) and (half.factor, half.size) == (0.5, 2)
    twice = _finding(2 * a, 2 * b)
    assert isinstance(twice, Scaled) and (twice.factor, twice.size) == (2.0, 2)
    other = _finding(1.5 * a, 1.5 * b)
    assert isinstance(other, Scaled) and other.size is None
    assert other.factor == pytest.approx(1.5, rel=1e-12)
    cut = _finding(a, torch.zeros(3, dtype=torch.float64))
    assert isinstance(cut, NoGradient) and cut.row.place == (1,)
    moved = _finding(b, a)
    assert isinstance(moved, Misrouted) and [(r.place, p) for r, p in moved.moves] == [
        ((0,), (1,)),
        ((1,), (0,)),
    ]
    assert _finding(a, 3 * b) == RankDependent([(0,)], [(1,)])
    assert _finding(2 * a, 3 * b) == "no factor"
    assert _finding(2 * a, 3 * b, crossed=lambda: False) == "local-only"
    assert _finding(2 * a, 3 * b, crossed=lambda: True) == "no factor"


def test_the_first_finding_in_the_order_wins() -> None:
    """Non-finite before everything; the forward before the gradients; a factor is asked only
    when no rank agrees (one rank right and one doubled is rank-dependent, not scaled)."""
    a, b = WANT
    nan = torch.full((3,), math.nan, dtype=torch.float64)
    rows = [*_rows(nan, b / 2), compare("y", (0,), nan, a, TOL)]
    assert diagnose(rows, TOL, sizes={"ranks": 2}) == NonFinite([(0,)])  # rank 0 once
    assert diagnose(_rows(a, b), TOL, sizes={"ranks": 2}, losses=(1.0, [math.nan, 1.0])) == (
        NonFinite([])
    )
    losses = (1.0, [0.3, 0.4])  # neither each 1 nor adding up to 1 or 2
    assert diagnose(_rows(a / 2, b / 2), TOL, sizes={"ranks": 2}, losses=losses) == (
        "forward differs"
    )
    assert isinstance(_finding(a, 2 * b), RankDependent)


def test_replicas_that_differ_along_a_mesh_dim_are_missing_its_reduction() -> None:
    """Two replicas along "tp" holding parts whose sum (or mean) is the truth."""
    want, part = WANT[0], torch.tensor([0.25, 4.0, -3.0], dtype=torch.float64)
    for got, how in (((part, want - part), "sum"), ((part, 2 * want - part), "mean")):
        rows = [compare("w", (r,), g, want, TOL) for r, g in enumerate(got)]
        finding = diagnose(rows, TOL, sizes={"tp": 2}, replica_dims=[("tp", 2)])
        assert finding == Unreduced("tp", 2, how)
        assert parameter_words(finding, rows, TOL).startswith(
            "missing a reduction over mesh dim 'tp'" if how == "sum" else "missing an average"
        )


def test_the_model_checker_words_what_its_tests_never_plant() -> None:
    want = WANT[0]
    nan = torch.full((3,), math.nan, dtype=torch.float64)
    rows = [compare("w", (r,), g, want, TOL) for r, g in enumerate((want, nan))]
    words = parameter_words(diagnose(rows, TOL, sizes={"dp": 2}), rows, TOL)
    assert words == (
        "non-finite values (NaN or Inf) on some ranks while the single-process value is finite"
    )
    three = [compare("w", (r,), g, want, TOL) for r, g in enumerate((want, want, 0 * want))]
    finding = diagnose(three, TOL, sizes={"dp": 3}, replica_dims=[("dp", 3)])
    assert isinstance(finding, NoGradient)
    assert parameter_words(finding, three, TOL) == "no gradient on some ranks or in one process"
