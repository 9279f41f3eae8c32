"""torch's functional collectives, as a traced exchange emits them.

While ``torch.compile`` traces, every distgrad exchange is written with
``torch.ops._c10d_functional`` (the C++ ops behind ``torch.distributed._functional_collectives``)
instead of running its eager steps: one family of collectives with torch's own (FSDP2, DTensor,
funcol), which the compiler orders, buckets and overlaps with compute as one. Each call here
emits two nodes, the collective (it starts the exchange and returns its future result) and
``wait_tensor``, placed right after it as funcol places it; inductor's scheduling passes move
the wait down past independent compute.

The forms that torch has no collective for are written with one that it has, chosen to move
no more bytes than the eager exchange does:

* uneven all_gather and reduce_scatter: padded to the largest rank's rows, as NCCL's eager path
  pads them (``all_gather_into_tensor``, ``reduce_scatter_tensor``);
* gather, scatter and a permutation: ``all_to_all_single`` with zero splits to the ranks that
  get nothing (funcol's own ``permute_tensor`` is written this way);
* reduce: an ``all_reduce``, whose result the other ranks drop (torch has no functional reduce;
  on a ring it moves the bytes a reduce-scatter and a gather would).

Every function takes dim-0 layouts as the eager exchanges do and returns the waited result.
These are private torch APIs: present and tested in torch 2.13 (docs/semantics.md).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
from torch import Tensor

from distgrad._exchange.backend import pad_rows, trim_cat
from distgrad._exchange.group import Group, is_rank, own_rows

__all__ = [
    "all_gather",
    "all_reduce",
    "all_to_all",
    "broadcast",
    "gather",
    "permute",
    "reduce",
    "reduce_scatter",
    "scatter",
    "shift",
    "wait",
]

_C = torch.ops._c10d_functional

# distgrad's reduce op names as the functional collectives spell them.
_OPS = {"sum": "sum", "avg": "avg", "prod": "product", "max": "max", "min": "min"}


def wait(x: Tensor) -> Tensor:
    """The node that waits for a functional collective's result."""
    out: Tensor = _C.wait_tensor(x)
    return out


def all_gather(x: Tensor, sizes: Sequence[int], *, group: Group) -> Tensor:
    """Every rank's rows in rank order; uneven sizes padded to the largest on the wire."""
    out = wait(_C.all_gather_into_tensor(pad_rows(x, max(sizes)), group.size, group.name))
    return trim_cat(out, sizes)


def reduce_scatter(x: Tensor, sizes: Sequence[int], *, group: Group) -> Tensor:
    """The sum over ranks of ``x``'s rows, this rank's ``sizes[rank]`` of them."""
    if x.is_complex():  # as all_reduce's
        parts = reduce_scatter(torch.view_as_real(x.contiguous()), sizes, group=group)
        return torch.view_as_complex(parts.contiguous())
    width = max(sizes)
    if any(s != width for s in sizes):
        x = torch.cat([pad_rows(part, width) for part in x.split_with_sizes(list(sizes))])
    out = wait(_C.reduce_scatter_tensor(x.contiguous(), "sum", group.size, group.name))
    return out if all(s == width for s in sizes) else out.narrow(0, 0, own_rows(sizes, group.rank))


def all_reduce(x: Tensor, op: str, *, group: Group) -> Tensor:
    if x.is_complex():  # a sum of complex numbers is the sum of their parts (gloo takes reals)
        return torch.view_as_complex(
            all_reduce(torch.view_as_real(x.contiguous()), op, group=group)
        )
    return wait(_C.all_reduce(x.contiguous(), _OPS[op], group.name))


def reduce(x: Tensor, dst: int, *, group: Group) -> Tensor | None:
    """The sum on ``dst``; None elsewhere (the exchange's declared empty result there)."""
    out = all_reduce(x, "sum", group=group)
    return out if group.rank == dst else None


def broadcast(x: Tensor, src: int, *, group: Group) -> Tensor:
    """``src`` (a group rank, as the functional op takes it) to every rank."""
    return wait(_C.broadcast(x.contiguous(), src, group.name))


def all_to_all(
    x: Tensor, input_sizes: Sequence[int], output_sizes: Sequence[int], *, group: Group
) -> Tensor:
    sent = x.contiguous()
    return wait(_C.all_to_all_single(sent, list(output_sizes), list(input_sizes), group.name))


def gather(x: Tensor, sizes: Sequence[int], dst: int, *, group: Group) -> Tensor | None:
    """Every rank's rows on ``dst`` (an all_to_all that sends only there); None elsewhere."""
    sent = [x.shape[0] if r == dst else 0 for r in range(group.size)]
    got = [size * is_rank(group.rank, dst) for size in sizes]  # sizes on dst, else zeros
    out = all_to_all(x, sent, got, group=group)
    return out if group.rank == dst else None


def scatter(
    x: Tensor | None,
    sizes: Sequence[int],
    src: int,
    trailing: Sequence[int],
    dtype: torch.dtype,
    device: torch.device,
    *,
    group: Group,
) -> Tensor:
    """``sizes[i]`` rows of ``src``'s ``x`` to rank i (an all_to_all that only ``src`` feeds)."""
    if group.rank == src:
        assert x is not None
        sent = list(sizes)
    else:
        # Nothing sent, yet from ``x`` when there is one: in a backward (gather's adjoint) an
        # input made from nothing lets the partitioner hoist the exchange into the forward
        # graph, and the wait, which it must keep, then runs it a second time in the backward.
        nothing = (0, *trailing)
        x = torch.empty(nothing, dtype=dtype, device=device) if x is None else _none_of(x, nothing)
        sent = [0] * group.size
    got = [sizes[group.rank] if r == src else 0 for r in range(group.size)]
    return all_to_all(x, sent, got, group=group)


def permute(x: Tensor, perm: Sequence[int], recv_shape: Sequence[int], *, group: Group) -> Tensor:
    """``x`` to group rank ``perm[rank]``; what the rank that maps here sent, of ``recv_shape``.
    Every rank joins the one collective, a rank that keeps its own tensor too."""
    if all(to == r for r, to in enumerate(perm)):
        return x.clone()
    inverse = [list(perm).index(r) for r in range(group.size)]
    to, source = own_rows(perm, group.rank), own_rows(inverse, group.rank)
    return shift(x[None], [to], [source], recv_shape, group=group)[0]


def shift(
    x: Tensor,
    to: Sequence[int],
    sources: Sequence[int],
    recv_shape: Sequence[int],
    *,
    group: Group,
) -> Tensor:
    """``x[i]`` to group rank ``to[i]``; row j of the result, of ``recv_shape``, from group rank
    ``sources[j]``: point-to-point messages in one ``all_to_all_single`` (so each pair of ranks
    exchanges at most one message each way)."""
    if group.rank_is_data:
        return _shift_by_message(x, to, sources, recv_shape, group)
    assert len(set(to)) == len(to) and len(set(sources)) == len(sources), (to, sources)
    sent, received = math.prod(x.shape[1:]), math.prod(recv_shape)
    input_sizes = [sent if r in to else 0 for r in range(group.size)]
    output_sizes = [received if r in sources else 0 for r in range(group.size)]
    order = sorted(range(len(to)), key=to.__getitem__)  # the messages in rank order
    if order == list(range(len(to))):
        data = x.reshape(-1)
    else:
        data = torch.cat([x[i].reshape(-1) for i in order])
    got = all_to_all(data, input_sizes, output_sizes, group=group).view(len(sources), *recv_shape)
    ranked = sorted(sources)  # got's rows, in rank order
    if ranked == list(sources):
        return got
    return torch.stack([got[ranked.index(s)] for s in sources])


def _shift_by_message(
    x: Tensor, to: Sequence[int], sources: Sequence[int], recv_shape: Sequence[int], group: Group
) -> Tensor:
    """``shift`` where the rank is per-rank data (``Group.rank_is_data``, simulate=True), so
    ``to`` and ``sources`` hold every rank's peers: one ``all_to_all_single`` per message,
    whose splits are arithmetic on them (one message in rank order needs no sorting). Message
    i travels in collective i: every rank's i-th message goes to the rank whose i-th source it
    is, as in a ring's step (each rank sends to rank + 1 what rank + 1 takes from rank - 1)."""
    sent, received = math.prod(x.shape[1:]), math.prod(recv_shape)
    rows = []
    for i, (peer, source) in enumerate(zip(to, sources, strict=True)):
        input_sizes = [sent * is_rank(peer, r) for r in range(group.size)]
        output_sizes = [received * is_rank(source, r) for r in range(group.size)]
        got = all_to_all(x[i].reshape(-1), input_sizes, output_sizes, group=group)
        rows.append(got.view(tuple(recv_shape)))
    return torch.stack(rows)


def _none_of(x: Tensor, shape: Sequence[int]) -> Tensor:
    """An empty tensor of ``shape`` that the graph computes from ``x``."""
    return x.reshape(-1)[:0].view(tuple(shape)).to(x.dtype)
