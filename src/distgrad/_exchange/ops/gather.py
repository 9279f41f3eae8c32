"""gather: every rank's rows concatenated on one rank; an empty slice (0 rows) elsewhere."""

from __future__ import annotations

from collections.abc import Sequence

import torch.distributed as dist
from torch import Tensor
from torch._C._distributed_c10d import GatherOptions

from distgrad._exchange import functional, guard
from distgrad._exchange.backend import options, pad_rows, real, trim_cat
from distgrad._exchange.declare import exchange, no_rows, rows
from distgrad._exchange.group import Group
from distgrad._exchange.inflight import Steps, begin

__all__ = ["gather"]


@exchange(
    lambda x, sizes, dst, *, group: rows(x, sum(sizes) if group.rank == dst else 0),
    empty=no_rows,
    traced=functional.gather,
)
def gather(x: Tensor, sizes: Sequence[int], dst: int, *, group: Group) -> Steps[Tensor | None]:
    """Rank ``dst`` gets every rank's ``x`` concatenated along dim 0; None elsewhere."""
    if group.pg is None:
        return x.clone()
    if not guard.enabled():
        return (yield from _gather(x, sizes, dst, group))
    # Guarded: as all_gather, to one rank.
    tag = guard.byte_tag(group, "gather", x.dtype, x.shape[1:], f"sizes={list(sizes)}, dst={dst}")
    pieces = [s * guard.row_bytes(x) + guard.BYTES for s in sizes]
    received = yield from _gather(guard.tagged([x], tag), pieces, dst, group)
    if received is None:
        return None
    return guard.untagged(received, pieces, tag, group, x, sum(sizes))


def _gather(x: Tensor, sizes: Sequence[int], dst: int, group: Group) -> Steps[Tensor | None]:
    assert group.pg is not None
    width = max(sizes)
    send = pad_rows(x, width)
    out = send.new_empty((group.size * width, *x.shape[1:])) if group.rank == dst else None
    parts = list(out.chunk(group.size)) if out is not None else None
    if group.is_nccl:
        yield begin(
            group,
            dist.gather,
            send,
            parts,
            dst=group.global_rank(dst),
            group=group.pg,
            async_op=True,
        )
    else:
        if send.is_complex():
            parts = [real(p) for p in parts] if parts is not None else None
        outputs = [parts] if parts is not None else []
        sent = real(send)
        opts = options(GatherOptions, rootRank=dst)
        yield begin(group, group.pg.gather, outputs, [sent], opts)
    return trim_cat(out, sizes) if out is not None else None
