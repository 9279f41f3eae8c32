"""reduce: the sum over ranks on one rank; zeros (a constant) on every other rank."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import Tensor
from torch._C._distributed_c10d import ReduceOptions

from distgrad._exchange import functional, guard
from distgrad._exchange.backend import leading, options, real
from distgrad._exchange.declare import exchange, like, zeros
from distgrad._exchange.group import Group
from distgrad._exchange.inflight import Steps, begin

__all__ = ["reduce"]


@exchange(lambda x, dst, *, group: like(x, x.shape), empty=zeros, traced=functional.reduce)
def reduce(x: Tensor, dst: int, *, group: Group) -> Steps[Tensor | None]:
    """The sum of ``x`` over ranks on group rank ``dst``; None on the other ranks."""
    if group.pg is None:
        return x.clone(memory_format=torch.contiguous_format)
    tag = guard.reduced_tag(group, "reduce", x, "sum", f", dst={dst}")  # None for complex
    out, tail = guard.with_tail(x, tag)
    if group.is_nccl:
        yield begin(
            group,
            dist.reduce,
            out,
            dst=group.global_rank(dst),
            op=dist.ReduceOp.SUM,
            group=group.pg,
            async_op=True,
        )
    else:
        opts = options(ReduceOptions, rootRank=dst, rootTensor=0, reduceOp=dist.ReduceOp.SUM)
        moved = real(out)  # a complex sum is the sum of its parts
        yield begin(group, group.pg.reduce, [moved], opts)
    if group.rank != dst:
        return None
    if tag is None:
        return out
    guard.check(out[tail:], tag, group, group.size)
    return leading(out, x.shape)
