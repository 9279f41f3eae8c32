"""A batch-updating parameter server: trainers worker1 and worker2 compute gradients of their
own copy of the model with local autograd and send them to worker0, whose
``update_and_fetch_model`` (``async_execution``) adds them up, steps once every trainer's have
arrived, and answers every trainer with the new model. No distributed autograd: this program
tests the plain RPC calls, RRefs passed over RPC and ``async_execution``.

Two trainers: the server's sum of their gradients is then the same in either arrival order."""

from __future__ import annotations

import threading
from typing import Any

import torch
from examples.rpc_programs._api import Api, Result, api, join
from torch import nn

STEPS = 4
_api: list[Api] = []
_server: list[Any] = []


class BatchUpdateParameterServer:
    def __init__(self, trainers: int) -> None:
        torch.manual_seed(0)
        self.model = nn.Sequential(nn.Linear(5, 8), nn.Tanh(), nn.Linear(8, 2))
        self.trainers = trainers
        self.arrived = 0
        self.lock = threading.Lock()
        self.future_model: torch.futures.Future[nn.Module] = torch.futures.Future()
        self.optimizer = torch.optim.SGD(self.model.parameters(), lr=0.1)
        for p in self.model.parameters():
            p.grad = torch.zeros_like(p)

    def get_model(self) -> nn.Module:
        return self.model

    @staticmethod
    def _update_and_fetch_model(ps_rref: Any, grads: list[torch.Tensor]) -> Any:
        self = ps_rref.local_value()
        with self.lock:
            for p, g in zip(self.model.parameters(), grads, strict=True):
                p.grad += g
            self.arrived += 1
            future = self.future_model
            if self.arrived == self.trainers:
                for p in self.model.parameters():
                    p.grad /= self.trainers
                self.optimizer.step()
                self.optimizer.zero_grad(set_to_none=False)
                self.arrived = 0
                future.set_result(self.model)
                self.future_model = torch.futures.Future()
        return future


def update_and_fetch_model(ps_rref: Any, grads: list[torch.Tensor]) -> Any:
    return BatchUpdateParameterServer._update_and_fetch_model(ps_rref, grads)


_made = threading.Event()


def server_rref() -> Any:
    if not _made.wait(timeout=30):  # a trainer may ask before worker0 has made it
        raise TimeoutError("the parameter server was never made")
    return _server[0]


def train(rank: int, a: Api) -> Result:
    ps_rref = a.rpc.rpc_sync("worker0", server_rref)
    model = ps_rref.rpc_sync().get_model()
    g = torch.Generator().manual_seed(rank)
    result = Result()
    for _ in range(STEPS):
        x = torch.randn(6, 5, generator=g)
        y = torch.randint(0, 2, (6,), generator=g)
        with result.timed():
            loss = nn.functional.cross_entropy(model(x), y)
            loss.backward()
            grads = [p.grad for p in model.parameters()]
            model = a.rpc.rpc_sync(ps_rref.owner(), update_and_fetch_model, args=(ps_rref, grads))
        result.record(loss=loss, params=list(model.parameters()))
    return result


def run(rank: int, world_size: int, mode: str, folder: str) -> Result:
    a = api(mode)
    _api[:] = [a]
    global update_and_fetch_model
    update_and_fetch_model = a.rpc.functions.async_execution(update_and_fetch_model)
    join(a, rank, world_size, folder)
    if rank == 0:
        _server.append(a.rpc.RRef(BatchUpdateParameterServer(world_size - 1)))
        _made.set()
    result = Result() if rank == 0 else train(rank, a)
    a.rpc.shutdown()
    return result
