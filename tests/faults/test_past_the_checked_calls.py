"""What a mismatch does after the checked calls, in default mode: each row of the table in
docs/semantics.md ("What a mistake does after the checked calls") measured.

Two gloo ranks make 9 matching calls (past the 8 checked ones), then one mismatched call. The
outcome asserted is what the table says happens today: the process of one rank aborted by gloo
(SIGABRT), a silently wrong result, or both ranks timing out with distgrad's account. They are
pinned so that a change of behaviour (for better, with a guard that rides in the data, or for
worse) shows here and the table is updated with it.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

import distgrad as dg
from distgrad.collectives._signature import CHECKED_CALLS
from distgrad.errors import RankFailedError
from distgrad.testing import run_on_ranks

PG_TIMEOUT_S = 2.0

CASES: dict[str, Callable[[int], torch.Tensor | None]] = {
    "reduce_scatter shape": lambda r: dg.reduce_scatter(torch.ones(4, 3 if r == 0 else 5)),
    "reduce_scatter dtype": lambda r: dg.reduce_scatter(
        torch.ones(4, 3, dtype=torch.float32 if r == 0 else torch.float64)
    ),
    "all_to_all shape": lambda r: dg.all_to_all(torch.ones(4, 3 if r == 0 else 5)),
    "broadcast shape": lambda r: dg.broadcast(torch.arange(3.0) if r == 0 else torch.zeros(4), 0),
    "broadcast complex64 vs float64": lambda r: dg.broadcast(
        torch.ones(3, dtype=torch.complex64) if r == 0 else torch.zeros(3, dtype=torch.float64), 0
    ),
    "reduce dtype": lambda r: dg.reduce(
        torch.ones(3, dtype=torch.float32 if r == 0 else torch.float64), 0
    ),
    "gather shape": lambda r: dg.gather(torch.ones(2, 3 if r == 0 else 5), 0, sizes=[2, 2]),
    "permute shape": lambda r: dg.permute(
        torch.ones(3 if r == 0 else 4), [1, 0], recv_shape=[3 if r == 0 else 4]
    ),
    "all_gather dtype": lambda r: dg.all_gather(
        torch.ones(2, 3, dtype=torch.float32 if r == 0 else torch.float64), sizes=[2, 2]
    ),
    "scatter shape": lambda r: dg.scatter(
        torch.ones(4, 3) if r == 0 else torch.zeros(2, 5), 0, sizes=[2, 2]
    ),
    "reduce shape": lambda r: dg.reduce(torch.ones(3 if r == 0 else 4), 0),
    "all_reduce op": lambda r: dg.all_reduce(
        torch.full((3,), float(r + 2)), "sum" if r == 0 else "max"
    ),
    "a different collective": lambda r: (
        dg.all_reduce(torch.ones(3)) if r == 0 else dg.broadcast(torch.ones(3), 0)
    ),
    "a different src": lambda r: dg.broadcast(torch.full((3,), float(r)), r),
}


def _mismatch_after_the_checked_calls(rank: int, world_size: int, case: str) -> list[float]:
    for _ in range(CHECKED_CALLS + 1):
        dg.all_reduce(torch.ones(2))
    out = CASES[case](rank)
    if out is None:  # reduce on a rank that is not the destination
        return []
    return torch.view_as_real(out).flatten().tolist() if out.is_complex() else out.tolist()


def _outcome(case: str) -> tuple[list[list[float]] | None, str]:
    try:
        results = run_on_ranks(
            _mismatch_after_the_checked_calls,
            2,
            args=(case,),
            timeout=30,
            collective_timeout=PG_TIMEOUT_S,
            grace=PG_TIMEOUT_S + 5,
        )
    except RankFailedError as failure:
        return None, str(failure)
    return results, ""


@pytest.mark.parametrize(
    "case", ["reduce_scatter shape", "reduce_scatter dtype", "all_to_all shape"]
)
def test_a_size_mismatch_aborts_one_process_and_its_peer_names_it(case: str) -> None:
    results, report = _outcome(case)
    assert results is None
    assert "--- rank 0: died without reporting (exit code -6)" in report, report  # gloo's abort
    if "--- rank 1:" in report:  # unless the harness stopped it first, the peer names rank 0
        assert "when its connection to rank 0 closed" in report, report


def test_a_broadcast_shape_mismatch_is_silently_wrong() -> None:
    results, report = _outcome("broadcast shape")
    assert results is not None, report
    assert results[0] == [0.0, 1.0, 2.0]
    assert len(results[1]) == 4 and results[1][:3] == [0.0, 1.0, 2.0]  # 4th entry: never sent


def test_a_broadcast_of_complex64_into_float64_is_silently_wrong() -> None:
    results, report = _outcome("broadcast complex64 vs float64")
    assert results is not None, report
    assert results[0] == [1.0, 0.0] * 3
    assert results[1] != [1.0] * 3  # the bytes of (1+0j) read as float64: nonsense


def test_a_scatter_receiver_of_another_shape_is_silently_wrong() -> None:
    results, report = _outcome("scatter shape")
    assert results is not None, report
    assert results[0] == [[1.0, 1.0, 1.0]] * 2
    # the part's 6 entries poured into a 2 x 5 output; the other 4 are whatever was in memory
    assert len(results[1]) == 2 and results[1][0] == [1.0] * 5 and results[1][1][0] == 1.0


@pytest.mark.parametrize(
    "case", ["reduce shape", "all_reduce op", "a different collective", "a different src"]
)
def test_a_different_call_times_out_on_both_ranks_with_distgrad_s_account(case: str) -> None:
    results, report = _outcome(case)
    assert results is None
    for rank in (0, 1):
        assert f"distgrad: rank {rank} was in the forward of" in report, report
    assert "timed out after" in report, report
