"""Property-based: random ops, shapes, uneven sizes, dims and world sizes.

Hypothesis draws a batch of cases in the parent; one group of real processes runs them and
compares forward and gradient with the single-process reference (same semantics and tolerance
as test_gradients.py: sum over ranks of <out_r, v_r>, random cotangents, float64). The draws
are derandomized so a failure reproduces; hypothesis shrinks a failing batch to a minimal one.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from distgrad.testing import run_on_ranks
from tests.collectives.reference import Case
from tests.collectives.test_gradients import OPS, check_case


@st.composite
def collective_cases(draw: Any, n: int) -> tuple[int, Case]:
    ndim = draw(st.integers(1, 3))
    dim = draw(st.integers(-ndim, ndim - 1))
    base = [draw(st.integers(1, 3)) for _ in range(ndim)]
    sizes = [draw(st.integers(0, 3)) for _ in range(n)]
    if sum(sizes) == 0:
        sizes[0] = 1

    def with_dim(length: int) -> tuple[int, ...]:
        shape = list(base)
        shape[dim] = length
        return tuple(shape)

    kind = draw(
        st.sampled_from(
            [
                "all_gather",
                "gather",
                "reduce_scatter",
                "all_reduce",
                "all_to_all",
                "scatter",
                "broadcast",
                "reduce",
                "permute",
            ]
        )
    )
    op = draw(st.sampled_from(OPS))
    root = draw(st.integers(0, n - 1))
    if kind in ("all_gather", "gather"):
        kwargs: dict[str, Any] = {"dim": dim} | ({"dst": root} if kind == "gather" else {})
        return n, Case(kind, tuple(with_dim(s) for s in sizes), kwargs)
    if kind == "reduce_scatter":
        return n, Case(kind, (with_dim(sum(sizes)),) * n, {"op": op, "dim": dim, "sizes": sizes})
    if kind == "scatter":
        return n, Case(kind, (with_dim(sum(sizes)),) * n, {"src": root, "dim": dim, "sizes": sizes})
    if kind == "all_to_all":
        splits = [[draw(st.integers(0, 2)) for _ in range(n)] for _ in range(n)]
        shapes = tuple(with_dim(sum(s)) for s in splits)
        return n, Case(kind, shapes, {"dim": dim}, tuple({"input_sizes": s} for s in splits))
    if kind == "permute":
        perm = draw(st.permutations(list(range(n))))
        return n, Case(kind, tuple(with_dim(s) for s in sizes), {"perm": list(perm)})
    shapes = (tuple(base),) * n
    if kind == "all_reduce":
        return n, Case(kind, shapes, {"op": op})
    if kind == "reduce":
        return n, Case(kind, shapes, {"op": op, "dst": root})
    return n, Case(kind, shapes, {"src": root})


def _run_cases(rank: int, n: int, cases: list[Case]) -> None:
    for case in cases:
        check_case(rank, n, case, torch.float64)


def _batches(n: int) -> Any:
    return st.lists(collective_cases(n).map(lambda drawn: drawn[1]), min_size=1, max_size=8)


@pytest.mark.parametrize("world_size", [1, 2, 3])
def test_random_collectives_match_single_process_autograd(world_size: int) -> None:
    # A batch of cases per process group: a warm start is cheap, but each start re-imports
    # this module in the new ranks, so one group runs several cases.
    @settings(
        max_examples=8,
        deadline=None,
        derandomize=True,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
    )
    @given(_batches(world_size))
    def check(cases: list[Case]) -> None:
        run_on_ranks(_run_cases, world_size, args=(cases,), timeout=30)

    check()
