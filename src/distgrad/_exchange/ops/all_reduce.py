"""all_reduce: the reduction over ranks, on every rank."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import Tensor

from distgrad._exchange import functional, guard
from distgrad._exchange.backend import ALL_REDUCE_OPTIONS, REDUCE_OPS, leading
from distgrad._exchange.declare import exchange, like
from distgrad._exchange.group import Group
from distgrad._exchange.inflight import Steps, begin

__all__ = ["all_reduce"]


@exchange(lambda x, op, *, group: like(x, x.shape), traced=functional.all_reduce)
def all_reduce(x: Tensor, op: str, *, group: Group) -> Steps[Tensor]:
    """Reduce ``x`` over ranks with ``op`` in sum, prod, max, min; every rank gets the result."""
    if group.pg is None:
        return x.clone(memory_format=torch.contiguous_format)
    tag = guard.reduced_tag(group, "all_reduce", x, op)
    out, tail = guard.with_tail(x, tag)
    if group.is_nccl or out.is_complex():  # torch's wrapper says which ops take complex
        yield begin(group, dist.all_reduce, out, op=REDUCE_OPS[op], group=group.pg, async_op=True)
    else:
        yield begin(group, group.pg.allreduce, [out], ALL_REDUCE_OPTIONS[op])
    if tag is None:
        return out
    guard.check(out[tail:], tag, group, group.size)
    return leading(out, x.shape)
