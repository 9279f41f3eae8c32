"""Models for the parallel-model checker (tests/testing/test_model_checker.py): each a plain
model, a loss, and parallelizations, right and deliberately wrong. Module level, so that they
pickle to the ranks.

Tensor parallel over a 1-D mesh ("tp"), distgrad's sum contract: every rank gets the whole
batch and back-propagates its share of the loss (the loss over its TP size); a replicated
parameter's gradient is summed over TP by a hook. The planted mistakes: the sequence-parallel
LayerNorm without that hook (each rank keeps its rows' part), and the row-parallel bias added
on every TP rank before the sum (zero at the start, as Megatron initialises biases, so the
forward agrees and the bias gradient carries the TP size).

Data parallel over a 1-D mesh ("dp"): an InfoNCE loss over the global batch, each rank the
mean over its rows, gradients averaged (FSDP2 or DDP). The planted mistakes: the loss averaged
twice (divided by the DP size again) and a plain GatherLayer (its backward keeps only this
rank's slice).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor, nn
from torch.distributed.fsdp import fully_shard
from torch.nn.parallel import DistributedDataParallel

import distgrad as dg
from distgrad import parallel as P

DT = torch.float64
D, H, ROWS = 4, 6, 8


class TPNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        gen = torch.Generator().manual_seed(0)
        self.norm = nn.LayerNorm(D, dtype=DT)
        self.fc1 = nn.Linear(D, H, dtype=DT)
        self.fc2 = nn.Linear(H, D, dtype=DT)
        with torch.no_grad():
            for p in (self.norm.weight, self.norm.bias, self.fc1.weight, self.fc2.weight):
                p.copy_(torch.randn(p.shape, dtype=DT, generator=gen))
            self.fc2.bias.zero_()

    def forward(self, x: Tensor) -> Tensor:
        return self.fc2(F.gelu(self.fc1(self.norm(x))))


def make_tp_net() -> nn.Module:
    return TPNet()


def tp_batch() -> tuple[Tensor, Tensor]:
    gen = torch.Generator().manual_seed(1)
    return (torch.randn(ROWS, D, dtype=DT, generator=gen),
            torch.randn(ROWS, D, dtype=DT, generator=gen))  # fmt: skip


def tp_loss(model: nn.Module, x: Tensor, target: Tensor, mesh: Any = None) -> Tensor:
    loss = ((model(x) - target) ** 2).mean()
    return loss if mesh is None else loss / mesh.size()  # each TP rank: its share


class _TPForward(nn.Module):
    """The sequence-parallel LayerNorm, then column and row parallel linears."""

    def __init__(self, net: TPNet, mesh: Any, bias_on_every_rank: bool) -> None:
        super().__init__()
        self.norm = net.norm
        self.fc1 = P.ColumnParallelLinear.from_linear(net.fc1, mesh)
        self.fc2 = P.RowParallelLinear.from_linear(net.fc2, mesh)
        self.mesh, self.bias_on_every_rank = mesh, bias_on_every_rank

    def forward(self, x: Tensor) -> Tensor:
        rows = P.split_to_sequence(x, self.mesh)  # this rank's rows
        h = P.gather_from_sequence(self.norm(rows), self.mesh)
        h = F.gelu(self.fc1(h))
        if self.bias_on_every_rank:  # the mistake: each rank adds the bias before the sum
            partial = F.linear(h, self.fc2.weight, self.fc2.bias)
            return dg.all_reduce(partial, "sum", group=self.mesh)
        return self.fc2(h)


def _sum_over(mesh: Any, params: list[nn.Parameter]) -> None:
    for p in params:
        p.register_hook(lambda g: dg.all_reduce(g, "sum", group=mesh))


def tp_right(model: nn.Module, mesh: Any) -> nn.Module:
    assert isinstance(model, TPNet)
    out = _TPForward(model, mesh, bias_on_every_rank=False)
    _sum_over(mesh, [out.norm.weight, out.norm.bias, out.fc2.bias])
    return out


def tp_wrong(model: nn.Module, mesh: Any) -> nn.Module:
    """The LayerNorm's gradients never summed over TP; the row bias added on every rank."""
    assert isinstance(model, TPNet)
    out = _TPForward(model, mesh, bias_on_every_rank=True)
    _sum_over(mesh, [out.fc2.bias])
    return out


def make_encoder() -> nn.Module:
    torch.manual_seed(2)
    return nn.Sequential(nn.Linear(D, H, dtype=DT), nn.Tanh(), nn.Linear(H, D, dtype=DT))


def dp_batch() -> tuple[Tensor, Tensor]:
    gen = torch.Generator().manual_seed(3)
    return (torch.randn(ROWS, D, dtype=DT, generator=gen),
            torch.randn(ROWS, D, dtype=DT, generator=gen))  # fmt: skip


class GatherLayer(torch.autograd.Function):
    """The plain GatherLayer: all_gather forward, this rank's slice of the gradient back."""

    @staticmethod
    def forward(ctx: Any, x: Tensor) -> Tensor:
        out = [torch.empty_like(x) for _ in range(dist.get_world_size())]
        dist.all_gather(out, x.contiguous())
        return torch.cat(out)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> Tensor:
        return grad.chunk(dist.get_world_size())[dist.get_rank()]


def _info_nce(model: nn.Module, a: Tensor, b: Tensor, mesh: Any, gather: str) -> Tensor:
    za, zb = model(a), model(b)
    if mesh is None:
        every, offset = zb, 0
    elif gather == "plain":
        every, offset = GatherLayer.apply(zb), mesh.get_local_rank() * len(zb)
    else:
        every, offset = dg.all_gather(zb, group=mesh), mesh.get_local_rank() * len(zb)
    logits = za @ every.T
    labels = torch.arange(len(za)) + offset
    return F.cross_entropy(logits, labels)


def dp_loss(model: nn.Module, a: Tensor, b: Tensor, mesh: Any = None) -> Tensor:
    return _info_nce(model, a, b, mesh, "distgrad")


def dp_loss_averaged_twice(model: nn.Module, a: Tensor, b: Tensor, mesh: Any = None) -> Tensor:
    loss = _info_nce(model, a, b, mesh, "distgrad")
    return loss if mesh is None else loss / mesh.size()  # the mistake: the DP average again


def dp_loss_gather_layer(model: nn.Module, a: Tensor, b: Tensor, mesh: Any = None) -> Tensor:
    return _info_nce(model, a, b, mesh, "plain")


def fsdp(model: nn.Module, mesh: Any) -> nn.Module:
    fully_shard(model, mesh=mesh)
    return model


def ddp(model: nn.Module, mesh: Any) -> nn.Module:
    return DistributedDataParallel(model, process_group=mesh.get_group())
