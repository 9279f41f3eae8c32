"""Blockwise ring reductions: a row reduction over the global logits, never materialised.

Legend: ``n`` this rank's anchors, ``m_r`` rank r's keys (padded to ``M = max_r m_r`` on the
wire), ``D`` the embedding dim, ``W`` the group size, ``b`` the block size, ``s`` the scale.

For local anchors ``a`` [n, D] and the keys of every rank ``k_r`` [m_r, D], with logits
``l_ij = s <a_i, k_j> (+ bias)`` over all global keys ``j``, :func:`ring_reduce` returns [n]:

* ``kind="lse"``: ``logsumexp_j l_ij`` (with ``mask_self``: column j = i of this rank's own
  keys is left out, for NT-Xent where the anchors are the keys);
* ``kind="softplus"``: ``sum_j softplus(l_ij + bias)`` (SigLIP with every pair a negative).

Algorithm (the keys travel, the anchors stay): a bidirectional ring, as open_clip's
SigLIP ``bidir``. Two copies of every rank's keys travel, one towards rank + 1 and one
towards rank - 1; after step t this rank holds the keys of ranks (rank - t) and (rank + t)
mod W, so W // 2 steps visit every rank once (the copy going left stops after (W - 1) // 2
steps, where the two would meet). The keys held are folded in ``b`` columns at a time
(``logaddexp`` of chunk logsumexps, or a running sum), each step's shift started first. The
backward recomputes each chunk's logits and sends each copy of the keys round again
*together with its gradient accumulator*: every rank adds its anchors' contribution, and after
the last step each accumulator goes straight back to the rank that owns the keys.

Gradient (the objective is the sum over ranks of what each rank back-propagates): the
gradient of the keys is the sum over every rank's anchors, as for ``all_gather``; ``a``,
``scale`` and ``bias`` get this rank's part only.

Communication: forward W // 2 exchanges, each sending (and receiving) one or two [M, D]
blocks, one to each neighbour (each overlapped with the blocks held being computed);
backward W // 2 exchanges of one or two [M, 2D] blocks and one of one or two [M, D] (the
accumulators going home). Against one direction (W - 1 shifts forward, W backward) the same
bytes cross in half the steps: each step waits for the slower of a pair of neighbours, and on
an oversubscribed machine every step can cost a time slice. Compute: forward one [n, m_r]
matmul per rank, backward three (recompute, anchor gradient, key gradient). Memory: the
saved inputs, two or three key blocks with their accumulators, and at most two [n, b]
logit chunks, never [n, sum m_r]. ``clip_loss``'s ring (:func:`ring_clip`) stays
one-directional: its texts' column logsumexps travel with the blocks.
Not twice differentiable.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.autograd.function import FunctionCtx, once_differentiable

from distgrad._exchange import ops
from distgrad._exchange.group import Group, own_rows

__all__ = ["KINDS", "ring_clip", "ring_reduce"]

KINDS = ("lse", "softplus")

# The travelling copies of ``ring_reduce``'s keys, stacked in this order ([1 or 2, M, ...]): the
# one going to rank + 1, then (from 3 ranks) the one going to rank - 1.
_SIDES = ("right", "left")


@dataclass(frozen=True)
class _Plan:
    group: Group
    rows: tuple[int, ...]  # key rows of every rank (group rank order)
    block: int
    kind: str
    mask_self: bool

    def rows_of(self, rank: int) -> int:
        """Rank ``rank``'s key rows (arithmetic on a per-rank rank: ``own_rows``)."""
        return own_rows(self.rows, rank)

    def source(self, step: int) -> int:
        """The rank whose keys this rank holds after ``step`` shifts."""
        return (self.group.rank - step) % self.group.size

    @property
    def right_steps(self) -> int:
        """Shifts of the copies that travel to rank + 1 (``ring_reduce``'s bidirectional ring)."""
        return self.group.size // 2

    @property
    def left_steps(self) -> int:
        """Shifts of the copies that travel to rank - 1: together, every other rank once."""
        return (self.group.size - 1) // 2

    def owner(self, side: str, step: int) -> int:
        """The rank whose keys the copy travelling to ``side`` holds after ``step`` shifts."""
        return (self.group.rank + (-step if side == "right" else step)) % self.group.size


def _travel(copies: Tensor, step: int, plan: _Plan) -> ops.InFlight[Tensor]:
    """Start the ``step``-th shift of the travelling copies (``[1 or 2, M, ...]``, in
    ``_SIDES`` order), both directions at once: the ``"right"`` copy to rank + 1 (a new one
    arrives from rank - 1), the ``"left"`` copy to rank - 1 while it still has steps to go.
    Its ``wait`` gives the arriving copies, in the same order (the right one alone once the
    left one has stopped)."""
    g = plan.group
    after, before = (g.rank + 1) % g.size, (g.rank - 1) % g.size
    moving = 2 if len(copies) == 2 and step <= plan.left_steps else 1
    to, sources = [after, before][:moving], [before, after][:moving]
    return ops.shift.start(copies[:moving], to, sources, copies.shape[1:], group=g)


def _chunk_logits(a: Tensor, k: Tensor, scale: Tensor, bias: Tensor) -> tuple[Tensor, Tensor]:
    """(raw similarities [n, b], logits [n, b] = scale * raw + bias)."""
    raw = a @ k.T
    return raw, torch.addcmul(bias, raw, scale)


def _mask_diagonal(logits: Tensor, start: int) -> None:
    """Drop anchor i against own key i (global column ``start + c`` of this chunk), in place:
    the entries ``(start + c, c)``, a diagonal. (Indexing them would copy a host index tensor
    to the device, a host synchronisation on CUDA.)"""
    logits.diagonal(offset=-start).fill_(float("-inf"))


def _forward_block(a: Tensor, k: Tensor, s: Tensor, bias: Tensor, plan: _Plan, own: bool) -> Tensor:
    out = a.new_full((a.shape[0],), float("-inf") if plan.kind == "lse" else 0.0)
    for start in range(0, k.shape[0], plan.block):
        _, logits = _chunk_logits(a, k[start : start + plan.block], s, bias)  # [n, b]
        if plan.kind == "lse":
            if own and plan.mask_self:
                _mask_diagonal(logits, start)
            out = torch.logaddexp(out, logits.logsumexp(1))
        else:
            out += F.softplus(logits).sum(1)
    return out


def _reduce_forward(a: Tensor, k: Tensor, scale: Tensor, bias: Tensor, plan: _Plan) -> Tensor:
    """The bidirectional ring: the own keys at step 0, then at step t the keys of rank - t
    (the copy travelling right) and of rank + t (travelling left), W // 2 steps in all. Each
    step's shift is started before the keys held are folded in."""
    width = max(plan.rows)
    own = F.pad(k, (0, 0, 0, width - k.shape[0]))  # [M, D]
    copies = own.expand(2 if plan.left_steps else 1, *own.shape)  # [1 or 2, M, D]
    held = [(own, plan.group.rank)]
    out = a.new_full((a.shape[0],), float("-inf") if plan.kind == "lse" else 0.0)
    for step in range(plan.right_steps + 1):
        moving = _travel(copies, step + 1, plan) if step < plan.right_steps else None
        for keys, owner in held:
            part = _forward_block(a, keys[: plan.rows_of(owner)], scale, bias, plan, step == 0)
            out = torch.logaddexp(out, part) if plan.kind == "lse" else out + part
        if moving is not None:
            copies = moving.wait()
            landed = zip(_SIDES, copies, strict=False)
            held = [(buf, plan.owner(side, step + 1)) for side, buf in landed]
    return out


def _backward_block(
    a: Tensor,
    held: Tensor,
    rows: int,
    scale: Tensor,
    bias: Tensor,
    out: Tensor,
    grad: Tensor,
    plan: _Plan,
    own: bool,
    sums: tuple[Tensor, Tensor, Tensor],
) -> None:
    """Fold one rank's keys into the gradients, in place: the anchors', scale's and bias's
    (``sums``) and the keys' accumulator that travels with them (``held``: [M, 2D])."""
    da, ds, db = sums
    dim = a.shape[1]
    keys, acc = held[:rows, :dim], held[:rows, dim:]
    for start in range(0, rows, plan.block):
        kb = keys[start : start + plan.block]
        raw, w = _chunk_logits(a, kb, scale, bias)  # w: [n, b], becomes dL/dlogits
        if plan.kind == "lse":
            if own and plan.mask_self:
                _mask_diagonal(w, start)
            w.sub_(out[:, None]).exp_()
        else:
            w.sigmoid_()
        w.mul_(grad[:, None])
        ds += torch.vdot(w.flatten(), raw.flatten())
        db += w.sum()
        w.mul_(scale)  # dL/draw; a tensor, never read on the host (no synchronisation)
        da.addmm_(w, kb)
        acc[start : start + plan.block].addmm_(w.T, a)


def _reduce_backward(
    a: Tensor, k: Tensor, scale: Tensor, bias: Tensor, out: Tensor, grad: Tensor, plan: _Plan
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """The forward's ring again, each copy of the keys travelling with a gradient accumulator
    ([M, 2D]) that every rank it visits adds to (the copy going right starts with this rank's
    own part); after the last step each accumulator goes straight home (one exchange), where
    the owner adds them up."""
    g, width, dim = plan.group, max(plan.rows), k.shape[1]
    sums = torch.zeros_like(a), torch.zeros_like(scale), torch.zeros_like(bias)
    padded = F.pad(k, (0, 0, 0, width - k.shape[0]))
    # [1 or 2, M, 2D]: keys | accumulator, per travelling copy (the left one starts at zero).
    # This rank's own part goes into the accumulator of the copy that travels right and comes
    # home with the others' parts. So the first shift carries what the incoming gradient made:
    # in a compiled step, a shift computed from the keys alone would be hoisted into the
    # forward graph by the partitioner, its result kept alive until the backward (and run
    # again there).
    copies = torch.cat([padded, torch.zeros_like(padded)], 1).repeat(
        2 if plan.left_steps else 1, 1, 1
    )
    _backward_block(a, copies[0], len(k), scale, bias, out, grad, plan, True, sums)
    last = dict(zip(_SIDES, copies, strict=False))  # each copy where its last shift left it
    for step in range(1, plan.right_steps + 1):
        copies = _travel(copies, step, plan).wait()
        for side, held in zip(_SIDES, copies, strict=False):
            last[side] = held
            owner = plan.owner(side, step)
            _backward_block(a, held, plan.rows_of(owner), scale, bias, out, grad, plan, False, sums)
    dk = copies[0][: len(k), dim:]
    if g.size > 1:  # each travelled accumulator goes home; this rank's one or two come back
        steps = {"right": plan.right_steps, "left": plan.left_steps}
        sides = [side for side in _SIDES if steps[side]]
        to = [plan.owner(side, steps[side]) for side in sides]
        sources = [plan.owner("left" if s == "right" else "right", steps[s]) for s in sides]
        accumulators = torch.stack([last[side][:, dim:] for side in sides])  # [1 or 2, M, D]
        homes = ops.shift(accumulators, to, sources, (width, dim), group=g)
        dk = homes[0][: len(k)] if len(homes) == 1 else homes[0][: len(k)] + homes[1][: len(k)]
    return sums[0], dk.contiguous(), sums[1], sums[2]


class _RingReduce(torch.autograd.Function):
    @staticmethod
    def forward(  # type: ignore[override]
        ctx: FunctionCtx, a: Tensor, k: Tensor, scale: Tensor, bias: Tensor, plan: _Plan
    ) -> Tensor:
        out = _reduce_forward(a, k, scale, bias, plan)
        ctx.save_for_backward(a, k, scale, bias, out)
        ctx.plan = plan  # type: ignore[attr-defined]
        return out

    @staticmethod
    @once_differentiable
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor | None, ...]:
        a, k, scale, bias, out = ctx.saved_tensors
        plan: _Plan = ctx.plan
        grads = _reduce_backward(a, k, scale, bias, out, grad, plan)
        need = ctx.needs_input_grad
        return (*(gr if n else None for gr, n in zip(grads, need, strict=False)), None)


def ring_reduce(
    anchors: Tensor,
    keys: Tensor,
    scale: Tensor,
    bias: Tensor,
    rows: tuple[int, ...],
    group: Group,
    *,
    kind: str,
    block: int,
    mask_self: bool = False,
) -> Tensor:
    """The per-anchor reduction [n] described in the module docstring; ``rows`` from
    the loss's checked batch sizes, ``scale`` and ``bias`` 0-dim tensors of the anchors' dtype."""
    assert kind in KINDS and block >= 1
    plan = _Plan(group, rows, block, kind, mask_self)
    if keys is anchors:  # NT-Xent: torch.compile cannot trace one tensor passed twice
        keys = keys.view_as(keys)
    out: Tensor = _RingReduce.apply(anchors, keys, scale, bias, plan)  # type: ignore[no-untyped-call]
    return out


def _send_on(x: Tensor, g: Group) -> Tensor:
    """Shift ``x`` one rank along the ring and wait (the payload was just updated): to the
    next rank, from the previous one."""
    if g.size == 1:
        return x
    after, before = (g.rank + 1) % g.size, (g.rank - 1) % g.size
    return ops.shift(x[None], [after], [before], x.shape, group=g)[0]


def _clip_forward(x: Tensor, y: Tensor, scale: Tensor, plan: _Plan) -> tuple[Tensor, Tensor]:
    g, width, dim, b = plan.group, max(plan.rows), y.shape[1], plan.block
    # [M, D + 1]: the texts and their running column logsumexp
    cur = torch.cat([F.pad(y, (0, 0, 0, width - len(y))), y.new_full((width, 1), -math.inf)], 1)
    row = x.new_full((len(x),), -math.inf)
    for step in range(g.size):
        rows = plan.rows_of(plan.source(step))
        keys, col = cur[:rows, :dim], cur[:rows, dim]
        for start in range(0, rows, b):
            logits = (x @ keys[start : start + b].T).mul_(scale)  # [n, b]
            row = torch.logaddexp(row, logits.logsumexp(1))
            col[start : start + b] = torch.logaddexp(col[start : start + b], logits.logsumexp(0))
        cur = _send_on(cur, g)  # W shifts: the last one brings each block home
    return row, cur[: len(y), dim].clone()


def _clip_backward(
    x: Tensor,
    y: Tensor,
    scale: Tensor,
    row: Tensor,
    col_lse: Tensor,
    g_row: Tensor,
    g_col: Tensor,
    plan: _Plan,
) -> tuple[Tensor, Tensor, Tensor]:
    g, width, dim, b = plan.group, max(plan.rows), y.shape[1], plan.block
    dx, ds = torch.zeros_like(x), torch.zeros_like(scale)
    pad = width - len(y)
    # [M, 2D + 2]: texts | their gradient accumulator | column logsumexp | column gradient
    parts = [y, torch.zeros_like(y), col_lse[:, None], g_col[:, None]]
    cur = torch.cat([F.pad(p, (0, 0, 0, pad)) for p in parts], 1)
    for step in range(g.size):
        rows = plan.rows_of(plan.source(step))
        keys, acc = cur[:rows, :dim], cur[:rows, dim : 2 * dim]
        col, g_c = cur[:rows, 2 * dim], cur[:rows, 2 * dim + 1]
        for start in range(0, rows, b):
            cols = slice(start, start + b)
            raw = x @ keys[cols].T  # [n, b]
            logits = raw * scale
            w = (logits - row[:, None]).exp_().mul_(g_row[:, None])  # image -> text softmax
            w += logits.sub_(col[None, cols]).exp_().mul_(g_c[None, cols])  # text -> image
            ds += torch.vdot(w.flatten(), raw.flatten())
            w.mul_(scale)  # dL/draw, without reading the scale on the host
            dx.addmm_(w, keys[cols])
            acc[cols].addmm_(w.T, x)
        last = step == g.size - 1
        cur = _send_on(cur[:, dim : 2 * dim] if last else cur, g)
    return dx, cur[: len(y)].contiguous(), ds  # dy: the accumulator, home


class _RingClip(torch.autograd.Function):
    """CLIP's two directions from one pass over the blocks of ``S = s X Y^T``: the row
    logsumexps are the images' (local), the column logsumexps are the texts', accumulated
    in a vector that travels with each text block and comes home after W shifts."""

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: FunctionCtx, x: Tensor, y: Tensor, scale: Tensor, plan: _Plan
    ) -> tuple[Tensor, Tensor]:
        row, col_lse = _clip_forward(x, y, scale, plan)
        ctx.save_for_backward(x, y, scale, row, col_lse)
        ctx.plan = plan  # type: ignore[attr-defined]
        return row, col_lse

    @staticmethod
    @once_differentiable
    def backward(ctx: Any, g_row: Tensor, g_col: Tensor) -> tuple[Tensor | None, ...]:
        x, y, scale, row, col_lse = ctx.saved_tensors
        plan: _Plan = ctx.plan
        grads = _clip_backward(x, y, scale, row, col_lse, g_row, g_col, plan)
        need = ctx.needs_input_grad
        return (*(gr if n else None for gr, n in zip(grads, need, strict=False)), None)


def ring_clip(
    image: Tensor,
    text: Tensor,
    scale: Tensor,
    rows: tuple[int, ...],
    group: Group,
    *,
    block: int,
) -> tuple[Tensor, Tensor]:
    """CLIP's per-image and per-text logsumexps ([B_l] each) over ``s <x_i, y_j>`` of the global
    batch, from one ring pass over the text blocks.

    Gradient: the images and the scale get this rank's part, the texts the sum over every
    rank's images (the sum objective). Communication: forward W shifts of [M, D + 1]; backward
    W-1 of [M, 2D + 2] and 1 of [M, D]. Compute: forward one [n, m_r] matmul per rank,
    backward three: 4 in all against the dense path's 6 (two directions). Memory: three
    [n, b] chunks.
    """
    assert block >= 1
    plan = _Plan(group, rows, block, "lse", False)
    if text is image:  # torch.compile cannot trace one tensor passed twice
        text = text.view_as(text)
    row, col = _RingClip.apply(image, text, scale, plan)  # type: ignore[no-untyped-call]
    return row, col
