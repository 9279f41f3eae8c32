"""Property-based: random ops, shapes, uneven sizes, dims, reduce ops and world sizes.

Semantics asserted are those of test_gradients.py: forward equals the single-process reference
and each rank's gradient equals single-process autograd of sum_r <out_r, v_r> (random cotangent
per rank, float64, rtol 1e-10).

Design: hypothesis runs *inside* every rank, one process group per world size. Starting a group
costs about 0.1 s plus re-importing this module in each rank, so one group per example (or per
batch) spent most of the time starting processes. In-rank runs are sound because every rank
draws the same examples in the same order: ``derandomize=True`` seeds hypothesis from the test
function alone, there is no example database, and no timing-dependent health check or deadline
may change the course. After each example the ranks all_reduce a failure flag (a raw collective,
outside the code under test) and all raise or all pass, so hypothesis sees the same outcomes on
every rank and, if something fails, shrinks in lockstep, which keeps the collectives paired
(checked by breaking max: both ranks shrink to the same one-case reduce_scatter). There is one
search per op and reduce op, since derandomized hypothesis favours some choices over others.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

import distgrad as dg
from distgrad.testing import run_on_ranks
from tests._support import FLOAT64
from tests.collectives.reference import (
    OPS,
    Case,
    call_args,
    cotangents,
    inputs,
    outputs,
    reference_grads,
    warm_up,
)

# Examples per search and world size; each example is a list of 1 to 4 cases.
EXAMPLES = {1: 3, 2: 5, 3: 4, 4: 3}
# One search per op (and reduce op): derandomized hypothesis favours some choices over others,
# and separate searches give every op and reduce op its share.
SEARCHES = [
    *((kind, None) for kind in ("all_gather", "gather", "all_to_all", "scatter", "broadcast")),
    ("permute", None),
    *((kind, op) for kind in ("reduce_scatter", "all_reduce", "reduce") for op in OPS),
]


@st.composite
def collective_cases(
    draw: Any, n: int, kind: str | None = None, op: str | None = None
) -> tuple[int, Case]:
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

    kind = kind or draw(st.sampled_from([k for k, _ in SEARCHES]))
    op = op or draw(st.sampled_from(OPS))
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


def _check(rank: int, n: int, case: Case, known: bool) -> None:
    """Like test_gradients.check_case, but every rank runs forward *and* backward before any
    assertion, so a rank whose forward is wrong still takes part in the backward collective and
    the ranks stay in lockstep. ``known``: pass every size (no metadata exchanged)."""
    xs = inputs(case, torch.float64)
    expected = outputs(case, xs)
    vs = cotangents(expected)
    x = xs[rank].clone().requires_grad_()
    passes_none = case.op == "scatter" and rank != case.kwargs["src"]
    arg, kwargs = call_args(case, rank, [x if r == rank else t for r, t in enumerate(xs)], known)
    out = getattr(dg, case.op)(arg, **kwargs)
    (out * vs[rank]).sum().backward()
    tol = FLOAT64
    torch.testing.assert_close(out, expected[rank], **tol, msg=lambda m: f"forward: {m}")
    if not passes_none:
        got = x.grad if x.grad is not None else torch.zeros_like(x)
        want = reference_grads(case, xs, vs)[rank]
        torch.testing.assert_close(got, want, **tol, msg=lambda m: f"gradient: {m}")


def _run_hypothesis_in_every_rank(rank: int, n: int, max_examples: int) -> list[str]:
    warm_up()  # past the calls checked across ranks, as in a long training run
    drawn: list[str] = []
    for kind, op in SEARCHES:
        _search(rank, n, kind, op, max_examples, drawn)
    return drawn


def _search(
    rank: int, n: int, kind: str, op: str | None, max_examples: int, drawn: list[str]
) -> None:
    @settings(
        max_examples=max_examples,
        deadline=None,
        derandomize=True,
        database=None,
        phases=(Phase.generate, Phase.shrink),
        suppress_health_check=list(HealthCheck),
        print_blob=False,
    )
    # A short list of cases per example: hypothesis's derandomized search repeats itself, and a
    # list spreads the examples over more ops; a failing list shrinks to the one failing case.
    @given(
        st.lists(collective_cases(n, kind, op).map(lambda pair: pair[1]), min_size=1, max_size=4)
    )
    def check(cases: list[Case]) -> None:
        for case in cases:
            drawn.append(repr(case))
            error = None
            try:
                # every other case with all sizes given: the same list on every rank
                _check(rank, n, case, known=len(drawn) % 2 == 0)
            except Exception as exc:  # every failure, so that all ranks learn of it
                error = f"{type(exc).__name__}: {exc}"
            failed = torch.tensor([float(error is not None)])
            dist.all_reduce(failed)  # raw: the ranks agree on the outcome before hypothesis does
            if failed.item():
                count = int(failed.item())
                raise AssertionError(f"{case} fails on {count} rank(s); here: {error}")

    check()


@pytest.mark.parametrize(  # 3 and 4 ranks (3 s each) in the slow tier, which CI runs
    "world_size",
    [w if w < 3 else pytest.param(w, marks=pytest.mark.slow) for w in sorted(EXAMPLES)],
)
def test_random_collectives_match_single_process_autograd(world_size: int) -> None:
    drawn = run_on_ranks(
        _run_hypothesis_in_every_rank, world_size, args=(EXAMPLES[world_size],), timeout=60
    )
    # Every rank ran the same examples, in the same order, and as many as asked.
    assert all(d == drawn[0] for d in drawn), "ranks drew different examples"
    assert len(drawn[0]) >= len(SEARCHES) * EXAMPLES[world_size]
