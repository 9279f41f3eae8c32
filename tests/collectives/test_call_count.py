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
# as measured 2026-11-27 with the lean path (a call whose call shape was checked before reuses
# its checks; a wait makes nothing for a long wait until its first tick expires; no Python
# layer between an exchange's start and its wait on gloo). Before it: 97, 99 and 74.
BUDGET = {"all_gather": 66, "reduce_scatter": 65, "all_reduce": 49}


def _ops(n: int, x: torch.Tensor) -> dict[str, tuple[Callable[[], torch.Tensor], tuple[int, ...]]]:
    rows = x.shape[0]
    return {
        "all_gather": (lambda: dg.all_gather(x, sizes=[rows] * n), (rows * n, x.shape[1])),
        "reduce_scatter": (lambda: dg.reduce_scatter(x), (rows // n, x.shape[1])),
        "all_reduce": (lambda: dg.all_reduce(x), tuple(x.shape)),
    }


def _count_into(calls: collections.Counter[str], frame: FrameType, event: str, _: object) -> None:
    if event == "call" and frame.f_code.co_filename.startswith(PACKAGE):
        calls[f"{os.path.basename(frame.f_code.co_filename)}:{frame.f_code.co_name}"] += 1


def _count(rank: int, n: int) -> dict[str, Any]:
    for _ in range(CHECKED_CALLS):  # past the calls checked across ranks
        dg.all_reduce(torch.zeros(1))
    x = torch.randn(64, 128, requires_grad=True)
    found: dict[str, Any] = {}
    for name, (call, out_shape) in _ops(n, x).items():
        v = torch.ones(out_shape)
        for _ in range(3):  # warm: lazily made state is made
            torch.autograd.backward(call(), v)
        calls: collections.Counter[str] = collections.Counter()
        sys.setprofile(functools.partial(_count_into, calls))
        try:
            out = call()
            torch.autograd.backward(out, v)
        finally:
            sys.setprofile(None)
        found[name] = (sum(calls.values()), calls.most_common())
    return found


@pytest.mark.parametrize("op", sorted(BUDGET))
def test_a_forward_and_backward_makes_no_more_python_calls_than_its_budget(op: str) -> None:
    results = run_on_ranks(_count, 2)
    for rank, found in enumerate(results):
        total, calls = found[op]
        assert total <= BUDGET[op], (
            f"rank {rank}: {op} forward+backward made {total} of distgrad's Python calls, "
            f"its budget is {BUDGET[op]}: {calls}"
        )
