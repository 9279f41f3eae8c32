"""A parameter server with two trainers, trained with distributed autograd.

worker0 is the parameter server: it owns a small linear model. worker1 and worker2 are
trainers: each runs its own loop over its own data, calling the server's forward over RPC
inside a distributed autograd context, running a distributed backward (gradients flow back to
the server's parameters, stored in that trainer's context), and stepping the server's
parameters with a DistributedOptimizer. Steps from the two trainers on the server run one at a
time.

Run: python examples/rpc_parameter_server.py
"""

from __future__ import annotations

import threading
from typing import Any

import torch

import distgrad.rpc as dgrpc
from distgrad.testing import run_on_ranks

TRUE_W = torch.tensor([[2.0], [-3.0], [0.5]])


class ParameterServer:
    def __init__(self) -> None:
        self.model = torch.nn.Linear(3, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.model(x)

    def parameter_rrefs(self) -> list[dgrpc.RRef[torch.Tensor]]:
        return [dgrpc.RRef(p) for p in self.model.parameters()]


_server: list[ParameterServer] = []
_server_lock = threading.Lock()


def _get_server() -> ParameterServer:
    # Made on first use: a trainer's first call can reach worker0 before worker0's own code
    # runs, and RPC handlers run on several threads at once.
    with _server_lock:
        if not _server:
            _server.append(ParameterServer())
        return _server[0]


def server_forward(x: torch.Tensor) -> torch.Tensor:
    return _get_server().forward(x)


def server_parameters() -> list[dgrpc.RRef[torch.Tensor]]:
    return _get_server().parameter_rrefs()


def train(rank: int, steps: int) -> list[float]:
    g = torch.Generator().manual_seed(rank)
    params = dgrpc.rpc_sync("worker0", server_parameters)
    opt = dgrpc.DistributedOptimizer(torch.optim.SGD, params, lr=0.1)
    losses = []
    for _ in range(steps):
        x = torch.randn(16, 3, generator=g)
        y = x @ TRUE_W + 1.0
        with dgrpc.context() as context_id:
            pred = dgrpc.rpc_sync("worker0", server_forward, args=(x,))
            loss = torch.nn.functional.mse_loss(pred, y)
            dgrpc.backward(context_id, [loss])
            opt.step(context_id)
        losses.append(loss.item())
    return losses


def worker(rank: int, world_size: int, steps: int) -> Any:
    if rank == 0:
        _get_server()
        return None
    return train(rank, steps)


if __name__ == "__main__":
    results = run_on_ranks(worker, 3, args=(30,), init="rpc")
    for rank in (1, 2):
        losses = results[rank]
        print(f"trainer worker{rank}: loss {losses[0]:.3f} -> {losses[-1]:.4f}")
        assert losses[-1] < 0.05 * losses[0], "the trainers did not learn"
