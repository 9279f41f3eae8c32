"""Pipeline parallelism with micro-batches: worker1 and worker2 each hold one stage of a
model (created with ``rpc.remote``); worker0 splits each batch in two micro-batches, sends
each through stage 1 (``rref.remote()``, the output staying on worker1) and stage 2
(``rref.rpc_async()``, which fetches it with ``to_here``), concatenates the answers, and trains
both stages with distributed autograd and a DistributedOptimizer.

Two micro-batches, not more: each stage's gradient is the sum of one term per micro-batch,
added in whatever order they arrive, and only a sum of two terms is the same in every order."""

from __future__ import annotations

import threading
from typing import Any

import torch
from examples.rpc_programs._api import Api, Result, api, join
from torch import nn

STEPS = 4
MICRO_BATCHES = 2
_api: list[Api] = []


class Stage(nn.Module):
    def __init__(self, sizes: tuple[int, int], seed: int, last: bool) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.net = nn.Linear(*sizes) if last else nn.Sequential(nn.Linear(*sizes), nn.ReLU())
        self._lock = threading.Lock()  # micro-batches arrive on several RPC threads

    def forward(self, x_rref: Any) -> torch.Tensor:
        x = x_rref.to_here()
        with self._lock:
            return self.net(x)  # type: ignore[no-any-return]

    def parameter_rrefs(self) -> list[Any]:
        return [_api[0].rpc.RRef(p) for p in self.parameters()]


class Pipeline(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        rpc = _api[0].rpc
        self.stage1 = rpc.remote("worker1", Stage, args=((6, 12), 1, False))
        self.stage2 = rpc.remote("worker2", Stage, args=((12, 3), 2, True))

    def forward(self, xs: torch.Tensor) -> torch.Tensor:
        futures = []
        for x in xs.chunk(MICRO_BATCHES):
            y_rref = self.stage1.remote().forward(_api[0].rpc.RRef(x))
            futures.append(self.stage2.rpc_async().forward(y_rref))
        return torch.cat(torch.futures.wait_all(futures))

    def parameter_rrefs(self) -> list[Any]:
        return [
            *self.stage1.remote().parameter_rrefs().to_here(),
            *self.stage2.remote().parameter_rrefs().to_here(),
        ]


def train(a: Api) -> Result:
    model = Pipeline()
    opt = a.DistributedOptimizer(torch.optim.SGD, model.parameter_rrefs(), lr=0.1)
    g = torch.Generator().manual_seed(0)
    result = Result()
    for _ in range(STEPS):
        x = torch.randn(8, 6, generator=g)
        y = torch.randn(8, 3, generator=g)
        with result.timed(), a.dist_autograd.context() as context_id:
            loss = nn.functional.mse_loss(model(x), y)
            a.dist_autograd.backward(context_id, [loss])
            opt.step(context_id)
        params = [rref.to_here() for rref in model.parameter_rrefs()]
        result.record(loss=loss, params=params)
    return result


def run(rank: int, world_size: int, mode: str, folder: str) -> Result:
    _api[:] = [api(mode)]
    join(_api[0], rank, world_size, folder)
    result = train(_api[0]) if rank == 0 else Result()
    _api[0].rpc.shutdown()
    return result
