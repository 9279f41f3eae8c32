"""Ring attention: exact softmax attention over a sequence split in blocks across the ranks.

Legend: ``N`` ranks; rank r holds the ``S_r`` consecutive positions starting at
``o_r = S_0 + ... + S_{r-1}`` (uneven and empty blocks allowed); ``q`` ``[..., S_r, D]``,
``k`` ``[..., S_r, D]``, ``v`` ``[..., S_r, Dv]``; ``lse`` the log-sum-exp of a query's scores.

Algorithm (the queries stay, the keys and values travel): at step t rank r computes on the
key and value block of rank ``(r - t) mod N`` and folds it into its running softmax (the
maximum, the sum of exponentials and the weighted values, rescaled when the maximum grows).
The blocks move on the one ring driver of distgrad (``distgrad._exchange.ring``): each block
arrives a step before its compute, so the next exchange is in flight while this block
computes. With ``causal``, a block that lies wholly after this rank's queries is passed on
without computing (its scores are all masked), and the block of the rank itself is masked on
and above the diagonal.

Each block goes through torch's fused CPU attention kernel when it can (float32 or float64,
``Dv == D``: a tiled kernel that returns the block's log-sum-exp and never holds its
``[S_r, S_block]`` scores), through plain matmuls otherwise; the blocks' partial outputs are
merged by their log-sum-exps.

The backward recomputes each block from the saved output and log-sum-exp (as FlashAttention
does) and sends the blocks round the same ring again, each followed one step behind by its
gradient accumulator: every rank adds its queries' contribution to the block's ``dk`` and
``dv`` once it has computed on the block, and the accumulator's last exchange brings it home
to the block's owner.

Choice: a custom autograd function, not a composition of differentiable ``dg.permute`` calls.
A composition would keep every block that went round the ring (all of K and V, and every
block's probabilities) for the backward; this keeps only this rank's ``q``, ``k``, ``v``, the
output and ``lse``, plus the blocks in flight (one exchange at a time). It is not twice
differentiable.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor
from torch.autograd.function import FunctionCtx, once_differentiable

from distgrad._exchange.group import Group
from distgrad._exchange.ring import Ring, run
from distgrad._mesh import GroupLike
from distgrad.collectives.all_gather import all_gather
from distgrad.parallel._checks import RING_ATTENTION, as_process_group

__all__ = ["ring_attention"]


@dataclass(frozen=True)
class _Plan:
    group: Group
    sizes: tuple[int, ...]  # every rank's S_r
    causal: bool
    scale: float

    @property
    def rank(self) -> int:
        return self.group.rank

    def holder(self, step: int) -> int:
        """Whose block this rank holds at ``step``."""
        return (self.rank - step) % len(self.sizes)

    def offset(self, rank: int) -> int:
        return sum(self.sizes[:rank])

    def masked_out(self, block: int) -> bool:
        """True when no score of ``block`` survives: causal and wholly after the queries, or
        an empty block or query set."""
        if self.sizes[block] == 0 or self.sizes[self.rank] == 0:
            return True
        return (
            self.causal and self.offset(block) > self.offset(self.rank) + self.sizes[self.rank] - 1
        )

    def mask(self, block: int, device: torch.device) -> Tensor | None:
        """[S_r, S_block] True where a key comes after its query; None when none does."""
        if not self.causal or self.offset(block) + self.sizes[block] - 1 <= self.offset(self.rank):
            return None
        queries = self.offset(self.rank) + torch.arange(self.sizes[self.rank], device=device)
        keys = self.offset(block) + torch.arange(self.sizes[block], device=device)
        return keys[None, :] > queries[:, None]


def _ring(plan: _Plan, kv: Tensor, acc: bool) -> Ring:
    """The ring of the key and value blocks ([..., S_j, D + Dv] for rank j), each with its
    gradient accumulator of the same shape in the backward (``acc``)."""

    def shape(rank: int) -> tuple[int, ...]:
        return (*kv.shape[:-2], plan.sizes[rank], kv.shape[-1])

    return Ring(plan.group, shape, shape if acc else None)


def _scores(q: Tensor, k: Tensor, plan: _Plan, block: int) -> Tensor:
    s = torch.matmul(q, k.transpose(-1, -2)) * plan.scale  # [..., S_r, S_block]
    mask = plan.mask(block, q.device)
    return s if mask is None else s.masked_fill(mask, -math.inf)


def _fused(q: Tensor, k: Tensor, v: Tensor) -> bool:
    """Whether a block can go through torch's fused CPU attention kernel (FlashAttention-style,
    tiled: no [S_r, S_block] scores in memory), which also returns the log-sum-exp."""
    return (
        q.device.type == "cpu"
        and q.dtype in (torch.float32, torch.float64)
        and k.shape[-1] == v.shape[-1]  # the kernel needs one head size
    )


def _as_4d(t: Tensor) -> Tensor:
    return t if t.dim() == 4 else t.reshape(-1, 1, *t.shape[-2:])


def _block_forward(
    q: Tensor, k: Tensor, v: Tensor, plan: _Plan, block: int
) -> tuple[Tensor, Tensor]:
    """One block's attention output [..., S_r, Dv] and log-sum-exp [..., S_r]."""
    if _fused(q, k, v):
        # A causal block is this rank's own: square, masked above the diagonal.
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
            _as_4d(q),
            _as_4d(k),
            _as_4d(v),
            0.0,
            plan.mask(block, q.device) is not None,
            scale=plan.scale,
        )
        return out.reshape(*q.shape[:-1], v.shape[-1]), lse.reshape(q.shape[:-1])
    s = _scores(q, k, plan, block)
    top = s.amax(-1, keepdim=True)  # every row keeps a key: its own position at least
    p = torch.exp(s - top)
    total = p.sum(-1, keepdim=True)
    return torch.matmul(p, v) / total, (top + total.log()).squeeze(-1)


def _block_backward(
    q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, dout: Tensor, plan: _Plan, block: int
) -> tuple[Tensor, Tensor, Tensor]:
    """One block's share of (dq, dk, dv), given the *whole* output and log-sum-exp."""
    if _fused(q, k, v):
        grads = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
            _as_4d(dout),
            _as_4d(q),
            _as_4d(k),
            _as_4d(v),
            _as_4d(out),
            lse.reshape(_as_4d(q).shape[:-1]),
            0.0,
            plan.mask(block, q.device) is not None,
            scale=plan.scale,
        )
        return tuple(g.reshape(t.shape) for g, t in zip(grads, (q, k, v), strict=True))  # type: ignore[return-value]
    p = torch.exp(_scores(q, k, plan, block) - lse[..., None])  # [..., S_r, S_block]
    delta = (dout * out).sum(-1, keepdim=True)  # [..., S_r, 1]: rowsum(dO * O)
    ds = p * (torch.matmul(dout, v.transpose(-1, -2)) - delta) * plan.scale
    dv = torch.matmul(p.transpose(-1, -2), dout)
    return torch.matmul(ds, k), torch.matmul(ds.transpose(-1, -2), q), dv


def _forward(q: Tensor, k: Tensor, v: Tensor, plan: _Plan) -> tuple[Tensor, Tensor]:
    """Fold the blocks into one softmax as they come round (``distgrad._exchange.ring``: the
    next block in flight while this one computes): (output, lse)."""
    dk = k.shape[-1]
    out = q.new_zeros((*q.shape[:-1], v.shape[-1]))
    lse = q.new_full(q.shape[:-1], -math.inf)  # [..., S_r]: no key seen yet
    kv = torch.cat([k, v], dim=-1)  # one message per step

    def compute(step: int, block: int, held: Tensor) -> None:
        nonlocal out, lse
        if plan.masked_out(block):
            return
        part, part_lse = _block_forward(q, held[..., :dk], held[..., dk:], plan, block)
        new = torch.logaddexp(lse, part_lse)
        # Rescale both to the new total; the running part's weight is 0 before any block.
        out = out * torch.exp(lse - new)[..., None] + part * torch.exp(part_lse - new)[..., None]
        lse = new

    run(_ring(plan, kv, acc=False), kv, compute)
    return out, lse


def _backward(
    q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, dout: Tensor, plan: _Plan
) -> tuple[Tensor, Tensor, Tensor]:
    """The blocks round again, each followed by its gradient accumulator ``[dk | dv]``, which
    every rank adds its queries' part to and which comes home complete."""
    dk_width = k.shape[-1]
    dq = torch.zeros_like(q)
    kv = torch.cat([k, v], dim=-1)

    def compute(step: int, block: int, held: Tensor) -> Tensor | None:
        nonlocal dq
        if plan.masked_out(block):
            return None
        kb, vb = held[..., :dk_width], held[..., dk_width:]
        dqb, dkb, dvb = _block_backward(q, kb, vb, out, lse, dout, plan, block)
        dq = dq + dqb
        return torch.cat([dkb, dvb], -1)

    grads = run(_ring(plan, kv, acc=True), kv, compute)
    assert grads is not None
    # Two tensors of their own, not views of one.
    return dq, grads[..., :dk_width].clone(), grads[..., dk_width:].clone()


class _RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx: FunctionCtx, q: Tensor, k: Tensor, v: Tensor, plan: _Plan) -> Tensor:
        out, lse = _forward(q, k, v, plan)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.plan = plan  # type: ignore[attr-defined]
        return out  # type: ignore[no-any-return]

    @staticmethod
    @once_differentiable
    def backward(ctx: Any, dout: Tensor) -> tuple[Tensor, Tensor, Tensor, None]:
        q, k, v, out, lse = ctx.saved_tensors
        plan: _Plan = ctx.plan
        dout = dout.contiguous()
        dq, dk, dv = _backward(q, k, v, out, lse, dout, plan)
        return dq, dk, dv, None


def ring_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    group: GroupLike = None,
    *,
    causal: bool = False,
    scale: float | None = None,
    sizes: Sequence[int] | None = None,
) -> Tensor:
    """Softmax attention of this rank's queries over every rank's keys and values.

    ``q``, ``k`` ``[..., S_r, D]`` and ``v`` ``[..., S_r, Dv]`` are this rank's block of the
    sequence (dim -2); the ranks hold consecutive blocks in rank order, as the whole sequence
    split by ``sizes`` (every rank's ``S_r``; uneven and empty blocks allowed; without it the
    ranks exchange their lengths first; inside ``torch.compile`` pass it). Leading dims
    (batch, heads) must match across ranks.
    Returns ``[..., S_r, Dv]``: this rank's rows of
    ``scaled_dot_product_attention(Q, K, V, is_causal=causal, scale=scale)`` on the whole
    sequence (``scale`` defaults to ``1/sqrt(D)``; ``causal`` masks keys after their query by
    global position). Inputs are not modified.

    Gradient (the objective is the sum over ranks of what each rank back-propagates): ``q``
    gets this rank's rows; ``k`` and ``v`` get the sum over every rank's queries of their
    terms. Not twice differentiable.

    Communication (each exchange overlapped with a block's compute): forward N-1 sends and
    receives of a [..., S, D + Dv] block; backward N+1 exchanges, the blocks N-1 times and
    their accumulators [..., S, D + Dv] N times; plus the length exchange when ``sizes`` is
    not given. Memory: the saved inputs, output and lse, and the
    blocks in flight; never the whole K or V.

    Args:
        q: this rank's queries, ``[..., S_r, D]``.
        k: this rank's keys, ``[..., S_r, D]``.
        v: this rank's values, ``[..., S_r, Dv]``.
        group: the tensor- or sequence-parallel group (default: the default group) or a DeviceMesh
            dimension.
        causal: mask the keys after each query, by global position.
        scale: the logits' scale (default ``1/sqrt(D)``).
        sizes: every rank's block length ``S_r``; given, no lengths are exchanged.

    Returns:
        ``[..., S_r, Dv]``: this rank's rows of attention over the whole sequence.

    Raises:
        CollectiveArgumentError: ``q``, ``k`` and ``v`` whose dims do not fit, ``sizes`` not every
            rank's length; raised on every rank of the group.
        CollectiveMismatchError: leading dims that differ across ranks (while checked).
        torch.distributed.DistBackendError: a peer died or never came (docs/faults.md).

    Example:
        >>> g = torch.Generator().manual_seed(0)
        >>> q, k, v = torch.randn(3, 1, 2, 5, 4, generator=g)  # [batch, heads, S, D]
        >>> out = dg.parallel.ring_attention(q, k, v, causal=True)  # one rank: the whole sequence
        >>> want = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        >>> torch.allclose(out, want, atol=1e-6)
        True
    """
    call = RING_ATTENTION.bind(group, q, k=k, v=v, sizes=sizes)
    group, g = as_process_group(group, "ring_attention"), call.group
    if sizes is None and g.size > 1 and torch.compiler.is_compiling():
        raise call.error(
            "inside torch.compile, pass sizes= (every rank's sequence length): the lengths "
            "cannot be exchanged within a graph"
        )
    if sizes is None:
        mine = torch.tensor([[q.shape[-2]]], dtype=torch.int64, device=q.device)
        sizes = [int(n) for n in all_gather(mine, group, sizes=[1] * g.size).view(-1).tolist()]
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    plan = _Plan(g, tuple(sizes), causal, scale)
    return _RingAttention.apply(q, k, v, plan)  # type: ignore[no-untyped-call,no-any-return]
