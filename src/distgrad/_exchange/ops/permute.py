"""permute: each rank sends its tensor to one rank and receives one rank's."""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
from torch import Tensor

from distgrad._exchange import functional, guard
from distgrad._exchange.declare import exchange, like
from distgrad._exchange.group import Group
from distgrad._exchange.inflight import Steps
from distgrad._exchange.pairs import start_pairs

__all__ = ["permute"]


@exchange(lambda x, perm, recv_shape, *, group: like(x, recv_shape), traced=functional.permute)
def permute(
    x: Tensor, perm: Sequence[int], recv_shape: Sequence[int], *, group: Group
) -> Steps[Tensor]:
    """Send ``x`` to group rank ``perm[rank]``; return what the rank that maps here sent."""
    if group.pg is None or perm[group.rank] == group.rank:
        return x.clone()
    source = list(perm).index(group.rank)
    if not guard.enabled():
        out = x.new_empty(tuple(recv_shape))
        yield start_pairs([(x.contiguous(), perm[group.rank])], [(out, source)], group)
        return out
    # Guarded: the sender tags what it sends (its shape), the receiver checks against what it
    # expects (recv_shape); a receiver's tag bytes start as zeros, which no tag is.
    sent_tag = guard.byte_tag(group, "permute", x.dtype, x.shape, "")
    want = guard.byte_tag(group, "permute", x.dtype, recv_shape, "", counted=False)
    n = math.prod(recv_shape) * x.element_size()
    buf = torch.empty(n + guard.BYTES, dtype=torch.uint8, device=x.device)
    buf[n:].zero_()
    sent = guard.tagged([x], sent_tag)
    yield start_pairs([(sent, perm[group.rank])], [(buf, source)], group)
    guard.check(buf[n:], want, group)
    return buf[:n].view(x.dtype).view(tuple(recv_shape))
