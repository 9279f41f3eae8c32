"""scatter: one rank's rows split in rank order, each rank receiving its part."""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch import Tensor
from torch._C._distributed_c10d import ScatterOptions

from distgrad._exchange import functional, guard
from distgrad._exchange.backend import on_host, options, pad_rows, real
from distgrad._exchange.declare import exchange
from distgrad._exchange.group import Group
from distgrad._exchange.inflight import Steps, begin

__all__ = ["scatter"]


@exchange(
    lambda x, sizes, src, trailing, dtype, device, *, group: (
        (sizes[group.rank], *trailing),
        dtype,
        device,
    ),
    staged=False,  # its x may be None: it stages itself
    traced=functional.scatter,
)
def scatter(
    x: Tensor | None,
    sizes: Sequence[int],
    src: int,
    trailing: Sequence[int],
    dtype: torch.dtype,
    device: torch.device,
    *,
    group: Group,
) -> Steps[Tensor]:
    """Rank i gets ``sizes[i]`` rows of group rank ``src``'s ``x``, split in rank order."""
    if group.pg is None:
        assert x is not None
        return x.clone()
    if on_host(group, device):  # see "Staging on gloo"
        host = None if x is None else x.cpu()
        cpu = torch.device("cpu")
        out: Tensor = yield from scatter.steps(host, sizes, src, trailing, dtype, cpu, group=group)
        return out.to(device)
    if not guard.enabled():
        out = torch.empty((max(sizes), *trailing), dtype=dtype, device=device)
        return (yield from _scatter(x, sizes, src, out, group))
    # Guarded: the source tags each part with what it sends (its dtype and row shape); each
    # receiver checks against what it expects (``dtype``, ``trailing``).
    args = f"sizes={list(sizes)}, src={src}"
    row = math.prod(trailing) * dtype.itemsize
    tagged = None
    is_src = group.rank == src
    if is_src:  # (other ranks' x, if any, is not read)
        assert x is not None
        sent = guard.byte_tag(group, "scatter", x.dtype, x.shape[1:], args)
        tagged = guard.tagged(torch.split(x, list(sizes)), sent)
    want = guard.byte_tag(group, "scatter", dtype, trailing, args, counted=not is_src)
    pieces = [s * row + guard.BYTES for s in sizes]
    mine = pieces[group.rank]
    bytes_in = torch.empty(max(pieces), dtype=torch.uint8, device=device)
    bytes_in[mine - guard.BYTES : mine].zero_()  # a tag that never arrives reads as zeros
    received = yield from _scatter(tagged, pieces, src, bytes_in, group)
    guard.check(received[mine - guard.BYTES :], want, group)
    data = received[: mine - guard.BYTES]
    return data.view(dtype).view(sizes[group.rank], *trailing)


def _scatter(
    x: Tensor | None, sizes: Sequence[int], src: int, out: Tensor, group: Group
) -> Steps[Tensor]:
    """``scatter``'s exchange into ``out``, ``max(sizes)`` rows: every part padded to that."""
    assert group.pg is not None
    chunks = None
    if group.rank == src:
        assert x is not None
        chunks = [pad_rows(part, out.shape[0]) for part in x.split_with_sizes(sizes)]
    if group.is_nccl:
        yield begin(
            group,
            dist.scatter,
            out,
            chunks,
            src=group.global_rank(src),
            group=group.pg,
            async_op=True,
        )
    else:
        if out.is_complex():
            chunks = [real(c) for c in chunks] if chunks is not None else None
        inputs = [chunks] if chunks is not None else []
        received = real(out)
        opts = options(ScatterOptions, rootRank=src)
        yield begin(group, group.pg.scatter, [received], inputs, opts)
    return out[: sizes[group.rank]]
