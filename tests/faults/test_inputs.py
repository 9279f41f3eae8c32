"""Inputs at the edges: NaN and Inf, zero-size, more than 2 GiB, and 10,000 calls.

None of these is a fault of distgrad's own: each must behave as the same computation in one
process (NaN and Inf flow through, zero rows are fine) and leave the group usable.
"""

from __future__ import annotations

import resource
import threading
import time

import pytest
import torch
import torch.distributed as dist

import distgrad as dg
from distgrad.testing import run_on_ranks


def _nan_and_inf_flow_through(rank: int, world_size: int) -> None:
    special = torch.tensor([float("nan"), float("inf"), -float("inf"), 1.0], dtype=torch.float64)
    x = (special + rank).requires_grad_()
    v = torch.tensor([1.0, 2.0, 3.0, float("nan")], dtype=torch.float64).repeat(world_size)
    gathered = dg.all_gather(x)
    (gathered * v).sum().backward()
    both = torch.cat([special + r for r in range(world_size)])
    torch.testing.assert_close(gathered.detach(), both, equal_nan=True)
    # The gradient of sum over ranks of <all_gather(x), v>: world_size * v's slice of this rank.
    torch.testing.assert_close(x.grad, world_size * v[rank * 4 : rank * 4 + 4], equal_nan=True)
    summed = dg.all_reduce(x.detach())
    torch.testing.assert_close(summed, sum(special + r for r in range(world_size)), equal_nan=True)
    assert dg.all_reduce(torch.ones(1)).item() == world_size  # the group still works


def test_nan_and_inf_flow_through_forward_and_backward_as_in_one_process() -> None:
    start = time.monotonic()
    run_on_ranks(_nan_and_inf_flow_through, 2, timeout=30, collective_timeout=5)
    assert time.monotonic() - start < 20


def _zero_size_inputs(rank: int, world_size: int) -> None:
    rows = 0 if rank == 0 else 3
    x = torch.randn(rows, 2, dtype=torch.float64, requires_grad=True)
    v = torch.randn(3, 2, dtype=torch.float64, generator=torch.Generator().manual_seed(7))
    gathered = dg.all_gather(x)  # rank 0 sends nothing, receives rank 1's 3 rows
    assert gathered.shape == (3, 2)
    (gathered * v).sum().backward()
    assert x.grad is not None and x.grad.shape == (rows, 2)
    if rank == 1:
        torch.testing.assert_close(x.grad, world_size * v)
    empty = torch.zeros(0, 4, requires_grad=True)
    for out in (dg.all_reduce(empty), dg.all_to_all(empty), dg.broadcast(empty, 0)):
        assert out.shape == (0, 4)
        out.sum().backward()
    assert empty.grad is not None and empty.grad.shape == (0, 4)
    assert dg.all_reduce(torch.ones(1)).item() == world_size


def test_zero_size_inputs_exchange_nothing_and_give_empty_gradients() -> None:
    run_on_ranks(_zero_size_inputs, 2, timeout=30, collective_timeout=5)


_BIG = 2**31 + 64  # bytes: past every 32-bit byte count


def _more_than_2_gib(rank: int, world_size: int) -> None:
    x = torch.full((_BIG,), rank + 1, dtype=torch.uint8)
    moved = dg.permute(x, [1, 0], recv_shape=x.shape)  # point-to-point on gloo
    assert moved[0].item() == moved[-1].item() == 2 - rank
    del moved
    got = dg.broadcast(x, 1)  # a gloo collective
    assert got[0].item() == got[-1].item() == 2
    del got
    summed = dg.all_reduce(x)
    assert summed[0].item() == summed[-1].item() == 3


@pytest.mark.slow
def test_inputs_of_more_than_2_gib_move_whole() -> None:
    """About 6 GiB per rank at the peak."""
    run_on_ranks(_more_than_2_gib, 2, timeout=600, collective_timeout=300)


def _ten_thousand_calls(rank: int, world_size: int) -> tuple[float, int, int]:
    x = torch.randn(64, 32, requires_grad=True)

    def step() -> None:
        y = dg.all_gather(x, sizes=[64, 64])
        z = dg.all_reduce(y)
        z.sum().backward()

    for _ in range(200):
        step()
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    threads = threading.active_count()
    for _ in range(10_000):
        step()
    grown_kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before
    dist.barrier()
    return grown_kib, threading.active_count() - threads, len(dist.distributed_c10d._pg_map)


@pytest.mark.slow
def test_ten_thousand_forward_backward_calls_leak_neither_memory_nor_threads() -> None:
    for grown_kib, more_threads, groups in run_on_ranks(
        _ten_thousand_calls, 2, timeout=1200, collective_timeout=120
    ):
        assert grown_kib < 20 * 1024, f"peak RSS grew by {grown_kib} KiB"
        assert more_threads <= 2, f"{more_threads} more threads"  # sentinels, one helper
        assert groups == 1
