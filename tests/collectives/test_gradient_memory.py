"""A collective's backward hands its gradient to autograd without a copy.

AccumulateGrad takes a leaf's first gradient as it is only when nothing else references it;
otherwise it copies it (a whole extra tensor of memory traffic, 0.5x the time of a 64 MB
all_reduce backward on gloo). Asserted on 2 gloo ranks: the memory of the gradient reaching
the leaf's AccumulateGrad is the memory of the leaf's ``.grad`` afterwards. The waits are
forced to tick (1 ms ticks instead of 20) and the tensors are past the point-to-point helper
thread's threshold, so the paths that keep a work object around longest are the ones taken.
"""

from __future__ import annotations

from collections.abc import Callable
from datetime import timedelta

import torch
from torch import Tensor

import distgrad as dg
from distgrad._exchange import wait as _wait
from distgrad.testing import run_on_ranks
from tests.collectives.reference import warm_up

ROWS, COLS = 1024, 256  # 1 MB per rank in float32: above _wait.INLINE_BYTES


def _ops() -> dict[str, Callable[[Tensor], Tensor]]:
    return {
        "all_reduce": lambda x: dg.all_reduce(x),
        "all_gather": lambda x: dg.all_gather(x, sizes=[ROWS, ROWS]),
        "reduce_scatter": lambda x: dg.reduce_scatter(x),
        "all_to_all": lambda x: dg.all_to_all(x),
        "broadcast": lambda x: dg.broadcast(x, 0),
        "permute": lambda x: dg.permute(x, [1, 0], recv_shape=(ROWS, COLS)),
    }


def _copied_gradients(rank: int, world_size: int) -> list[str]:
    warm_up()  # past the checked calls, as in training
    _wait._TICK = timedelta(milliseconds=1)
    copied = []
    for name, op in _ops().items():
        for _ in range(3):
            x = torch.randn(ROWS, COLS, requires_grad=True)
            out = op(x)
            accumulate = out.grad_fn.next_functions[0][0]  # type: ignore[union-attr]
            arrived: list[int] = []
            accumulate.register_prehook(lambda g, seen=arrived: seen.append(g[0].data_ptr()))
            out.backward(torch.ones_like(out))
            assert x.grad is not None
            if arrived != [x.grad.data_ptr()]:
                copied.append(name)
                break
    return copied


def test_the_gradient_of_every_op_reaches_the_leaf_without_a_copy() -> None:
    for rank, copied in enumerate(run_on_ranks(_copied_gradients, 2, timeout=120)):
        assert not copied, f"rank {rank}: AccumulateGrad copied the gradient of {copied}"
