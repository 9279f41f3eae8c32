"""Faults: what every surviving worker sees when a worker dies or raises, and how fast.

A killed worker ends its ``run_on_ranks`` group as a failure, so the survivors report what
they saw by raising ``SystemExit("expected: ...")``, and the test reads their reports from the
group's error (the harness gives survivors 2 s after the first failure to report). Times are
measured inside the workers.
"""

from __future__ import annotations

import random
import re
import time

import pytest
import torch

import distgrad.rpc as dgrpc
from distgrad.errors import RankFailedError, RpcAutogradError
from distgrad.testing import run_on_ranks
from tests import _support as support
from tests.rpc import _funcs as F
from tests.rpc import _helpers as H


def _killed_mid_backward(rank: int, world_size: int, mode: str) -> None:
    if rank != 0:
        time.sleep(20)  # worker1 dies in backward; worker2 waits to be killed by the harness
        return
    x = support.leaf(1, 3)
    with dgrpc.context() as cid:
        y = dgrpc.rpc_sync("worker1", F.killed_in_backward, args=(x,))
        z = dgrpc.rpc_sync("worker2", torch.exp, args=(x,))
        start = time.monotonic()
        try:
            dgrpc.backward(cid, [(y * z).sum()], mode=mode)  # type: ignore[arg-type]
        except RpcAutogradError as exc:
            raise SystemExit(f"expected after {time.monotonic() - start:.2f} s: {exc}") from None
    raise AssertionError("backward returned although worker1 died in it")


@pytest.mark.parametrize("mode", H.MODES)
def test_a_worker_killed_mid_backward_fails_the_pass_within_seconds_naming_it(mode: str) -> None:
    with pytest.raises(RankFailedError) as info:
        run_on_ranks(_killed_mid_backward, 3, args=(mode,), init="rpc", timeout=30)
    text = str(info.value)
    found = re.search(r"rank 0: SystemExit: expected after ([0-9.]+) s: (.*)", text)
    assert found, text
    assert float(found[1]) < 5.0, text
    assert "distributed backward failed on worker1" in found[2], text


def _root_dies(
    rank: int, world_size: int, mode: str = "fast", delay: float = 0.3, work: float = 1.5
) -> None:
    if rank == 0:
        x = support.leaf(2, 3)
        with dgrpc.context() as cid:
            y = dgrpc.rpc_sync("worker1", F.slow_in_backward, args=(x, work))
            F.kill_me_after(delay)  # while worker1 runs its backward
            dgrpc.backward(cid, [y.sum()], mode=mode)  # type: ignore[arg-type]
        return
    deadline = time.monotonic() + 15
    while not F.backward_started:  # the root's backward reached this worker
        assert time.monotonic() < deadline, "the backward never reached worker1"
        time.sleep(0.01)
    killed = F.backward_started[0] + delay
    while dgrpc.debug_state()["contexts"]:
        assert time.monotonic() < deadline, f"context still held: {dgrpc.debug_state()}"
        time.sleep(0.01)
    released = time.monotonic() - killed
    state = dgrpc.debug_state()
    left = {k: state[k] for k in ("contexts", "sends", "recvs", "smart_passes")}
    start = time.monotonic()
    try:
        dgrpc.shutdown(timeout=5.0)
    except RpcAutogradError as exc:
        took = time.monotonic() - start
        raise SystemExit(
            f"expected: released {released:.2f} s after the root died, left {left}; "
            f"shutdown raised after {took:.2f} s: {exc}"
        ) from None
    raise AssertionError("shutdown returned without saying that worker0 is gone")


def _dead_root_report(mode: str, delay: float, work: float) -> str:
    with pytest.raises(RankFailedError) as info:
        run_on_ranks(_root_dies, 2, args=(mode, delay, work), init="rpc", timeout=30)
    return str(info.value)


@pytest.mark.parametrize("mode", H.MODES)
def test_a_dead_root_s_context_is_released_within_seconds_and_shutdown_says_so(mode: str) -> None:
    """The root is SIGKILLed while worker1 runs its part of the backward; worker1 drops the
    orphaned context within seconds (torch keeps it; measured over 45 s), and its shutdown
    returns at once naming the dead worker (torch's waits for it)."""
    text = _dead_root_report(mode, 0.3, 1.5)
    pattern = r"released ([0-9.]+) s after the root died, left (\{.*?\}); shutdown raised after "
    found = re.search(pattern + r"([0-9.]+) s: (.*)", text)
    assert found, text
    assert float(found[1]) < 2.0, text
    assert found[2] == "{'contexts': 0, 'sends': 0, 'recvs': 0, 'smart_passes': 0}", text
    assert float(found[3]) < 5.0, text
    assert found[4].startswith("shutdown on worker1: could not reach worker0 ("), text


@pytest.mark.slow
@pytest.mark.parametrize("mode", H.MODES)
def test_a_dead_root_s_context_is_released_in_every_one_of_20_runs(mode: str) -> None:
    """Issue 21: the same, 20 times per mode, the root killed at random moments of worker1's
    backward of random lengths (measured: 28 of 28 released within 0.75 s)."""
    rng = random.Random(mode)
    for _ in range(20):
        work = rng.choice([0.5, 1.5])
        text = _dead_root_report(mode, rng.uniform(0.05, work - 0.1), work)
        found = re.search(r"released ([0-9.]+) s after the root died, left (\{.*?\})", text)
        assert found, text
        assert float(found[1]) < 1.0, text
        assert found[2] == "{'contexts': 0, 'sends': 0, 'recvs': 0, 'smart_passes': 0}", text


def _raises(rank: int, world_size: int) -> None:
    if rank != 0:
        return
    x = support.leaf(3, 3)
    for mode in H.MODES:
        start = time.monotonic()
        with dgrpc.context(), pytest.raises(ValueError, match="told to fail"):
            dgrpc.rpc_sync("worker1", F.raise_value_error, args=("told to fail",))
        with dgrpc.context() as cid:
            y = dgrpc.rpc_sync("worker1", F.chain_boom, args=(x, ["worker2"]))
            with pytest.raises(
                RpcAutogradError,
                match=r"^Error on Node 2: ValueError: boom"
                r".*\(distributed backward failed on worker2\)",
            ):
                dgrpc.backward(cid, [y.sum()], mode=mode)  # type: ignore[arg-type]
        assert time.monotonic() - start < 2.0, f"{mode}: errors took {time.monotonic() - start} s"
        H.no_state_left(world_size)


def test_remote_raises_in_forward_and_backward_reach_the_root_fast_and_leave_nothing() -> None:
    run_on_ranks(_raises, 3, init="rpc")


def _thousand_contexts(rank: int, world_size: int) -> None:
    if rank != 0:
        return
    x = support.leaf(4, 2)
    for i in range(1000):
        with dgrpc.context() as cid:
            y = dgrpc.rpc_sync(f"worker{1 + i % 2}", torch.mul, args=(x, x))
            if i % 2:
                dgrpc.backward(cid, [y.sum()], mode=H.MODES[i % 4 // 2])  # type: ignore[arg-type]
    H.no_state_left(world_size)


def test_a_thousand_contexts_are_all_released_on_every_worker() -> None:
    """Half of them with a backward, in both modes, over two callees."""
    run_on_ranks(_thousand_contexts, 3, init="rpc", timeout=90)
