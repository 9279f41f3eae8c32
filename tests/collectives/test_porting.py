"""The porting table of docs/semantics.md, row by row, for Megatron's parallel regions.

Semantics asserted: each Megatron region is written here from its definition (forward and
backward as raw torch.distributed calls in an autograd.Function, the way Megatron-LM's
``tensor_parallel/mappings.py`` defines them), and the distgrad expression the table gives
has the same value and the same input gradient on every rank, for a random cotangent that
differs between ranks. Float64, exact to 1e-12.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

import distgrad as dg
from distgrad.testing import run_on_ranks
from tests._support import FLOAT64_ROUNDING, seeded


def _all_reduce(t: Tensor) -> Tensor:
    t = t.clone()
    dist.all_reduce(t)
    return t


def _all_gather_last(t: Tensor) -> Tensor:
    parts = [torch.empty_like(t) for _ in range(dist.get_world_size())]
    dist.all_gather(parts, t.contiguous())
    return torch.cat(parts, -1)


def _split_last(t: Tensor) -> Tensor:
    return t.chunk(dist.get_world_size(), -1)[dist.get_rank()].contiguous()


def _all_gather_first(t: Tensor) -> Tensor:
    parts = [torch.empty_like(t) for _ in range(dist.get_world_size())]
    dist.all_gather(parts, t.contiguous())
    return torch.cat(parts)


def _reduce_scatter_first(t: Tensor) -> Tensor:
    return _all_reduce(t).chunk(dist.get_world_size())[dist.get_rank()].contiguous()


def _region(forward: Callable[[Tensor], Tensor], backward: Callable[[Tensor], Tensor]) -> Any:
    class Region(torch.autograd.Function):
        @staticmethod
        def forward(ctx: Any, x: Tensor) -> Tensor:
            return forward(x)

        @staticmethod
        def backward(ctx: Any, grad: Tensor) -> Tensor:
            return backward(grad)

    return Region.apply


def _identity(t: Tensor) -> Tensor:
    return t


MEGATRON = {
    "copy_to_tensor_model_parallel_region": _region(_identity, _all_reduce),
    "reduce_from_tensor_model_parallel_region": _region(_all_reduce, _identity),
    "scatter_to_tensor_model_parallel_region": _region(_split_last, _all_gather_last),
    "gather_from_tensor_model_parallel_region": _region(_all_gather_last, _split_last),
    "gather_from_sequence_parallel_region": _region(_all_gather_first, _reduce_scatter_first),
    "reduce_scatter_to_sequence_parallel_region": _region(_reduce_scatter_first, _all_gather_first),
}


def _copy_to(x: Tensor) -> Tensor:
    s = dg.all_reduce(x)
    return x.detach() + (s - s.detach())


def _scatter_to(x: Tensor) -> Tensor:
    s = dg.reduce_scatter(x, "sum", None, dim=-1)
    w, rank = dist.get_world_size(), dist.get_rank()
    return x.chunk(w, dim=-1)[rank].detach() + (s - s.detach())


DISTGRAD = {
    "copy_to_tensor_model_parallel_region": _copy_to,
    "reduce_from_tensor_model_parallel_region": lambda x: dg.all_reduce(x, objective="replicated"),
    "scatter_to_tensor_model_parallel_region": _scatter_to,
    "gather_from_tensor_model_parallel_region": lambda x: dg.all_gather(
        x, dim=-1, objective="replicated"
    ),
    "gather_from_sequence_parallel_region": lambda x: dg.all_gather(x),
    "reduce_scatter_to_sequence_parallel_region": lambda x: dg.reduce_scatter(x, "sum"),
}


def _both_ways(rank: int, world_size: int) -> dict[str, list[str]]:
    differ: dict[str, list[str]] = {}
    for name, megatron in MEGATRON.items():
        # Megatron's inputs: replicated where the region expects it (copy_to, scatter_to)
        seed = 7 if name.startswith(("copy_to", "scatter_to")) else 7 + rank
        x = torch.randn(4, 6, dtype=torch.float64, generator=seeded(seed))
        results = []
        for fn in (megatron, DISTGRAD[name]):
            leaf = x.clone().requires_grad_()
            out = fn(leaf)
            v = torch.randn(out.shape, dtype=torch.float64, generator=seeded(rank))
            (out * v).sum().backward()
            results.append((out.detach(), leaf.grad))
        (want, want_grad), (got, got_grad) = results
        differ[name] = [
            what
            for what, a, b in (("value", got, want), ("gradient", got_grad, want_grad))
            if not torch.allclose(a, b, **FLOAT64_ROUNDING)
        ]
    return differ


def test_every_megatron_region_in_the_porting_table_has_megatrons_value_and_gradient() -> None:
    for rank, differ in enumerate(run_on_ranks(_both_ways, 2)):
        assert not any(differ.values()), f"rank {rank}: {differ}"
