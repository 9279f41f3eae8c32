"""Past the first calls on a group, an op sends its data and nothing else.

Counted, not timed: the torch profiler records every torch.distributed operation a rank runs
(``c10d::...`` events), in the forward and in the backward pass, on 2 gloo ranks after the
calls that are checked across ranks. Each op's counts are pinned below. On gloo, all_to_all
is gloo's own below 32 MB per rank (all these cases), and so is the exchange of a
reduce-scatter at every size (then summed locally). Below 256 KB per rank (the (4, 3) cases)
all_gather is gloo's own; from 256 KB (the "256 KB" cases) it runs as concurrent
point-to-point pairs (one send and one receive per peer: "send 1, recv 1" on 2 ranks). A
metadata exchange is an ``_allgather_base_`` of int64.

Not counted: the dead-peer watch's sentinel, a receive posted once per peer for the life of the
group when some wait first lasts a tick (``distgrad._exchange.wait``). It is made before
counting, so that whether a wait happened to last 20 ms does not change the counts.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor
from torch.profiler import ProfilerActivity, profile

import distgrad as dg
from distgrad._exchange import wait as _wait
from distgrad._exchange.group import resolve
from distgrad.testing import run_on_ranks
from tests.collectives.reference import warm_up

PAIR = {"send": 1, "recv_": 1}  # one exchange by point-to-point pairs, on 2 ranks
A2A = {"alltoall_base_": 1}  # gloo's all_to_all
AG = {"_allgather_base_": 1}  # gloo's all_gather (a small one)
RS = A2A  # a reduce-scatter on gloo, at every size: gloo's all_to_all, then a local sum
BIG_ROWS = 8192  # (8192, 4) float64: 256 KB per rank, where all_gather goes back to pairs


def _big(x: Tensor) -> Tensor:
    """A leaf of 256 KB per rank (``x`` only gives the dtype)."""
    return x.new_ones((BIG_ROWS, 4)).requires_grad_()


def _cases(rank: int) -> dict[str, Callable[[Tensor], Tensor]]:
    n = 2
    return {
        "all_gather, sizes given": lambda x: dg.all_gather(x, sizes=[4] * n),
        "all_gather, sizes learned": lambda x: dg.all_gather(x),
        "reduce_scatter": lambda x: dg.reduce_scatter(x),
        "all_gather, sizes given, 256 KB": lambda x: dg.all_gather(_big(x), sizes=[BIG_ROWS] * n),
        "reduce_scatter, 256 KB": lambda x: dg.reduce_scatter(_big(x).repeat(n, 1)),
        "all_reduce sum": lambda x: dg.all_reduce(x),
        "all_reduce avg": lambda x: dg.all_reduce(x, "avg"),
        "all_reduce max": lambda x: dg.all_reduce(x, "max"),
        "all_reduce prod": lambda x: dg.all_reduce(x, torch.distributed.ReduceOp.PRODUCT),
        "all_to_all even": lambda x: dg.all_to_all(x),
        "all_to_all, sizes given": lambda x: dg.all_to_all(
            x, input_sizes=[1, 3], output_sizes=[1, 1] if rank == 0 else [3, 3]
        ),
        "all_to_all, output sizes learned": lambda x: dg.all_to_all(x, input_sizes=[1, 3]),
        "broadcast": lambda x: dg.broadcast(x, 1),
        "reduce": lambda x: dg.reduce(x, 0),
        "gather, sizes given": lambda x: dg.gather(x, 0, sizes=[4] * n),
        "scatter, sizes given": lambda x: dg.scatter(x if rank == 0 else x[:2], 0, sizes=[2, 2]),
        "permute, recv_shape given": lambda x: dg.permute(x, [1, 0], recv_shape=(4, 3)),
        "info_nce, sizes given": lambda x: dg.losses.info_nce(x, x.flip(0), sizes=[4] * n),
        "clip_loss ring, sizes given": lambda x: dg.losses.clip_loss(
            x, x.flip(0), sizes=[4] * n, block_size=2
        ),
        "barlow_twins, sizes given": lambda x: dg.losses.barlow_twins(x, x.flip(0), sizes=[4] * n),
    }


EXPECTED: dict[str, tuple[dict[str, int], dict[str, int]]] = {  # (forward, backward)
    "all_gather, sizes given": (AG, RS),
    "all_gather, sizes learned": ({"_allgather_base_": 2}, RS),  # the sizes, then the data
    "reduce_scatter": (RS, AG),
    "all_gather, sizes given, 256 KB": (PAIR, A2A),
    "reduce_scatter, 256 KB": (A2A, PAIR),
    "all_reduce sum": ({"allreduce_": 1}, {"allreduce_": 1}),
    "all_reduce avg": ({"allreduce_": 1}, {"allreduce_": 1}),
    # an all_to_all and an all_gather; an all_to_all and a reduce-scatter (an all_to_all too)
    "all_reduce max": ({**A2A, **AG}, {"alltoall_base_": 2}),
    "all_reduce prod": ({**A2A, **AG}, {"alltoall_base_": 2}),
    "all_to_all even": (A2A, A2A),
    "all_to_all, sizes given": (A2A, A2A),
    "all_to_all, output sizes learned": ({"_allgather_base_": 1, **A2A}, A2A),
    "broadcast": ({"broadcast_": 1}, {"reduce_": 1}),
    "reduce": ({"reduce_": 1}, {"broadcast_": 1}),
    "gather, sizes given": ({"gather_": 1}, {"scatter_": 1}),
    "scatter, sizes given": ({"scatter_": 1}, {"gather_": 1}),
    "permute, recv_shape given": (PAIR, PAIR),
    # the keys' all_gather and the value's scalar all_reduce; the keys' reduce-scatter
    "info_nce, sizes given": ({**AG, "allreduce_": 1}, RS),
    # one ring pass through the ring driver (W + 1 exchanges on 2 ranks: the texts a step
    # ahead, their column logsumexps a step behind) and the value; the backward's W + 1
    "clip_loss ring, sizes given": (
        {"send": 3, "recv_": 3, "allreduce_": 1},
        {"send": 3, "recv_": 3},
    ),
    # 5 all_reduces of statistics, the same in backward
    "barlow_twins, sizes given": ({"allreduce_": 5}, {"allreduce_": 5}),
}


def _count(events: Any) -> dict[str, int]:
    found = Counter(e.name.removeprefix("c10d::") for e in events if e.name.startswith("c10d::"))
    return dict(found)


def _messages_of_every_op(rank: int, world_size: int) -> dict[str, tuple[dict[str, int], ...]]:
    warm_up()
    group = resolve(None, "all_reduce")
    _wait._dead_peer(group, [peer for peer in range(world_size) if peer != rank])  # connects
    seen = {}
    for name, call in _cases(rank).items():
        x = torch.randn(4, 3, dtype=torch.float64, requires_grad=True)
        with profile(activities=[ProfilerActivity.CPU]) as forward:
            out = call(x)
        with profile(activities=[ProfilerActivity.CPU]) as backward:
            (out * torch.ones_like(out)).sum().backward()
        seen[name] = (_count(forward.events()), _count(backward.events()))
    return seen


def test_past_the_checked_calls_every_op_sends_only_its_data() -> None:
    for rank, seen in enumerate(run_on_ranks(_messages_of_every_op, 2, timeout=60)):
        wrong = {
            name: {"expected": EXPECTED[name], "seen": counts}
            for name, counts in seen.items()
            if counts != EXPECTED[name]
        }
        assert not wrong, f"rank {rank}: {wrong}"
