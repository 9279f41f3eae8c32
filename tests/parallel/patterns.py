"""The models and per-rank losses the parallel tests check, and deliberately wrong copies.

Everything here is at module level so that it pickles to the checker's ranks. Each loss is
written for ONE rank and returns that rank's share of the global loss (a random cotangent
``v`` dotted with this rank's output rows), so the checker's "summed" contract applies: the
input gradients equal the single-process ones and parameter gradients summed over ranks equal
one process's. With no process group (the checker's reference run) every function is the
whole model on one process.

The ``hand_*`` functions are the hand-written versions docs/patterns.md describes, each with
the mistake such code typically makes; the tests show what the checker says about them.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor, nn

import distgrad as dg
from distgrad import parallel as P
from tests._support import seeded

DT = torch.float64


def rank_and_size() -> tuple[int, int]:
    if dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def near_even(total: int, parts: int) -> list[int]:
    base, extra = divmod(total, parts)
    return [base + (1 if r < extra else 0) for r in range(parts)]


def my_slice(total: int) -> slice:
    """This rank's part of ``total`` features split near-evenly (uneven when it must be)."""
    rank, size = rank_and_size()
    sizes = near_even(total, size)
    start = sum(sizes[:rank])
    return slice(start, start + sizes[rank])


def row_counts(x: Tensor) -> list[int]:
    """Every rank's rows of ``x`` (one small exchange)."""
    _, size = rank_and_size()
    mine = torch.tensor([[x.shape[0]]], dtype=torch.int64)
    return [int(n) for n in dg.all_gather(mine, sizes=[1] * size).view(-1).tolist()]


# -- tensor parallelism --------------------------------------------------------------------

D_MODEL, HIDDEN = 6, 7  # 7 hidden features: an uneven split on 2, 3 and 4 ranks


class MLP(nn.Module):
    """The single-process model: fc2(gelu(fc1(x))); every rank holds a copy and uses a slice."""

    def __init__(self) -> None:
        super().__init__()
        gen = seeded(5)
        self.fc1 = nn.Linear(D_MODEL, HIDDEN, dtype=DT)
        self.fc2 = nn.Linear(HIDDEN, D_MODEL, dtype=DT)
        with torch.no_grad():
            for p in self.parameters():
                p.copy_(torch.randn(p.shape, dtype=DT, generator=gen) * 0.5)


def _tp_mlp(model: MLP, x: Tensor, **options: object) -> Tensor:
    cols = my_slice(HIDDEN)
    h = P.column_parallel_linear(
        x,
        model.fc1.weight[cols],
        model.fc1.bias[cols],
        **options,  # type: ignore[arg-type]
    )
    return P.row_parallel_linear(
        F.gelu(h),
        model.fc2.weight[:, cols],
        model.fc2.bias,
        **options,  # type: ignore[arg-type]
    )


def tp_loss(model: MLP, x: Tensor, v: Tensor) -> Tensor:
    """Sequence parallel (rows sharded), plain tensor parallel (rows replicated by an
    all_gather), and a sequence-parallel region split from replicated rows and gathered again,
    all under the sum contract; this rank's share of the loss."""
    rows = row_counts(x)
    rank, _ = rank_and_size()
    sequence = _tp_mlp(model, x, sequence_parallel=True, sizes=rows)  # [T_r, D]
    everything = dg.all_gather(x, sizes=rows)  # [T, D] on every rank
    start = sum(rows[:rank])
    replicated = _tp_mlp(model, everything)[start : start + rows[rank]]
    # a sequence-parallel region entered from the replicated rows and left again
    mine = P.split_to_sequence(everything, sizes=rows)
    region = P.gather_from_sequence(_tp_mlp(model, mine, sequence_parallel=True, sizes=rows))
    own = region[start : start + rows[rank]]
    return (sequence * v).sum() + 2.0 * (replicated * v).sum() + 3.0 * (own * v).sum()


def tp_megatron_loss(model: MLP, x: Tensor, v: Tensor) -> Tensor:
    """Megatron's replicated contract: every rank computes the same global loss, which counts
    once; plain tensor parallel, and a sequence-parallel region entered with Megatron's
    scatter (split_to_sequence) and left with its gather. The row bias is left out: it would
    get the whole gradient on every rank (Megatron does not sum it over the tensor-parallel
    group), which the checker would sum."""
    everything = dg.all_gather(x, objective="replicated")
    cot = dg.all_gather(v, objective="replicated")
    cols = my_slice(HIDDEN)
    w1, b1, w2 = model.fc1.weight[cols], model.fc1.bias[cols], model.fc2.weight[:, cols]
    h = P.column_parallel_linear(everything, w1, b1, objective="replicated")
    y = P.row_parallel_linear(F.gelu(h), w2, objective="replicated")
    # Megatron's sequence-parallel region: scatter in, gather out (the loss still counts once)
    rows = row_counts(x)
    mine = P.split_to_sequence(everything, sizes=rows, objective="replicated")
    h2 = P.column_parallel_linear(mine, w1, b1, sequence_parallel=True, sizes=rows)
    y2 = P.row_parallel_linear(F.gelu(h2), w2, sequence_parallel=True, sizes=rows)
    y2 = P.gather_from_sequence(y2, sizes=rows, objective="replicated")
    return (y * cot).sum() + 2.0 * (y2 * cot).sum()


class _GatherKeepOwnRows(torch.autograd.Function):
    """A hand-written sequence-parallel gather: its backward keeps this rank's rows of the
    gradient instead of summing every rank's (the local-only GatherLayer)."""

    @staticmethod
    def forward(ctx, x: Tensor) -> Tensor:  # type: ignore[no-untyped-def]
        rank, size = rank_and_size()
        ctx.rank, ctx.rows = rank, x.shape[0]
        if size == 1:
            return x.clone()
        parts = [torch.empty_like(x) for _ in range(size)]
        dist.all_gather(parts, x.contiguous())
        return torch.cat(parts)

    @staticmethod
    def backward(ctx, grad: Tensor) -> Tensor:  # type: ignore[no-untyped-def]
        return grad[ctx.rank * ctx.rows : (ctx.rank + 1) * ctx.rows].clone()


def hand_tp_loss(model: MLP, x: Tensor, v: Tensor) -> Tensor:
    """Sequence parallelism with the hand-written gather (even shards, as it requires)."""
    cols = my_slice(HIDDEN)
    h = F.linear(_GatherKeepOwnRows.apply(x), model.fc1.weight[cols], model.fc1.bias[cols])
    partial = F.linear(F.gelu(h), model.fc2.weight[:, cols])
    y = P.reduce_scatter_to_sequence(partial) + model.fc2.bias
    return (y * v).sum()


# -- mixture of experts ----------------------------------------------------------------------

EXPERTS = 5
CAPACITY = 3  # assignments an expert takes from the global batch: some are dropped


class MoE(nn.Module):
    """A router and EXPERTS small experts; every rank holds a copy and runs its own experts."""

    def __init__(self) -> None:
        super().__init__()
        gen = seeded(6)
        self.router = nn.Linear(D_MODEL, EXPERTS, bias=False, dtype=DT)
        self.experts = nn.ModuleList(nn.Linear(D_MODEL, D_MODEL, dtype=DT) for _ in range(EXPERTS))
        with torch.no_grad():
            for p in self.parameters():
                p.copy_(torch.randn(p.shape, dtype=DT, generator=gen))


def moe_layer(model: MoE, x: Tensor, routing: P.Routing) -> Tensor:
    rows = P.dispatch(x, routing)
    parts = rows.split(routing.expert_sizes)
    experts = [model.experts[e] for e in routing.local_experts]
    outs = [torch.tanh(f(part)) for f, part in zip(experts, parts, strict=True)]
    return P.combine(torch.cat(outs) if outs else x.new_zeros(0, D_MODEL), routing)


def moe_loss(model: MoE, x: Tensor, v: Tensor) -> Tensor:
    """Two steps whose routing differs: top-2 with a capacity that drops tokens, then top-1 of
    other inputs with every expert on the last rank (the others hold none)."""
    _, size = rank_and_size()
    first = P.route(model.router(x), 2, capacity=CAPACITY)
    y1 = moe_layer(model, x, first)
    x2 = torch.sin(3.0 * x)
    skewed = [0] * (size - 1) + [EXPERTS]
    second = P.route(model.router(x2), 1, experts_per_rank=skewed)
    y2 = moe_layer(model, x2, second)
    return (y1 * v).sum() + (y2 * v.flip(1)).sum()


class _AllToAll(torch.autograd.Function):
    """all_to_all_single with autograd, as hand-written MoE code wraps it (this part is right:
    the backward sends each row's gradient back with the split sizes swapped)."""

    @staticmethod
    def forward(ctx, x: Tensor, send: list[int], recv: list[int]) -> Tensor:  # type: ignore[no-untyped-def]
        ctx.send, ctx.recv = send, recv
        out = x.new_empty((sum(recv), *x.shape[1:]))
        dist.all_to_all_single(out, x.contiguous(), recv, send)
        return out

    @staticmethod
    def backward(ctx, grad: Tensor) -> tuple[Tensor, None, None]:  # type: ignore[no-untyped-def]
        back = grad.new_empty((sum(ctx.send), *grad.shape[1:]))
        dist.all_to_all_single(back, grad.contiguous(), ctx.send, ctx.recv)
        return back, None, None


def _exchange(x: Tensor, send: list[int], recv: list[int]) -> Tensor:
    return x if not dist.is_initialized() else _AllToAll.apply(x, send, recv)


def hand_moe_loss(model: MoE, x: Tensor, v: Tensor) -> Tensor:
    """Hand-written top-2 MoE with the usual local capacity rule: each rank keeps at most
    ``capacity / N`` of its own assignments per expert, which drops other tokens than one
    process with ``capacity`` does."""
    _, size = rank_and_size()
    top_w, top_e = torch.softmax(model.router(x), -1).topk(2, -1)
    top_w = top_w / top_w.sum(-1, keepdim=True)
    flat = top_e.reshape(-1)
    place = (F.one_hot(flat, EXPERTS).cumsum(0) - 1).gather(1, flat[:, None]).squeeze(1)
    kept = torch.nonzero(place < math.ceil(CAPACITY / size)).squeeze(1)
    order = kept[torch.argsort(flat[kept], stable=True)]
    owner = torch.repeat_interleave(torch.arange(size), torch.tensor(near_even(EXPERTS, size)))
    send = torch.bincount(owner[flat[order]], minlength=size)
    recv = send.clone()
    if dist.is_initialized():
        dist.all_to_all_single(recv, send)
    send_l, recv_l = send.tolist(), recv.tolist()
    rows = _exchange(x[order // 2], send_l, recv_l)
    ids = flat[order].clone()
    got_ids = ids.new_empty(sum(recv_l))
    if dist.is_initialized():
        dist.all_to_all_single(got_ids, ids, recv_l, send_l)
    else:
        got_ids = ids
    out = torch.zeros_like(rows)
    for e in range(EXPERTS):
        mine = torch.nonzero(got_ids == e).squeeze(1)
        if len(mine):
            out = out.index_add(0, mine, torch.tanh(model.experts[e](rows[mine])))
    back = _exchange(out, recv_l, send_l)
    weighted = back * top_w.reshape(-1)[order][:, None]
    y = torch.zeros_like(x).index_add(0, order // 2, weighted)
    return (y * v).sum()


# -- ring attention --------------------------------------------------------------------------


def ring_loss(q: Tensor, k: Tensor, v: Tensor, cot: Tensor) -> Tensor:
    """Ring attention over the sequence (dim 2 of [B, H, S, D]), without and with the causal
    mask, and on 3-d inputs with a narrower value head."""
    full = P.ring_attention(q, k, v)  # [B, H, S_r, D]: blocks through torch's fused kernel
    causal = P.ring_attention(q, k, v, causal=True, scale=0.7)
    narrow = P.ring_attention(q[0], k[0], v[0, ..., :2], causal=True)  # 3-d, Dv != D: matmuls
    return (full * cot).sum() + (causal * cot.roll(1, -1)).sum() + (narrow * cot[1, ..., :2]).sum()


def _pass_on(block: Tensor) -> Tensor:
    """Send ``block`` to the next rank with raw torch.distributed point-to-point calls."""
    rank, size = rank_and_size()
    received = torch.empty_like(block)
    ops = [
        dist.P2POp(dist.isend, block.contiguous(), (rank + 1) % size),
        dist.P2POp(dist.irecv, received, (rank - 1) % size),
    ]
    for request in dist.batch_isend_irecv(ops):
        request.wait()
    return received


def hand_ring_loss(q: Tensor, k: Tensor, v: Tensor, cot: Tensor) -> Tensor:
    """Hand-written ring attention (even blocks): the blocks travel with raw point-to-point
    calls, so autograd sees the received keys and values as constants, and no gradient goes
    back to their owners."""
    _, size = rank_and_size()
    scores, values = [], []
    kb, vb = k, v
    for step in range(size):
        if step > 0:
            kb, vb = _pass_on(kb.detach()), _pass_on(vb.detach())
        scores.append(q @ kb.transpose(-1, -2) / math.sqrt(q.shape[-1]))
        values.append(vb)
    weights = torch.softmax(torch.cat(scores, -1), -1)
    out = weights @ torch.cat(values, -2)  # the order of blocks does not matter without a mask
    return (out * cot).sum()


# -- synchronized batch norm ---------------------------------------------------------------


class Norms(nn.Module):
    """A 2d and a 1d synchronized batch norm (with no process group: torch's batch norm)."""

    def __init__(self) -> None:
        super().__init__()
        gen = seeded(7)
        self.image = P.SyncBatchNorm(3, dtype=DT)
        self.flat = P.SyncBatchNorm(4, momentum=None, dtype=DT)
        with torch.no_grad():
            for p in self.parameters():
                p.copy_(1.0 + 0.3 * torch.randn(p.shape, dtype=DT, generator=gen))


def bn_loss(model: Norms, image: Tensor, flat: Tensor, v: Tensor) -> Tensor:
    """image [B, 3, 2, 2] and flat [B, 4]; v [B, 4] also weights the image's channels."""
    y_image = model.image(image)
    y_flat = model.flat(flat)
    return (y_image * v[:, :3, None, None]).sum() + (y_flat * v).sum()


def hand_bn_loss(model: Norms, image: Tensor, flat: Tensor, v: Tensor) -> Tensor:
    """A hand-written synchronized batch norm: each rank's mean and variance averaged over
    ranks with equal weights (right only when every rank has as many rows)."""
    del image
    mean = dg.all_reduce(flat.mean(0), "avg")
    var = dg.all_reduce(((flat - mean) ** 2).mean(0), "avg")
    y = (flat - mean) / torch.sqrt(var + model.flat.eps) * model.flat.weight + model.flat.bias
    return (y * v).sum()
