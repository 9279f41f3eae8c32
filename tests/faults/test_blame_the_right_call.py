"""A peer is described at the call where it actually was (issue 37, item 3).

Semantics asserted, on 2 ranks: rank 1 times out in a call on a group with a short timeout and
goes on to wait in its next call; rank 0, whose own timeout on another group is longer than
distgrad's 5 s window for "recent" reports, says that rank 1 timed out in that first call
(and, where the text differs, where it waits now), not only where rank 1 waits now.
"""

from __future__ import annotations

from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

import distgrad as dg
from distgrad.testing import run_on_ranks

LONG_S = 7.5  # rank 0's timeout: rank 1's report is then 6 s old, past the 5 s window
SHORT_S = 1.5  # rank 1's


def _times_out_then_goes_on(rank: int, world_size: int) -> str:
    long = dist.new_group([0, 1], timeout=timedelta(seconds=LONG_S))
    short = dist.new_group([0, 1], timeout=timedelta(seconds=SHORT_S))
    x = torch.ones(4)
    if rank == 1:
        with pytest.raises(RuntimeError):
            dg.all_reduce(x, group=short)  # rank 0 never comes: times out after 1.5 s
        dg.all_reduce(x)  # waits here until rank 0 has timed out and comes
        return ""
    with pytest.raises(RuntimeError) as info:
        dg.all_reduce(x, group=long)  # rank 1 never comes here
    dg.all_reduce(x)  # releases rank 1
    return str(info.value).splitlines()[0]


@pytest.mark.slow  # 6-8 s: in CI's slow part (.ci/run)
def test_a_peer_that_timed_out_long_ago_is_described_at_that_call() -> None:
    first = run_on_ranks(
        _times_out_then_goes_on, 2, timeout=60, collective_timeout=30, grace=LONG_S + 5
    )[0]
    assert "timed out after" in first, first
    # the first calls are checked across ranks: rank 1 timed out in that check's handshake
    assert "rank 1 timed out in the metadata handshake at the start of all_reduce" in first, first
    assert "not waiting inside distgrad" not in first, first
