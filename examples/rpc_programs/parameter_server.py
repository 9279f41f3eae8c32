"""A parameter server: worker0 holds the model; trainers worker1, worker2 run its forward
through RPC, back-propagate through it with distributed autograd and step it with a
DistributedOptimizer, taking turns (trainer 1, then 2, every step), so that every run updates
the model in the same order."""

from __future__ import annotations

import threading
from typing import Any

import torch
from examples.rpc_programs._api import Api, Result, api, join
from torch import nn

STEPS = 4
_api: list[Api] = []  # this process's modules (one mode per process)
_server: list[nn.Module] = []
_lock = threading.Lock()
_turn = threading.Condition()
_next = [0]  # the turn number whose trainer may step: step * trainers + (rank - 1)


def _model() -> nn.Module:
    with _lock:  # made on first use: RPC threads may ask at once
        if not _server:
            torch.manual_seed(0)
            _server.append(nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 3)))
        return _server[0]


def forward(x: torch.Tensor) -> torch.Tensor:
    return _model()(x)  # type: ignore[no-any-return]


def parameter_rrefs() -> list[Any]:
    return [_api[0].rpc.RRef(p) for p in _model().parameters()]


def parameters() -> list[torch.Tensor]:
    return [p.detach().clone() for p in _model().parameters()]


def wait_turn(turn: int) -> None:
    with _turn:
        if not _turn.wait_for(lambda: _next[0] == turn, timeout=30):
            raise TimeoutError(f"turn {turn} never came (at {_next[0]})")


def end_turn() -> None:
    with _turn:
        _next[0] += 1
        _turn.notify_all()


def train(rank: int, trainers: int, a: Api) -> Result:
    rpc, dist_autograd = a.rpc, a.dist_autograd
    opt = a.DistributedOptimizer(torch.optim.SGD, rpc.rpc_sync("worker0", parameter_rrefs), lr=0.05)
    g = torch.Generator().manual_seed(rank)
    result = Result()
    for step in range(STEPS):
        x = torch.randn(8, 6, generator=g)
        y = torch.randint(0, 3, (8,), generator=g)
        rpc.rpc_sync("worker0", wait_turn, args=(step * trainers + rank - 1,))
        with result.timed(), dist_autograd.context() as context_id:
            loss = nn.functional.cross_entropy(rpc.rpc_sync("worker0", forward, args=(x,)), y)
            dist_autograd.backward(context_id, [loss])
            opt.step(context_id)
        params = rpc.rpc_sync("worker0", parameters)  # before the other trainer's turn
        rpc.rpc_sync("worker0", end_turn)
        result.record(loss=loss, params=params)
    return result


def run(rank: int, world_size: int, mode: str, folder: str) -> Result:
    _api[:] = [api(mode)]
    join(_api[0], rank, world_size, folder)
    result = Result() if rank == 0 else train(rank, world_size - 1, _api[0])
    _api[0].rpc.shutdown()
    return result
