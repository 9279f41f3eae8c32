"""The data guard (distgrad._exchange.guard, opt-in: dg.set_guard(True) or DISTGRAD_GUARD=1).

Mismatches past the checked calls that move the same number of bytes, silently wrong without
the guard, are a CollectiveMismatchError with it, with no extra message. Two gloo ranks make 9
matching calls (past the 8 checked ones), then one mismatched call; the semantics asserted:
every rank that reads a mismatched tag raises the named error (every rank for a reduction and
all_gather; the receivers for broadcast; the destination for reduce), and the group stays
usable, since every rank's exchange completed.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

import distgrad as dg
from distgrad.collectives._signature import CHECKED_CALLS
from distgrad.errors import CollectiveMismatchError
from distgrad.testing import run_on_ranks

Call = Callable[[int], torch.Tensor | None]

CAUGHT: dict[str, tuple[Call, tuple[int, ...]]] = {
    # name: (the mismatched call on rank r, the ranks that must raise)
    "all_reduce sum, (2, 3) against (3, 2)": (
        lambda r: dg.all_reduce(torch.ones((2, 3) if r == 0 else (3, 2))),
        (0, 1),
    ),
    # max and min run as a reduce-scatter and an all_gather of flat slices: the dtype is in
    # the all_gather's tag, a shape of as many entries is not (the flat result is right).
    "all_reduce max, float32 against int32": (
        lambda r: dg.all_reduce(
            torch.ones(4, dtype=torch.float32 if r == 0 else torch.int32), "max"
        ),
        (0, 1),
    ),
    "all_reduce min, int64 against float64": (
        lambda r: dg.all_reduce(
            torch.ones(4, dtype=torch.int64 if r == 0 else torch.float64), "min"
        ),
        (0, 1),
    ),
    "reduce, (2, 3) against (3, 2)": (
        lambda r: dg.reduce(torch.ones((2, 3) if r == 0 else (3, 2)), 0),
        (0,),
    ),
    "broadcast, (3,) from the source into (4,)": (
        lambda r: dg.broadcast(torch.arange(3.0) if r == 0 else torch.zeros(4), 0),
        (1,),
    ),
    "broadcast, complex64 from the source into float64": (
        lambda r: dg.broadcast(
            torch.ones(3, dtype=torch.complex64) if r == 0 else torch.zeros(3, dtype=torch.float64),
            0,
        ),
        (1,),
    ),
    "all_gather, rows of (2, 3) against (6,)": (
        lambda r: dg.all_gather(torch.ones((2, 2, 3) if r == 0 else (2, 6)), sizes=[2, 2]),
        (0, 1),
    ),
    "all_gather, float32 against int32": (
        lambda r: dg.all_gather(
            torch.ones(2, 3, dtype=torch.float32 if r == 0 else torch.int32), sizes=[2, 2]
        ),
        (0, 1),
    ),
    "all_to_all, rows of (2, 3) against (6,)": (
        lambda r: dg.all_to_all(torch.ones((4, 2, 3) if r == 0 else (4, 6))),
        (0, 1),
    ),
    "gather, float32 against int32": (
        lambda r: dg.gather(
            torch.ones(2, 3, dtype=torch.float32 if r == 0 else torch.int32), 0, sizes=[2, 2]
        ),
        (0,),
    ),
    "scatter, a receiver shaped (2, 5) for a part of (2, 3)": (
        lambda r: dg.scatter(torch.ones(4, 3) if r == 0 else torch.zeros(2, 5), 0, sizes=[2, 2]),
        (1,),
    ),
    "permute, (2, 3) sent into a recv_shape of (3, 2)": (
        lambda r: dg.permute(torch.ones(2, 3), [1, 0], recv_shape=(3, 2)),
        (0, 1),
    ),
}


def _mismatch_then_a_matching_call(rank: int, world_size: int, case: str, guard: bool) -> str:
    """'' when the mismatched call returned, else its error; then one matching call, whose sum
    proves the group still works."""
    dg.set_guard(guard)
    for _ in range(CHECKED_CALLS + 1):
        dg.all_reduce(torch.ones(2))
    try:
        CAUGHT[case][0](rank)
        seen = ""
    except CollectiveMismatchError as exc:
        seen = str(exc)
    assert dg.all_reduce(torch.ones(2)).tolist() == [2.0, 2.0]
    return seen


@pytest.mark.parametrize("case", list(CAUGHT))
def test_a_same_bytes_mismatch_is_the_named_error_and_the_group_stays_usable(case: str) -> None:
    seen = run_on_ranks(_mismatch_then_a_matching_call, 2, args=(case, True), timeout=60)
    raising = CAUGHT[case][1]
    for rank, message in enumerate(seen):
        if rank not in raising:
            assert message == "", message
            continue
        op = case.split(",")[0].split()[0]
        assert message.startswith(f"distgrad: rank {rank} was in the forward of {op}"), message
        found = "when the data guard found that the ranks had not made the same call (the tags"
        assert f"past the checked calls, {found} of this rank's" in message, message
        assert "DISTGRAD_DEBUG=1" in message


@pytest.mark.parametrize(
    "case",
    ["all_reduce sum, (2, 3) against (3, 2)", "broadcast, complex64 from the source into float64"],
)
def test_without_the_guard_the_same_mismatch_is_silently_wrong(case: str) -> None:
    """What the guard is for: switched off, the call returns on every rank, no error."""
    seen = run_on_ranks(_mismatch_then_a_matching_call, 2, args=(case, False), timeout=60)
    assert seen == ["", ""]


def _many_guarded_calls(rank: int, world_size: int) -> int:
    """Matching calls never trip the guard: every reduce op the guard rides on, dtypes whose
    sums it trusts, large values in the data beside the tag, on 4 ranks."""
    dg.set_guard(True)
    calls = 0
    for step in range(30):
        for dtype in (torch.float32, torch.float64, torch.int32, torch.int64):
            x = (torch.arange(6) * (step + rank + 1) * 1000).to(dtype).view(2, 3)
            for op in ("sum", "max", "min"):
                dg.all_reduce(x, op)
                calls += 1
            dg.reduce(x, step % world_size)
            dg.broadcast(x, step % world_size)
            dg.all_gather(x, sizes=[2] * world_size)
            calls += 3
    return calls


@pytest.mark.slow  # 4 s, four ranks; CI's slow part runs this file
def test_matching_calls_never_trip_the_guard_on_four_ranks() -> None:
    assert run_on_ranks(_many_guarded_calls, 4, timeout=120) == [720] * 4


def _one_rank_differs(rank: int, world_size: int) -> str:
    dg.set_guard(True)
    for _ in range(CHECKED_CALLS + 1):
        dg.all_reduce(torch.ones(2))
    try:
        dg.all_reduce(torch.ones((3, 2) if rank == 2 else (2, 3)))
    except CollectiveMismatchError as exc:
        return str(exc)
    return ""


def test_every_rank_raises_when_one_of_three_differs() -> None:
    """Three ranks, the last passes (3, 2): the two that agree raise too (a sum's tags are
    read by every rank, and no rank's digits can explain the sums)."""
    seen = run_on_ranks(_one_rank_differs, 3, timeout=60)
    assert all("the data guard found" in message for message in seen), seen
