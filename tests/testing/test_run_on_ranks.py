"""The harness itself: results by rank, root cause first, nothing left running, nothing hangs."""

from __future__ import annotations

import os
import time

import pytest
import torch
import torch.distributed as dist

from distgrad.errors import RankFailedError
from distgrad.testing import run_on_ranks


def _rank_and_sum(rank: int, world_size: int, offset: int) -> tuple[int, float]:
    t = torch.tensor([float(rank + offset)])
    dist.all_reduce(t)
    return rank, t.item()


def test_returns_each_ranks_value_in_rank_order() -> None:
    assert run_on_ranks(_rank_and_sum, 3, args=(10,)) == [(0, 33.0), (1, 33.0), (2, 33.0)]


def _fail_late_on_rank_0_early_on_rank_2(rank: int, world_size: int) -> None:
    if rank == 2:
        raise KeyError("the root cause")
    time.sleep(0.3)
    if rank == 0:
        raise RuntimeError("a consequence")
    dist.barrier()


def test_the_earliest_failure_is_reported_first_with_its_traceback() -> None:
    with pytest.raises(RankFailedError) as info:
        run_on_ranks(_fail_late_on_rank_0_early_on_rank_2, 3, timeout=20)
    message = str(info.value)
    assert message.splitlines()[1].startswith("--- rank 2: KeyError: 'the root cause'")
    assert "in _fail_late_on_rank_0_early_on_rank_2" in message  # the traceback came along


def _write_pid_then_hang(rank: int, world_size: int, folder: str) -> None:
    with open(os.path.join(folder, f"pid{rank}"), "w") as f:
        f.write(str(os.getpid()))
    if rank == 1:
        time.sleep(3600)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # A zombie still answers kill(0); it is reaped when its state says so.
    with open(f"/proc/{pid}/stat") as f:
        return f.read().split()[2] != "Z"


def test_a_hung_rank_times_out_and_no_process_is_left(tmp_path: object) -> None:
    folder = str(tmp_path)
    start = time.monotonic()
    # The inner rung fires first: the hung rank dumps its stack and exits before the deadline.
    with pytest.raises(RankFailedError, match=r"rank 1: timed out: no result before its hang"):
        run_on_ranks(_write_pid_then_hang, 2, args=(folder,), timeout=4)
    elapsed = time.monotonic() - start
    assert 3.0 < elapsed < 8, f"took {elapsed:.1f}s against a 4 s timeout"
    pids = []
    for rank in range(2):
        with open(os.path.join(folder, f"pid{rank}")) as f:
            pids.append(int(f.read()))
    assert not any(_alive(pid) for pid in pids)


def _peer_waits_in_a_collective(rank: int, world_size: int) -> None:
    if rank == 0:
        raise ValueError("rank 0 gives up")
    dist.all_reduce(torch.ones(1))  # would wait for rank 0 forever without the ladder


def test_a_peer_waiting_in_a_collective_is_ended_within_the_grace_period() -> None:
    start = time.monotonic()
    with pytest.raises(RankFailedError, match="rank 0 gives up"):
        run_on_ranks(_peer_waits_in_a_collective, 2, timeout=60)
    assert time.monotonic() - start < 8


def _rank_1_fails_late_rank_0_returns(rank: int, world_size: int, delay: float) -> str:
    # Both ranks are connected before rank 1 fails: a rank that exits while its peer is still
    # connecting makes the peer's init_process_group fail (gloo's connectFullMesh).
    dist.barrier()
    if rank == 1:
        raise RuntimeError("rank 1 fails first")
    time.sleep(delay)  # reports this long after its peer failed
    return "rank 0's view"


@pytest.mark.slow  # 5 s; CI's slow part runs this file
def test_survivors_results_come_back_within_the_grace_period_given() -> None:
    with pytest.raises(RankFailedError) as info:
        run_on_ranks(_rank_1_fails_late_rank_0_returns, 2, args=(3.0,), timeout=30, grace=6.0)
    assert info.value.results == {0: "rank 0's view"}
    start = time.monotonic()
    with pytest.raises(RankFailedError) as info:  # the default grace: 2 s, then killed
        run_on_ranks(_rank_1_fails_late_rank_0_returns, 2, args=(10.0,), timeout=30)
    assert info.value.results == {}
    assert "--- rank 0: killed: it was still running after another rank had failed" in str(
        info.value
    )
    assert time.monotonic() - start < 8


def _finish_first_on_rank_0(rank: int, world_size: int, folder: str) -> bool:
    if rank == 0:
        with open(os.path.join(folder, "pid0"), "w") as f:
            f.write(str(os.getpid()))
        return True
    time.sleep(0.5)
    with open(os.path.join(folder, "pid0")) as f:
        return _alive(int(f.read()))


def test_a_rank_that_finishes_first_stays_until_its_peers_finish(tmp_path: object) -> None:
    """Its connections stay up while peers still work (gloo connects a new sub-group's members
    in the background; a peer mid-connect failed when a finished rank left at once)."""
    assert run_on_ranks(_finish_first_on_rank_0, 2, args=(str(tmp_path),)) == [True, True]


def _return_a_lambda(rank: int, world_size: int) -> object:
    return lambda: rank


def test_an_unpicklable_result_is_a_clear_error() -> None:
    with pytest.raises(RankFailedError, match="does not pickle"):
        run_on_ranks(_return_a_lambda, 1)


def _is_initialized(rank: int, world_size: int) -> bool:
    return dist.is_initialized()


def test_init_none_starts_processes_without_a_group() -> None:
    assert run_on_ranks(_is_initialized, 2, init="none") == [False, False]
    assert run_on_ranks(_is_initialized, 1) == [True]


def test_bad_arguments_are_rejected_before_starting_anything() -> None:
    with pytest.raises(ValueError, match="world_size must be at least 1"):
        run_on_ranks(_is_initialized, 0)
    with pytest.raises(ValueError, match="timeout must be positive"):
        run_on_ranks(_is_initialized, 1, timeout=0)
    with pytest.raises(ValueError, match="init must be"):
        run_on_ranks(_is_initialized, 1, init="mpi")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="grace must not be negative"):
        run_on_ranks(_is_initialized, 1, grace=-1)


def _rpc_round_trip(rank: int, world_size: int) -> float:
    from torch.distributed import rpc

    peer = f"worker{(rank + 1) % world_size}"
    return float(rpc.rpc_sync(peer, torch.add, args=(torch.ones(1), rank)).item())


def test_init_rpc_joins_workers_named_by_rank() -> None:
    assert run_on_ranks(_rpc_round_trip, 2, init="rpc") == [1.0, 2.0]


def _exit_without_a_word(rank: int, world_size: int) -> None:
    if rank == 1:
        os._exit(3)
    dist.barrier()


def test_a_rank_that_dies_is_reported_with_its_exit_code_and_its_peer_ended() -> None:
    start = time.monotonic()
    with pytest.raises(RankFailedError, match=r"rank 1: died without reporting \(exit code 3\)"):
        run_on_ranks(_exit_without_a_word, 2, timeout=30)
    assert time.monotonic() - start < 8


# How a rank leaves is part of the result: a rank that reported its value and then crashes or
# hangs in teardown fails the run, as torchrun would report the job.


def _abort_while_leaving_on_rank_1(rank: int, world_size: int) -> int:
    if rank == 1:
        import atexit
        import signal

        atexit.register(os.kill, os.getpid(), signal.SIGABRT)
    return rank


def test_a_rank_that_aborts_after_reporting_fails_the_run() -> None:
    with pytest.raises(RankFailedError) as info:
        run_on_ranks(_abort_while_leaving_on_rank_1, 2, timeout=30)
    message = str(info.value)
    assert "--- rank 1: returned its value but then died of SIGABRT while leaving" in message
    assert "rank 0" not in message  # rank 0 left cleanly
    assert info.value.results == {0: 0}


def _hang_while_leaving_on_rank_0(rank: int, world_size: int) -> int:
    if rank == 0:
        import atexit

        atexit.register(time.sleep, 3600)
    return rank


@pytest.mark.slow  # 5 s; CI's slow part runs this file
def test_a_rank_that_does_not_exit_after_reporting_fails_the_run() -> None:
    started = time.monotonic()
    with pytest.raises(RankFailedError) as info:
        run_on_ranks(_hang_while_leaving_on_rank_0, 2, timeout=30)
    assert "--- rank 0: returned its value but did not exit within 5 s" in str(info.value)
    assert time.monotonic() - started < 20


def _exit_with_code_3_after_reporting(rank: int, world_size: int) -> int:
    import atexit

    atexit.register(os._exit, 3)
    return rank


def test_a_nonzero_exit_code_after_reporting_fails_the_run() -> None:
    with pytest.raises(RankFailedError) as info:
        run_on_ranks(_exit_with_code_3_after_reporting, 2, timeout=30)
    message = str(info.value)
    assert "--- rank 0: returned its value but then exited with code 3" in message
    assert "--- rank 1: returned its value but then exited with code 3" in message
