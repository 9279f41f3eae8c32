"""A model split across two workers, trained with the DistributedOptimizer.

worker0 holds the first layer and drives training; the second layer lives on worker1, created
there with ``remote`` and called through its RRef. Each step runs inside a distributed autograd
context: the forward crosses to worker1 and back, the backward crosses back again, and one
DistributedOptimizer steps the parameters on both workers (each on its owner).

Run: python examples/rpc_model_parallel.py
"""

from __future__ import annotations

import time

import torch

import distgrad.rpc as dgrpc
from distgrad.testing import run_on_ranks


class Stage2(torch.nn.Module):
    """The half of the model that lives on worker1."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(1)
        self.layer = torch.nn.Linear(16, 1)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return self.layer(torch.relu(h))


def _stage2_forward(stage: dgrpc.RRef[Stage2], h: torch.Tensor) -> torch.Tensor:
    return stage.local_value()(h)


def _stage2_params(stage: dgrpc.RRef[Stage2]) -> list[dgrpc.RRef[torch.Tensor]]:
    return [dgrpc.RRef(p) for p in stage.local_value().parameters()]


def worker(rank: int, world_size: int, steps: int) -> list[float]:
    if rank != 0:
        return []
    torch.manual_seed(0)
    stage1 = torch.nn.Linear(4, 16)
    stage2 = dgrpc.remote("worker1", Stage2)  # lives on worker1
    params = [dgrpc.RRef(p) for p in stage1.parameters()]
    params += dgrpc.rpc_sync("worker1", _stage2_params, args=(stage2,))
    opt = dgrpc.DistributedOptimizer(torch.optim.Adam, params, lr=0.03)
    g = torch.Generator().manual_seed(2)
    losses = []
    for _ in range(steps):
        x = torch.randn(32, 4, generator=g)
        y = x @ torch.tensor([[1.0], [-2.0], [0.5], [3.0]])
        with dgrpc.context() as context_id:
            h = stage1(x)
            pred = dgrpc.rpc_sync("worker1", _stage2_forward, args=(stage2, h))
            loss = torch.nn.functional.mse_loss(pred, y)
            dgrpc.backward(context_id, [loss])
            opt.step(context_id)
        losses.append(loss.item())
    return losses


if __name__ == "__main__":
    start = time.perf_counter()
    losses = run_on_ranks(worker, 2, args=(60,), init="rpc")[0]
    print(f"{len(losses)} steps in {time.perf_counter() - start:.1f} s")
    print(f"loss {losses[0]:.3f} -> {sum(losses[-10:]) / 10:.3f} (mean of the last 10 steps)")
    assert sum(losses[-10:]) / 10 < 0.5 * losses[0], "the split model did not learn"
