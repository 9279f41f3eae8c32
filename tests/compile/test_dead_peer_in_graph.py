"""A peer that dies during a compiled step: what a survivor sees.

Inside ``torch.compile`` every exchange is torch's functional collective, and its wait is
torch's ``wait_tensor`` (docs/semantics.md, "Inside torch.compile"), which distgrad's
dead-peer watch does not tick through. On gloo a SIGKILLed peer closes its connections, and a
survivor waiting for it gets gloo's own error ("Connection closed by peer" or "Connection reset
by peer", naming the peer's address, not its rank) within milliseconds; at worst (a peer that
dies mid-transfer, docs/faults.md) the process group's timeout. Asserted on 2 gloo ranks: rank
1 is SIGKILLed once both ranks have compiled and run the step; rank 0's next compiled step
raises within a second, with gloo's message.
"""

from __future__ import annotations

import os
import signal
import time

import pytest
import torch
import torch.distributed as dist

import distgrad as dg
from distgrad.collectives._signature import CHECKED_CALLS
from distgrad.errors import RankFailedError
from distgrad.testing import run_on_ranks

NAMED_WITHIN_S = 1.0


def _step(x: torch.Tensor) -> torch.Tensor:
    return dg.all_reduce(x * 2).sum()


def _killed_during_a_compiled_step(rank: int, world_size: int) -> tuple[float, str]:
    x = torch.ones(64, 128, requires_grad=True)
    for _ in range(CHECKED_CALLS):
        dg.all_reduce(torch.zeros(1))
    step = torch.compile(_step, backend="aot_eager", fullgraph=True)
    step(x).backward()  # both ranks compile and run it once
    dist.barrier()
    if rank == 1:
        os.kill(os.getpid(), signal.SIGKILL)
    died = time.time()  # the barrier released both ranks within a few milliseconds
    with pytest.raises(RuntimeError) as info:
        step(x).backward()
    return time.time() - died, str(info.value).splitlines()[0]


@pytest.mark.slow  # 6-8 s: in CI's slow part (.ci/run)
def test_a_peer_killed_during_a_compiled_step_fails_the_survivor_within_a_second() -> None:
    with pytest.raises(RankFailedError) as failure:
        run_on_ranks(_killed_during_a_compiled_step, 2, timeout=120, collective_timeout=30)
    assert 0 in failure.value.results, f"rank 0 never reported:\n{failure.value}"
    took, first = failure.value.results[0]
    assert took < NAMED_WITHIN_S, f"{took:.3f} s: {first}"
    assert "Connection closed by peer" in first or "Connection reset by peer" in first, first
