"""DistributedDataParallel with RPC: worker0 is a parameter server holding an embedding table;
trainers worker1 and worker2 each hold a DDP-wrapped head over a gloo group of the two
trainers, look rows up on the server through RPC, back-propagate with distributed autograd
(DDP averages the head's gradients across the trainers, the table's stay per trainer) and step
both with one DistributedOptimizer. The trainers step in turn, between barriers, so that every
run updates the shared table in the same order."""

from __future__ import annotations

import os
import threading
from typing import Any

import torch
import torch.distributed as dist
from examples.rpc_programs._api import Api, Result, api, join
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

STEPS = 4
ROWS, WIDTH = 20, 6
_api: list[Api] = []
_table: list[nn.EmbeddingBag] = []
_lock = threading.Lock()


def _get_table() -> nn.EmbeddingBag:
    with _lock:
        if not _table:
            torch.manual_seed(1)
            _table.append(nn.EmbeddingBag(ROWS, WIDTH, mode="sum"))
        return _table[0]


def lookup(indices: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    return _get_table()(indices, offsets)  # type: ignore[no-any-return]


def table_rrefs() -> list[Any]:
    return [_api[0].rpc.RRef(p) for p in _get_table().parameters()]


def table() -> torch.Tensor:
    return _get_table().weight.detach().clone()


class HybridModel(nn.Module):
    """The rows come from the server through RPC; the head is DDP over the trainers."""

    def __init__(self, group: Any) -> None:
        super().__init__()
        torch.manual_seed(2)
        self.head = DDP(nn.Linear(WIDTH, 4), process_group=group)

    def forward(self, indices: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
        rows = _api[0].rpc.rpc_sync("worker0", lookup, args=(indices, offsets))
        return self.head(rows)  # type: ignore[no-any-return]


def train(rank: int, a: Api) -> Result:
    model = HybridModel(dist.group.WORLD)
    params = [
        *a.rpc.rpc_sync("worker0", table_rrefs),
        *(a.rpc.RRef(p) for p in model.head.parameters()),
    ]
    opt = a.DistributedOptimizer(torch.optim.SGD, params, lr=0.05)
    g = torch.Generator().manual_seed(rank)
    result = Result()
    for _ in range(STEPS):
        indices = torch.randint(0, ROWS, (12,), generator=g)
        offsets = torch.tensor([0, 3, 6, 9])
        target = torch.randint(0, 4, (4,), generator=g)
        with result.timed(), a.dist_autograd.context() as context_id:
            loss = nn.functional.cross_entropy(model(indices, offsets), target)
            a.dist_autograd.backward(context_id, [loss])
            for turn in (1, 2):  # the table is shared: trainer 1 steps, then trainer 2
                if turn == rank:
                    opt.step(context_id)
                dist.barrier()
        head = list(model.head.parameters())
        result.record(loss=loss, head=head, table=a.rpc.rpc_sync("worker0", table))
    return result


def run(rank: int, world_size: int, mode: str, folder: str) -> Result:
    _api[:] = [api(mode)]
    join(_api[0], rank, world_size, folder)
    result = Result()
    if rank > 0:
        store = dist.FileStore(os.path.join(folder, "trainers"), world_size - 1)  # type: ignore[attr-defined]
        dist.init_process_group("gloo", store=store, rank=rank - 1, world_size=world_size - 1)
        result = train(rank, _api[0])
        dist.destroy_process_group()
    _api[0].rpc.shutdown()
    return result
