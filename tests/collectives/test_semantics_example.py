"""The worked example of docs/semantics.md, number for number.

Two ranks share w = 1; rank 0 holds x = 1, rank 1 holds x = 3; every rank computes the global
loss L = (z_0 + z_1)^2 / 2 from the gathered embeddings z_r = w * x_r. Single process:
dL/dw = 16. The table in the docs states each rank's w.grad under each contract, their sum and
DDP's average; this test asserts those numbers, with a real DistributedDataParallel for the
DDP rows.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel

import distgrad as dg
from distgrad.testing import run_on_ranks

X = (1.0, 3.0)


def _grad_of_w(rank: int, objective: str, use_ddp: bool) -> float:
    model = nn.Linear(1, 1, bias=False).double()
    with torch.no_grad():
        model.weight.fill_(1.0)
    net = DistributedDataParallel(model) if use_ddp else model
    z = net(torch.tensor([[X[rank]]], dtype=torch.float64))
    gathered = dg.all_gather(z, objective=objective)  # type: ignore[arg-type]
    loss = gathered.sum() ** 2 / 2
    loss.backward()
    assert model.weight.grad is not None
    return float(model.weight.grad.item())


def _example(rank: int, world_size: int) -> dict[str, float]:
    return {
        "sum": _grad_of_w(rank, "sum", use_ddp=False),
        "replicated": _grad_of_w(rank, "replicated", use_ddp=False),
        "sum_ddp": _grad_of_w(rank, "sum", use_ddp=True),
        "replicated_ddp": _grad_of_w(rank, "replicated", use_ddp=True),
    }


def _single_process() -> float:
    w = torch.tensor(1.0, dtype=torch.float64, requires_grad=True)
    z = w * torch.tensor(X, dtype=torch.float64)
    (z.sum() ** 2 / 2).backward()
    assert w.grad is not None
    return float(w.grad.item())


def test_worked_example_numbers_match_the_docs() -> None:
    assert _single_process() == 16.0
    rank0, rank1 = run_on_ranks(_example, 2)
    # Sum contract: 8 and 24, summing to 2 * 16; DDP's average gives the single-process 16.
    assert (rank0["sum"], rank1["sum"]) == (8.0, 24.0)
    assert rank0["sum_ddp"] == rank1["sum_ddp"] == 16.0
    # Replicated contract: 4 and 12, summing to 16; DDP's average gives 8, half the truth.
    assert (rank0["replicated"], rank1["replicated"]) == (4.0, 12.0)
    assert rank0["replicated_ddp"] == rank1["replicated_ddp"] == 8.0
