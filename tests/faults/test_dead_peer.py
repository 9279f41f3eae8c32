"""A peer that dies is named by the survivor within seconds, in forward and backward, every op.

Rank 1 is killed (or exits, or raises) at a chosen point of a training-like loop of one op
(``_inject.py``); rank 0 must fail with an error naming the op, its own pass and rank 1, long
before the process-group timeout. Measured detection is 10-70 ms on loopback
(``benchmarks/results/faults.md``); the bound here is 5 s because CI machines are loaded.
"""

from __future__ import annotations

import random

import pytest

from distgrad.collectives._signature import CHECKED_CALLS
from distgrad.errors import RankFailedError
from distgrad.testing import run_on_ranks
from tests.faults._inject import LARGE, SMALL, Fault, Seen, inject, named, ops

DETECTED_WITHIN_S = 5.0
PG_TIMEOUT_S = 20.0  # far above the bound: a survivor that waited for it fails the test

DIFFERENTIABLE = [name for name in ops(2, 8) if name != "torch all_gather"]


def survivor_sees(fault: Fault) -> tuple[Seen, float, str]:
    """Run ``fault``; return what rank 0 saw, how long after the fault, and the harness's
    report of the failure."""
    failure, fault_at = inject(fault, PG_TIMEOUT_S, DETECTED_WITHIN_S + 1)
    assert failure is not None, "no rank failed: the fault did not end the victim's loop"
    report = str(failure)
    seen = failure.results.get(0)
    assert seen is not None, f"the survivor did not report within the grace period:\n{report}"
    assert fault_at is not None, f"the victim never stamped its fault:\n{report}"
    return seen, seen.when - fault_at, report


def assert_named(seen: Seen, took: float, op: str, report: str) -> None:
    assert seen.error_type is not None, f"the survivor saw no error:\n{report}"
    first = seen.message.splitlines()[0]
    assert took < DETECTED_WITHIN_S, f"detected after {took:.2f} s: {first}"
    assert first.startswith(f"distgrad: rank 0 was in the {seen.where} of "), first
    assert f"{seen.where} of {named(op, seen.where)}" in first, first
    assert "its connection to rank 1 closed" in first, first
    # gloo's own error, or distgrad's liveness check when gloo would not fail the operation
    assert "[from gloo]" in seen.message or "[from distgrad's liveness check]" in seen.message


@pytest.mark.parametrize("where", ["forward", "backward"])
@pytest.mark.parametrize("op", DIFFERENTIABLE)
def test_a_peer_killed_as_it_enters_a_pass_is_named_within_seconds(op: str, where: str) -> None:
    seen, took, report = survivor_sees(Fault(op, SMALL, where))
    assert_named(seen, took, op, report)
    assert "--- rank 1: died without reporting (exit code -9)" in report


# One op per exchange style: pairwise point-to-point (all_gather; its backward is the
# reduce_scatter's all_to_all) and a gloo collective (all_reduce).
@pytest.mark.parametrize("where", ["forward", "backward"])
@pytest.mark.parametrize("op", ["all_gather", "all_reduce"])
def test_a_peer_killed_inside_a_32_mb_transfer_is_named_within_seconds(op: str, where: str) -> None:
    delay = random.Random(f"{op}{where}").uniform(0.0, 0.03)  # inside the transfer
    seen, took, report = survivor_sees(Fault(op, LARGE, where, delay=delay))
    assert_named(seen, took, op, report)


@pytest.mark.parametrize("kind", ["exit", "raise"])
def test_a_peer_that_exits_or_raises_in_backward_is_named_within_seconds(kind: str) -> None:
    seen, took, report = survivor_sees(Fault("all_gather", SMALL, "backward", kind))
    assert_named(seen, took, "all_gather", report)
    if kind == "raise":  # the harness puts the peer's own error first
        assert "--- rank 1: RuntimeError: injected fault in the backward of all_gather" in report
    else:
        assert "--- rank 1: died without reporting (exit code 3)" in report


@pytest.mark.slow
@pytest.mark.parametrize("where", ["forward", "backward"])
@pytest.mark.parametrize("op", DIFFERENTIABLE)
def test_every_op_names_a_peer_killed_inside_a_32_mb_transfer(op: str, where: str) -> None:
    for trial in range(3):
        delay = random.Random(f"{op}{where}{trial}").uniform(0.0, 0.03)
        seen, took, report = survivor_sees(Fault(op, LARGE, where, delay=delay))
        assert_named(seen, took, op, report)


# Issue 37: a killed peer was named after 1.03 s (2 ranks) or 2.04 s (3 ranks) and said to be
# still running: an error asked whether the peer's process ran, took "not seen dead" for
# "running", and waited 1 s per peer for a timeout report that a dead peer never writes.
# Measured since: tens of milliseconds (benchmarks/results/faults.md); the bound here is
# generous for a loaded machine yet far below the 1 s of that regression.
NAMED_WITHIN_S = 0.6


@pytest.mark.parametrize("world_size", [2, 3])
@pytest.mark.parametrize("op", ["all_gather", "all_reduce", "reduce_scatter"])
def test_a_peer_killed_in_the_wait_is_named_dead_in_tens_of_milliseconds(
    op: str, world_size: int
) -> None:
    """Every survivor names rank 1 as exited or crashed, with how it ended where /proc can tell,
    never as running, well within a second of the kill, at 2 and 3 ranks."""
    fault = Fault(op, SMALL, "forward", delay=0.1, in_wait=True)
    failure, fault_at = inject(fault, PG_TIMEOUT_S, DETECTED_WITHIN_S + 1, world_size)
    assert failure is not None and fault_at is not None, failure
    survivors = [r for r in range(world_size) if r != 1]
    for rank in survivors:
        seen = failure.results.get(rank)
        assert seen is not None and seen.error_type is not None, f"rank {rank}:\n{failure}"
        first = seen.message.splitlines()[0]
        assert seen.when - fault_at < NAMED_WITHIN_S, f"{seen.when - fault_at:.3f} s: {first}"
        assert first.startswith(f"distgrad: rank {rank} was in the forward of {op}"), first
        assert "its connection to rank 1 closed" in first, first
        assert "rank 1 exited or crashed" in first, first
        assert "still running" not in first and "cannot tell" not in first, first


def _blocked_on_a_live_peer(rank: int, world_size: int) -> tuple[float, str]:
    """Rank 1 dies; rank 0 fails at it and lingers without exiting; rank 2 waits on rank 0."""
    import os
    import signal
    import time

    import torch
    import torch.distributed as dist

    import distgrad as dg

    x = torch.ones(64, 128)  # 32 KB: a message small enough to be waited for inline on 2 ranks
    for _ in range(CHECKED_CALLS):
        dg.all_reduce(torch.zeros(1))
    dist.barrier()
    if rank == 1:
        os.kill(os.getpid(), signal.SIGKILL)
    died = time.time()  # within a few ms of rank 1's death: the barrier released every rank
    if rank == 0:
        with pytest.raises(RuntimeError):
            dg.permute(x, [1, 0, 2], recv_shape=x.shape)  # 0 <-> 1; 2 keeps its own
        time.sleep(4)  # alive, and never comes to rank 2's exchange
        return 0.0, ""
    with pytest.raises(RuntimeError) as info:
        dg.permute(x, [2, 1, 0], recv_shape=x.shape)  # 0 <-> 2: rank 0 never comes
    return time.time() - died, str(info.value).splitlines()[0]


def test_a_rank_waiting_on_a_live_peer_names_the_rank_that_died() -> None:
    """On 3 ranks, rank 2 waits on rank 0, which is alive but stopped at its own error when
    rank 1 died: rank 2 names rank 1 as exited or crashed within a second, rather than waiting
    until rank 0's process ends and blaming rank 0."""
    failure = None
    try:
        run_on_ranks(_blocked_on_a_live_peer, 3, timeout=60, collective_timeout=PG_TIMEOUT_S)
    except RankFailedError as exc:
        failure = exc
    assert failure is not None, "rank 1's death failed no rank"
    assert 2 in failure.results, f"rank 2 never reported: it was still waiting\n{failure}"
    took, first = failure.results[2]
    assert took < NAMED_WITHIN_S + 0.4, f"{took:.3f} s: {first}"
    assert first.startswith("distgrad: rank 2 was in the forward of permute"), first
    assert "rank 1 exited or crashed" in first, first
    assert "still running" not in first, first
