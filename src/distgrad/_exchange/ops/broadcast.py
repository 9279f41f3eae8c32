"""broadcast: one rank's tensor on every rank."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import Tensor
from torch._C._distributed_c10d import BroadcastOptions

from distgrad._exchange import functional, guard
from distgrad._exchange.backend import nbytes, options, real
from distgrad._exchange.declare import exchange, like
from distgrad._exchange.group import Group
from distgrad._exchange.inflight import Steps, begin

__all__ = ["broadcast"]


@exchange(lambda x, src, *, group: like(x, x.shape), traced=functional.broadcast)
def broadcast(x: Tensor, src: int, *, group: Group) -> Steps[Tensor]:
    """Every rank gets group rank ``src``'s ``x`` (other ranks' values are not read)."""
    if group.pg is None:
        return x.clone()
    if not guard.enabled():
        out = (
            x.clone(memory_format=torch.contiguous_format)
            if group.rank == src
            else torch.empty_like(x, memory_format=torch.contiguous_format)
        )
        yield from _broadcast(out, src, group)
        return out
    # Guarded: the source's bytes and its tag in one buffer (the copy the source makes anyway);
    # a receiver's tag bytes start as zeros, which no tag is, so bytes not written mismatch.
    tag = guard.byte_tag(group, "broadcast", x.dtype, x.shape, f"src={src}")
    n = nbytes(x)
    buf = torch.empty(n + guard.BYTES, dtype=torch.uint8, device=x.device)
    if group.rank == src:
        buf[:n].copy_(guard.as_bytes(x))
        buf[n:].copy_(guard.tag_tensor(tag, torch.uint8, x.device))
    else:
        buf[n:].zero_()
    yield from _broadcast(buf, src, group)
    if group.rank != src:
        guard.check(buf[n:], tag, group)
    return buf[:n].view(x.dtype).view(x.shape)


def _broadcast(out: Tensor, src: int, group: Group) -> Steps[None]:
    assert group.pg is not None
    if group.is_nccl:
        yield begin(
            group,
            dist.broadcast,
            out,
            src=group.global_rank(src),
            group=group.pg,
            async_op=True,
        )
    else:
        opts = options(BroadcastOptions, rootRank=src, rootTensor=0)
        moved = real(out)
        yield begin(group, group.pg.broadcast, [moved], opts)
