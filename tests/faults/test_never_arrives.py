"""A rank that never makes the call its peer waits in fails the peer at the process-group
timeout, with a distgrad message saying which op and pass waited, for whom, and what the store
knows of the peer (waiting in another call, or in none).

The process-group timeout is 2 s here; the rank that does not arrive stays alive past it, so
this is a timeout and not a dead peer.
"""

from __future__ import annotations

import time
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

import distgrad as dg
from distgrad.errors import CollectiveMismatchError
from distgrad.testing import run_on_ranks

PG_TIMEOUT_S = 2.0
MARGIN_S = 5.0  # the report exchange takes up to 1 s more; CI machines are loaded


def _run(fn: object, *args: object) -> list[tuple[float, str]]:
    return run_on_ranks(
        fn,  # type: ignore[arg-type]
        2,
        args=args,
        timeout=30,
        collective_timeout=PG_TIMEOUT_S,
        grace=PG_TIMEOUT_S + MARGIN_S,
    )


def _skips_backward(rank: int, world_size: int) -> tuple[float, str]:
    x = torch.randn(4, 3, requires_grad=True)
    y = dg.all_gather(x, sizes=[4, 4])
    if rank == 1:
        time.sleep(PG_TIMEOUT_S + 2)  # alive, but never back-propagates
        return 0.0, ""
    start = time.monotonic()
    with pytest.raises(RuntimeError) as info:
        y.backward(torch.ones_like(y))
    return time.monotonic() - start, str(info.value)


@pytest.mark.slow  # 4 s; its area keeps three fast cases; CI's slow part runs it
def test_a_skipped_backward_times_out_naming_the_op_the_pass_and_the_missing_rank() -> None:
    took, message = _run(_skips_backward)[0]
    assert PG_TIMEOUT_S - 0.5 < took < PG_TIMEOUT_S + MARGIN_S, (took, message)
    first = message.splitlines()[0]
    assert first.startswith("distgrad: rank 0 was in the backward of all_gather"), first
    assert "timed out after" in first and "waiting for rank 1" in first, first
    assert "rank 1 reported no timeout of its own: it is not waiting inside distgrad" in first
    assert "(it skipped this call, for example its backward" in first


def _different_groups(rank: int, world_size: int, other_timeout: float) -> tuple[float, str]:
    # The same members, another group, with its own timeout.
    other = dist.new_group([0, 1], timeout=timedelta(seconds=other_timeout))
    start = time.monotonic()
    with pytest.raises(RuntimeError) as info:
        dg.all_reduce(torch.ones(3), group=None if rank == 0 else other)
    return time.monotonic() - start, str(info.value)


def test_ranks_on_different_groups_both_time_out_saying_where_the_other_waits() -> None:
    for rank, (took, message) in enumerate(_run(_different_groups, PG_TIMEOUT_S)):
        peer = 1 - rank
        first = message.splitlines()[0]
        assert PG_TIMEOUT_S - 0.5 < took < PG_TIMEOUT_S + MARGIN_S, (rank, took, first)
        assert first.startswith(
            f"distgrad: rank {rank} was waiting for its peers at the start of "
            "all_reduce(op='sum'), in its forward"
        ), first
        assert f"waiting for rank {peer}" in first, first
        # The peer's own report, read from the store: it waits too, on another group.
        assert f"rank {peer} timed out in the metadata handshake at the start of all_reduce" in (
            first
        ), first


@pytest.mark.slow  # 6 s; its area keeps four fast cases; CI's slow part runs it
def test_a_peer_still_waiting_on_another_group_is_said_to_be_waiting_there() -> None:
    """Rank 1's group has a longer timeout: when rank 0 times out, rank 1 still waits (and says
    so in the store once its wait has lasted a second); it fails when rank 0 leaves."""
    (took, message), (_, message_1) = _run(_different_groups, 60.0)
    first = message.splitlines()[0]
    assert PG_TIMEOUT_S - 0.5 < took < PG_TIMEOUT_S + MARGIN_S, (took, first)
    assert (
        "rank 1 is waiting in the metadata handshake at the start of all_reduce(op='sum'), on the "
        "group of global ranks 0, 1 (for "
    ) in first, first
    # Rank 1 learns of it when rank 0 leaves: not a crash, but a timeout, said as rank 0 did.
    first_1 = message_1.splitlines()[0]
    assert first_1.startswith(
        "distgrad: rank 1 was waiting for its peers at the start of all_reduce(op='sum')"
    ), first_1
    assert (
        "rank 0 timed out in the metadata handshake at the start of all_reduce(op='sum'), on the "
        "group of global ranks 0, 1, then exited"
    ) in first_1, first_1
    assert "crashed" not in first_1, first_1


def _requires_grad_on_rank_0_only(rank: int, world_size: int) -> tuple[float, str]:
    x = torch.ones(2, requires_grad=rank == 0)
    start = time.monotonic()
    with pytest.raises(CollectiveMismatchError) as info:
        dg.all_reduce(x)
    return time.monotonic() - start, str(info.value)


def test_requires_grad_on_some_ranks_is_the_same_error_on_every_rank_at_once() -> None:
    """Checked in the first calls (and every call in debug mode); past them a rank without
    requires_grad skips the backward, which is the skipped-backward timeout above."""
    seen = _run(_requires_grad_on_rank_0_only)
    assert seen[0][1] == seen[1][1].replace("on rank 1", "on rank 0"), seen
    for took, message in seen:
        assert took < MARGIN_S, (took, message)
        assert "ranks disagree on whether x requires grad (rank 0: True; rank 1: False)" in message


def _different_ops_past_the_checked_calls(rank: int, world_size: int) -> tuple[float, str]:
    for _ in range(10):  # past the checked calls: nothing compares the ops any more
        dg.all_reduce(torch.ones(3))
    start = time.monotonic()
    with pytest.raises(RuntimeError) as info:
        if rank == 0:
            dg.all_reduce(torch.ones(3))
        else:
            time.sleep(0.5)  # rank 0's wait times out first
            dg.all_to_all(torch.ones(4, 3))
    return time.monotonic() - start, str(info.value)


def test_the_rank_whose_wait_ends_second_says_its_peer_timed_out_and_where() -> None:
    """Rank 0 times out first and closes the group's connections, which ends rank 1's wait
    with a closed connection: rank 1 must not call that a crash, but say where rank 0 waited."""
    (_, message_0), (took, message_1) = _run(_different_ops_past_the_checked_calls)
    assert "timed out after" in message_0.splitlines()[0], message_0
    first = message_1.splitlines()[0]
    assert took < PG_TIMEOUT_S + MARGIN_S, (took, first)
    assert first.startswith("distgrad: rank 1 was in the forward of all_to_all"), first
    assert "rank 0 timed out in the forward of all_reduce(op='sum')" in first, first
    assert "crashed" not in first, first
