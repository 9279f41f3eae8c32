"""all_gather: every rank's rows, concatenated in rank order, on every rank."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from distgrad._exchange import functional, guard
from distgrad._exchange.backend import (
    ALL_GATHER_OPTIONS,
    all_gather_single,
    pad_rows,
    trim_cat,
    use_gloo_all_gather,
)
from distgrad._exchange.declare import exchange, rows
from distgrad._exchange.group import Group
from distgrad._exchange.inflight import Steps, begin
from distgrad._exchange.pairs import exchange_by_pairs

__all__ = ["all_gather"]


@exchange(lambda x, sizes, *, group: rows(x, sum(sizes)), traced=functional.all_gather)
def all_gather(x: Tensor, sizes: Sequence[int], *, group: Group) -> Steps[Tensor]:
    """Concatenate every rank's ``x`` along dim 0; ``sizes[i]`` is rank i's row count."""
    if group.pg is None:
        return x.clone()
    if not guard.enabled():
        return (yield from _all_gather(x, sizes, group))
    # Guarded (distgrad._exchange.guard): each rank's rows travel as bytes followed by its
    # 8-byte tag, gathered as byte pieces of sizes[i] * row + 8, compacted after the tags are read.
    tag = guard.byte_tag(group, "all_gather", x.dtype, x.shape[1:], f"sizes={list(sizes)}")
    pieces = [s * guard.row_bytes(x) + guard.BYTES for s in sizes]
    received = yield from _all_gather(guard.tagged([x], tag), pieces, group)
    return guard.untagged(received, pieces, tag, group, x, sum(sizes))


def _all_gather(x: Tensor, sizes: Sequence[int], group: Group) -> Steps[Tensor]:
    assert group.pg is not None
    if not group.is_nccl:
        out = x.new_empty((sum(sizes), *x.shape[1:]))
        mine = x.contiguous()
        if use_gloo_all_gather(mine, sizes):
            yield begin(group, group.pg._allgather_base, out, mine, ALL_GATHER_OPTIONS)
            return out
        blocks = torch.split(out, list(sizes))  # views into ``out``, each contiguous
        yield from exchange_by_pairs([mine] * group.size, blocks, group)
        return out
    width = max(sizes)
    send = pad_rows(x, width)
    out = send.new_empty((width * group.size, *x.shape[1:]))
    yield begin(group, all_gather_single, out, send, group=group.pg, async_op=True)
    return trim_cat(out, sizes)
