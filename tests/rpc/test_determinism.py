"""Determinism of what distgrad runs on RPC threads: a call served inside a context computes
the bits the process's intra-op setting gives, whichever of the agent's threads serves it.

The agent's threads start with OpenMP's default thread count and take the process's
``torch.set_num_threads`` only when they first ask for it, which a matrix product alone does
not do. distgrad applies the setting before it runs a served call, an optimizer step or a
backward phase, so which thread serves a call cannot change a bit (the rnn program's LSTM
update differed from torch's in 4 of 5 launches before; see ``distgrad.rpc._local``)."""

from __future__ import annotations

import torch
import torch.nn.functional as nnf
from torch import Tensor

import distgrad.rpc as dgrpc
from distgrad.testing import run_on_ranks
from tests import _support as support
from tests.rpc import _funcs as F
from tests.rpc import _helpers as H

CALLS = 48  # three times the agent's 16 threads: most of them serve at least one call


def linear(x: Tensor, w: Tensor, b: Tensor) -> Tensor:
    # (2, 5, 8) @ (8, 20): a shape whose last bits depend on BLAS's thread count here
    return nnf.linear(x, w, b)


def _served(rank: int, world_size: int) -> None:
    if rank != 0:
        return
    g = support.seeded(3)
    x, w, b = torch.randn(2, 5, 8, generator=g), torch.randn(20, 8, generator=g), torch.randn(20)
    # The process setting differs from the count a fresh thread starts with (run_on_ranks
    # starts every thread at 1): 2 threads, set on both workers.
    torch.set_num_threads(2)
    assert H.query("worker1", F.set_threads, 2) == 2
    want = linear(x, w, b)  # this thread has the process's setting
    with dgrpc.context():
        futures = [dgrpc.rpc_async("worker1", linear, args=(x, w, b)) for _ in range(CALLS)]
        got = [f.wait() for f in futures]
    differ = [i for i, y in enumerate(got) if not torch.equal(y, want)]
    assert not differ, (
        f"{len(differ)} of {CALLS} served calls computed other bits than the process's "
        f"intra-op setting gives (up to {max(float((got[i] - want).abs().max()) for i in differ)})"
    )


def test_a_served_call_computes_the_same_bits_on_every_agent_thread() -> None:
    """48 calls of ``F.linear`` inside a context, served by worker1's agent threads while the
    processes run 2 intra-op threads and a fresh thread starts with 1: every result equals
    the one computed locally with the process's setting, bit for bit."""
    run_on_ranks(_served, 2, init="rpc")
