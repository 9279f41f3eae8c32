"""The eager path's Python stays lean: the number of distgrad's own Python function calls in
one forward+backward of the hot ops, past the checked calls, is pinned.

Why a count and not a time: a time is a benchmark (benchmarks/collectives.py measures it
against a hand-written torch Function); a count is exact on every machine, and every call is
0.1-1 us of CPU on the calling thread of every step. Counted: calls into modules of the
distgrad package (torch's own Python is left out: it varies with torch's version). Raise a
budget only with a reason written beside it; lower it when a change trims the path.
"""

from __future__ import annotations

import collections
import functools
import os
import sys
from collections.abc import Callable
from types import FrameType
from typing import Any

import pytest
import torch

import distgrad as dg
from distgrad.collectives._signature import CHECKED_CALLS
from distgrad.testing import run_on_ranks

PACKAGE = os.path.dirname(dg.__file__)

# distgrad's own Python calls per forward+backward on 2 gloo ranks, 32 KB float32, sizes given,
# the more of the two ranks' counts (a rooted op's root and receivers differ), as measured
# 2026-11-29 after each public op put its async choice in its plan (the forward no longer reads
# a thread-local): 1 fewer per op. Before: all_gather 50, reduce_scatter 51, all_reduce 41
# (after an exchange's call drove its steps itself, no ExchangeOp layer: 4 fewer per op); 54,
# 55 and 45 before that (after the lean path kept each call shape's plan, option objects were
# made once and the async flag became a class default); 66, 65 and 49 before those, and 97, 99
# and 74 before the lean path.
BUDGET = {
    "all_gather": 49,
    "reduce_scatter": 50,
    "all_reduce": 40,
    "all_to_all": 47,
    "broadcast": 45,
    "reduce": 46,
    "gather": 56,
    "scatter": 58,
    "permute": 70,
}


def _ops(n: int, rank: int, x: torch.Tensor) -> dict[str, Callable[[], torch.Tensor]]:
    rows = x.shape[0]
    part = x if rank == 0 else x[: rows // n]  # a scatter receiver passes a tensor like its part
    return {
        "all_gather": lambda: dg.all_gather(x, sizes=[rows] * n),
        "reduce_scatter": lambda: dg.reduce_scatter(x),
        "all_reduce": lambda: dg.all_reduce(x),
        "all_to_all": lambda: dg.all_to_all(
            x, input_sizes=[rows // n] * n, output_sizes=[rows // n] * n
        ),
        "broadcast": lambda: dg.broadcast(x, 0),
        "reduce": lambda: dg.reduce(x, 0),
        "gather": lambda: dg.gather(x, 0, sizes=[rows] * n),
        "scatter": lambda: dg.scatter(part, 0, sizes=[rows // n] * n),
        "permute": lambda: dg.permute(x, [(r + 1) % n for r in range(n)], recv_shape=x.shape),
    }


def _count_into(calls: collections.Counter[str], frame: FrameType, event: str, _: object) -> None:
    if event == "call" and frame.f_code.co_filename.startswith(PACKAGE):
        calls[f"{os.path.basename(frame.f_code.co_filename)}:{frame.f_code.co_name}"] += 1


def _count(rank: int, n: int) -> dict[str, Any]:
    for _ in range(CHECKED_CALLS):  # past the calls checked across ranks
        dg.all_reduce(torch.zeros(1))
    x = torch.randn(64, 128, requires_grad=True)
    found: dict[str, Any] = {}
    for name, call in _ops(n, rank, x).items():
        for _ in range(3):  # warm: lazily made state is made
            out = call()
            torch.autograd.backward(out, torch.ones_like(out))
        calls: collections.Counter[str] = collections.Counter()
        sys.setprofile(functools.partial(_count_into, calls))
        try:
            out = call()
            torch.autograd.backward(out, torch.ones_like(out))
        finally:
            sys.setprofile(None)
        found[name] = (sum(calls.values()), calls.most_common())
    return found


@pytest.fixture(scope="module")
def counted() -> list[dict[str, Any]]:
    """Every op's count on each of 2 ranks, from one launch."""
    return run_on_ranks(_count, 2)


@pytest.mark.parametrize("op", sorted(BUDGET))
def test_a_forward_and_backward_makes_no_more_python_calls_than_its_budget(
    op: str, counted: list[dict[str, Any]]
) -> None:
    for rank, found in enumerate(counted):
        total, calls = found[op]
        assert total <= BUDGET[op], (
            f"rank {rank}: {op} forward+backward made {total} of distgrad's Python calls, "
            f"its budget is {BUDGET[op]}: {calls}"
        )
