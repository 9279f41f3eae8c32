"""What a mismatch does after the checked calls, in default mode: each row of the table in
docs/semantics.md ("What a mistake does after the checked calls") measured, and every row of
docs/faults.md's table for reduce_scatter, all_to_all and broadcast.

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
    # reduce_scatter, all_to_all and broadcast, every mistake (issue 37, item 5)
    # rank 1 sends rank 0 three rows where it expects two, and gets the two it expects
    "reduce_scatter sizes, more for rank 0": lambda r: dg.reduce_scatter(
        torch.ones(4 if r == 0 else 5, 3), sizes=[2, 2] if r == 0 else [3, 2]
    ),
    "reduce_scatter sizes, fewer for rank 0": lambda r: dg.reduce_scatter(
        torch.full((4, 3), 1.0), sizes=[2, 2] if r == 0 else [1, 3]
    ),
    "reduce_scatter op": lambda r: dg.reduce_scatter(
        torch.full((4, 3), float(r + 2)), "sum" if r == 0 else "max"
    ),
    "reduce_scatter dim": lambda r: dg.reduce_scatter(
        torch.arange(16.0).reshape(4, 4), dim=0 if r == 0 else 1
    ),
    "reduce_scatter float32 and int32": lambda r: dg.reduce_scatter(
        torch.ones(4, 3, dtype=torch.float32 if r == 0 else torch.int32)
    ),
    "reduce_scatter and all_gather": lambda r: (
        dg.reduce_scatter(torch.ones(4, 3)) if r == 0 else dg.all_gather(torch.ones(2, 3))
    ),
    "all_to_all dtype": lambda r: dg.all_to_all(
        torch.ones(4, 3, dtype=torch.float32 if r == 0 else torch.float64)
    ),
    "all_to_all sizes, more for rank 0": lambda r: dg.all_to_all(
        torch.arange(12.0).reshape(4, 3),
        input_sizes=[2, 2] if r == 0 else [3, 1],
        output_sizes=[2, 2] if r == 0 else [2, 1],
    ),
    "all_to_all sizes, fewer for rank 0": lambda r: dg.all_to_all(
        torch.arange(12.0).reshape(4, 3),
        input_sizes=[2, 2] if r == 0 else [1, 3],
        output_sizes=[2, 2] if r == 0 else [2, 3],
    ),
    "all_to_all dim": lambda r: dg.all_to_all(
        torch.arange(16.0).reshape(4, 4), dim=0 if r == 0 else 1
    ),
    "broadcast larger from the source": lambda r: dg.broadcast(
        torch.arange(4.0) if r == 0 else torch.zeros(3), 0
    ),
    "broadcast float64 into float32": lambda r: dg.broadcast(
        torch.ones(3, dtype=torch.float64 if r == 0 else torch.float32), 0
    ),
    "broadcast float32 into float64": lambda r: dg.broadcast(
        torch.ones(3, dtype=torch.float32 if r == 0 else torch.float64), 0
    ),
    "broadcast (2, 3) into (3, 2)": lambda r: dg.broadcast(
        torch.arange(6.0).reshape(2, 3) if r == 0 else torch.zeros(3, 2), 0
    ),
    "broadcast and reduce": lambda r: (
        dg.broadcast(torch.ones(3), 0) if r == 0 else dg.reduce(torch.ones(3), 0)
    ),
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
    "case",
    [
        "reduce_scatter shape",
        "reduce_scatter dtype",
        "all_to_all shape",
        "reduce_scatter sizes, more for rank 0",
        "all_to_all dtype",
        "all_to_all sizes, more for rank 0",
    ],
)
def test_a_size_mismatch_aborts_one_process_and_its_peer_names_it(case: str) -> None:
    results, report = _outcome(case)
    assert results is None
    assert "--- rank 0: died without reporting (exit code -6)" in report, report  # gloo's abort
    if "--- rank 1:" in report:  # unless the harness stopped it first, the peer names rank 0
        assert "when its connection to rank 0 closed" in report, report


@pytest.mark.parametrize(
    "case", ["broadcast larger from the source", "broadcast float64 into float32"]
)
def test_a_broadcast_receiver_with_room_for_less_is_aborted(case: str) -> None:
    """gloo aborts the receiver ("op.preamble.length <= op.nbytes. 16 vs 12"); the source has
    sent its bytes and returns (the harness reports the receiver's death)."""
    results, report = _outcome(case)
    assert results is None
    assert "--- rank 1: died without reporting (exit code -6)" in report, report


def test_reduce_scatter_mistakes_that_move_no_more_bytes_are_silently_wrong() -> None:
    """Each rank reduces with its own op, splits along its own dim, reads the bytes as its own
    dtype, and keeps its own sizes (a piece shorter than announced leaves memory unwritten)."""
    results, report = _outcome("reduce_scatter op")
    assert results is not None, report
    assert results == [[[5.0] * 3] * 2, [[3.0] * 3] * 2]  # sum on rank 0, max on rank 1
    results, report = _outcome("reduce_scatter dim")
    assert results is not None, report
    assert results[0] == [[0.0, 5.0, 10.0, 15.0], [5.0, 10.0, 15.0, 20.0]]  # right: 2x, rows 0-1
    assert results[1] == [[10.0, 15.0], [15.0, 20.0], [20.0, 25.0], [25.0, 30.0]]
    results, report = _outcome("reduce_scatter float32 and int32")
    assert results is not None, report
    assert results[1] == [[1 + 0x3F800000] * 3] * 2  # 1.0f's bytes read as an integer, plus 1
    results, report = _outcome("reduce_scatter sizes, fewer for rank 0")
    assert results is not None, report
    assert len(results[0]) == 2 and results[0][0] == [2.0] * 3  # row 1: never received
    assert len(results[1]) == 3


def test_all_to_all_mistakes_that_move_no_more_bytes_are_silently_wrong() -> None:
    results, report = _outcome("all_to_all dim")
    assert results is not None, report
    assert results[0][2:] != [[0.0, 1.0, 2.0, 3.0], [4.0, 5.0, 6.0, 7.0]]  # what dim 0 sends
    results, report = _outcome("all_to_all sizes, fewer for rank 0")
    assert results is not None, report
    assert len(results[0]) == 4 and results[0][2] == [0.0, 1.0, 2.0]  # row 3: never received
    assert len(results[1]) == 5


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


def test_a_broadcast_into_room_for_more_or_another_shape_is_silently_wrong() -> None:
    results, report = _outcome("broadcast float32 into float64")
    assert results is not None, report
    assert results[0] == [1.0] * 3 and results[1] != [1.0] * 3  # 12 bytes into 24
    results, report = _outcome("broadcast (2, 3) into (3, 2)")
    assert results is not None, report
    assert results[1] == [[0.0, 1.0], [2.0, 3.0], [4.0, 5.0]]  # the entries poured flat


def test_a_scatter_receiver_of_another_shape_is_silently_wrong() -> None:
    results, report = _outcome("scatter shape")
    assert results is not None, report
    assert results[0] == [[1.0, 1.0, 1.0]] * 2
    # the part's 6 entries poured into a 2 x 5 output; the other 4 are whatever was in memory
    assert len(results[1]) == 2 and results[1][0] == [1.0] * 5 and results[1][1][0] == 1.0


@pytest.mark.parametrize(
    "case",
    [
        "reduce shape",
        "all_reduce op",
        "a different collective",
        "a different src",
        "reduce_scatter and all_gather",
        "broadcast and reduce",
    ],
)
def test_a_different_call_times_out_on_both_ranks_with_distgrad_s_account(case: str) -> None:
    results, report = _outcome(case)
    assert results is None
    for rank in (0, 1):  # in its forward, or its handshake (all_gather without sizes=)
        assert f"distgrad: rank {rank} was in the forward of" in report or (
            f"distgrad: rank {rank} was waiting for its peers at the start of" in report
        ), report
    assert "timed out after" in report, report


def _requires_grad_on_rank_1_only(rank: int, world_size: int, op: str) -> None:
    x = torch.ones(4, 3, requires_grad=rank == 1)
    for _ in range(CHECKED_CALLS + 1):
        dg.all_reduce(torch.ones(2))
    call = {
        "reduce_scatter": lambda x: dg.reduce_scatter(x),
        "all_to_all": lambda x: dg.all_to_all(x),
        "broadcast": lambda x: dg.broadcast(x, 0),
    }[op]
    y = call(x)
    if y.requires_grad:
        y.sum().backward()


@pytest.mark.parametrize(
    "op",
    [
        "reduce_scatter",
        pytest.param("all_to_all", marks=pytest.mark.slow),
        pytest.param("broadcast", marks=pytest.mark.slow),
    ],
)
def test_requires_grad_on_one_rank_only_times_out_in_its_backward(op: str) -> None:
    """The rank whose input requires grad waits in the backward until the group's timeout and
    says its peer is not waiting inside distgrad; the other rank has returned."""
    with pytest.raises(RankFailedError) as info:
        run_on_ranks(
            _requires_grad_on_rank_1_only,
            2,
            args=(op,),
            timeout=30,
            collective_timeout=PG_TIMEOUT_S,
            grace=PG_TIMEOUT_S + 5,
        )
    report = str(info.value)
    assert f"distgrad: rank 1 was in the backward of {op} and timed out after" in report, report
    assert "rank 0 reported no timeout of its own: it is not waiting inside distgrad" in report
    assert "--- rank 0:" not in report, report
