"""reduce_scatter: the sum over ranks, each rank keeping its slice of rows."""

from __future__ import annotations

from collections.abc import Sequence

from torch import Tensor

from distgrad._exchange import functional
from distgrad._exchange.backend import reduce_scatter_single
from distgrad._exchange.declare import exchange, rows
from distgrad._exchange.group import Group
from distgrad._exchange.inflight import Steps, begin
from distgrad._exchange.ops.all_to_all import all_to_all

__all__ = ["reduce_scatter"]


@exchange(lambda x, sizes, *, group: rows(x, sizes[group.rank]), traced=functional.reduce_scatter)
def reduce_scatter(x: Tensor, sizes: Sequence[int], *, group: Group) -> Steps[Tensor]:
    """Sum ``x`` over ranks and return this rank's slice (``sizes[rank]`` rows) of the sum."""
    if group.pg is None:
        return x.clone()
    mine = sizes[group.rank]
    if group.is_nccl and all(s == mine for s in sizes):
        out = x.new_empty((mine, *x.shape[1:]))
        yield begin(
            group, reduce_scatter_single, out, x.contiguous(), group=group.pg, async_op=True
        )
        return out
    # One all_to_all (gloo's own below 32 MB), then a local sum, at every size. Not gloo's own
    # reduce-scatter: a wait on its work does not return at the wait's timeout (measured: a
    # 20 ms wait returned when the peer came, 200 ms later), so the dead-peer watch cannot
    # tick. Not an all_reduce and a slice either (what this was below 256 KB per slice): that
    # moves twice the bytes in a ring of 2(N-1) steps, the all_to_all in one; measured raw,
    # paired, it took 1.20x-1.46x of the all_to_all and sum's time on 2 ranks (4-256 KB
    # slices), 1.47x-1.97x on 4 and 2.80x-3.39x on 8 (benchmarks/results/exchanges.md).
    slices: Tensor = yield from all_to_all.steps(x, sizes, [mine] * group.size, group=group)
    # Sum in rank order, the same order on every backend and run: results are reproducible.
    return slices.view(group.size, mine, *x.shape[1:]).sum(0)
