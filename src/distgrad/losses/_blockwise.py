"""Blockwise ring reductions: row (and column) reductions over the global logits, never
materialised, in tiles of a fixed size.

Legend: ``n`` this rank's anchors, ``m_r`` rank r's keys (padded to ``M = max_r m_r`` on the
wire), ``D`` the embedding dim, ``W`` the group size, ``b`` the block size (a tile is at most
``[b, b]``), ``s`` the scale.

For local anchors ``a`` [n, D] and the keys of every rank ``k_r`` [m_r, D], with logits
``l_ij = s <a_i, k_j> + bias`` over all global keys ``j``, :func:`ring_reduce` returns [n]:

* ``kind="lse"``: ``logsumexp_j l_ij`` (with ``mask_self``: column j = i of this rank's own
  keys is left out, for NT-Xent where the anchors are the keys);
* ``kind="softplus"``: ``sum_j softplus(l_ij)`` (SigLIP with every pair a negative);

and :func:`ring_clip` (no bias) both CLIP directions from the same tiles: each anchor's
logsumexp over every key [n], and each of this rank's keys' logsumexp over every rank's
anchors [m_r] (the columns).

Algorithm (the keys travel, the anchors stay): the ring of ``distgrad._exchange.ring`` (one
loop order for every ring of distgrad: each key block arrives a step before its compute, so
the next exchange is in flight while the current block computes). Each block held is folded
in ``[b, b]`` tiles, rows and columns both tiled (:func:`_tile_forward`): the per-anchor
result accumulates across tiles (``logaddexp`` of tile logsumexps, or a running sum), and the
column logsumexps of CLIP in a vector that travels with the block as its accumulator and
comes home after the last rank. The backward recomputes each tile (:func:`_tile_backward`)
and turns it into ``dL/dlogits`` (``softmax * grad`` from the saved row logsumexp, and for
CLIP plus the column softmax times the texts' gradients, which travel with the keys; or
``sigmoid * grad``); the anchors', scale's and bias's gradients accumulate here, the keys'
in an accumulator that travels behind its block and comes home complete.

Gradient (the objective is the sum over ranks of what each rank back-propagates): the
gradient of the keys is the sum over every rank's anchors, as for ``all_gather``; ``a``,
``scale`` and ``bias`` get this rank's part only.

Communication (``distgrad._exchange.ring``): forward W - 1 exchanges of [M, D] (CLIP: W + 1,
the keys W - 1 times and their column logsumexps W times); backward W + 1, the keys W - 1
times ([M, D], CLIP [M, D + 2] with the column statistics) and the accumulator [M, D] W
times. Compute: forward one [n, m_r] matmul per rank, backward three (recompute, anchor
gradient, key gradient); CLIP's two directions share them. Memory: the saved inputs and the
per-anchor result [n]; the key blocks in flight (a few [M, D]); and two or three [b, b]
tiles, whatever n: nothing of a size [n, b] (benchmarks/results/loss_memory.md).

The tile functions are the seam for a fused kernel: :func:`_tile_forward` and
:func:`_tile_backward` see one tile and the statistics of its rows and columns and nothing of
the ring. Not twice differentiable.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Literal

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.autograd.function import FunctionCtx, once_differentiable

from distgrad._exchange.group import Group, own_rows
from distgrad._exchange.ring import Ring, run
from distgrad.losses import _triton

__all__ = ["KINDS", "Kernels", "ring_clip", "ring_reduce", "set_kernels"]

KINDS = ("lse", "softplus")


@dataclass(frozen=True)
class _Spec:
    """What one ring of a loss computes: the reduction of each tile's rows (``kind``), whether
    the columns' logsumexps too (CLIP), whether anchor i leaves out its own key i (NT-Xent),
    and the tile side ``block``."""

    kind: str
    columns: bool
    mask_self: bool
    block: int
    kernel: bool = False  # the fused Triton kernels (losses/_triton.py) do each block's work
    deterministic: bool = True


@dataclass(frozen=True)
class _Plan:
    group: Group
    rows: tuple[int, ...]  # key rows of every rank (group rank order)
    spec: _Spec

    def rows_of(self, rank: int) -> int:
        """Rank ``rank``'s key rows (arithmetic on a per-rank rank: ``own_rows``)."""
        return own_rows(self.rows, rank)

    @property
    def width(self) -> int:
        """M: every key block padded to the largest shard on the wire."""
        return max(self.rows)

    def ring(self, block_width: int, acc: tuple[int, ...] | None) -> Ring:
        """The ring of ``[M, block_width]`` blocks, each with an accumulator of ``acc``."""
        shape = (self.width, block_width)
        return Ring(self.group, lambda _: shape, None if acc is None else (lambda _: acc))


def _diagonal(spec: _Spec, own: bool, i: int, j: int, rows: int, cols: int) -> int | None:
    """The offset of the tile ``[i : i + rows, j : j + cols]``'s diagonal of anchor i against
    own key i, or None when nothing is left out (not NT-Xent, another rank's keys, or a tile
    that misses the diagonal)."""
    if not (own and spec.mask_self) or i >= j + cols or j >= i + rows:
        return None
    return i - j


def _tile_logits(a: Tensor, k: Tensor, scale: Tensor, bias: Tensor) -> tuple[Tensor, Tensor]:
    """(raw similarities, logits ``scale * raw + bias``), each [rows, cols]."""
    raw = a @ k.T
    return raw, torch.addcmul(bias, raw, scale)


def _tile_forward(
    a: Tensor, k: Tensor, scale: Tensor, bias: Tensor, spec: _Spec, diagonal: int | None
) -> tuple[Tensor, Tensor | None]:
    """One tile of anchors ``a`` [tr, D] against keys ``k`` [tc, D]: its rows' reduction [tr]
    (logsumexp, or the sum of softplus) and, for CLIP, its columns' logsumexp [tc] (else
    None). ``diagonal``: the offset of the entries left out (NT-Xent), or None."""
    # In place: one [tr, tc] tile, not the raw similarities beside the logits (measured with
    # benchmarks/loss_memory.py: SigLIP's forward held three [b, b] tiles, its backward two).
    logits = (a @ k.T).mul_(scale).add_(bias)
    if diagonal is not None:
        # The entries of a diagonal, filled in place: indexing them would copy a host index
        # tensor to the device, a host synchronisation on CUDA.
        logits.diagonal(offset=diagonal).fill_(-math.inf)
    if spec.kind == "softplus":
        return F.softplus(logits).sum(1), None
    return logits.logsumexp(1), logits.logsumexp(0) if spec.columns else None


def _tile_backward(
    a: Tensor,
    k: Tensor,
    scale: Tensor,
    bias: Tensor,
    spec: _Spec,
    diagonal: int | None,
    rows: tuple[Tensor, Tensor],
    cols: tuple[Tensor, Tensor] | None,
    grads: tuple[Tensor, Tensor, Tensor, Tensor],
) -> None:
    """One tile's gradients, accumulated in place into ``grads``: (the anchors' [tr, D], the
    keys' [tc, D], the scale's, the bias's). ``rows``: the tile rows' forward result and its
    incoming gradient ([tr] each); ``cols``: CLIP's column logsumexps and their gradients
    ([tc] each), or None."""
    da, dk, ds, db = grads
    raw, w = _tile_logits(a, k, scale, bias)  # w becomes dL/dlogits
    if diagonal is not None:
        w.diagonal(offset=diagonal).fill_(-math.inf)
    out, g_out = rows
    if spec.kind == "softplus":
        w.sigmoid_().mul_(g_out[:, None])
    elif cols is None:
        w.sub_(out[:, None]).exp_().mul_(g_out[:, None])
    else:  # both CLIP directions from one tile: the row softmax and the column softmax
        col, g_col = cols
        by_col = torch.sub(w, col[None, :]).exp_().mul_(g_col[None, :])
        w.sub_(out[:, None]).exp_().mul_(g_out[:, None]).add_(by_col)
    ds += torch.vdot(w.flatten(), raw.flatten())
    db += w.sum()
    w.mul_(scale)  # dL/draw; the scale a tensor, never read on the host (no synchronisation)
    da.addmm_(w, k)
    dk.addmm_(w.T, a)


def _combine(spec: _Spec, total: Tensor, part: Tensor) -> Tensor:
    return total + part if spec.kind == "softplus" else torch.logaddexp(total, part)


def _block_forward(
    a: Tensor, keys: Tensor, scale: Tensor, bias: Tensor, plan: _Plan, own: bool, out: Tensor
) -> Tensor | None:
    """Fold one rank's keys [m, D] in, tile by tile: ``out`` [n] in place; returns the
    block's column logsumexps [M] (CLIP; -inf past m), else None."""
    spec, m = plan.spec, keys.shape[0]
    t = spec.block
    if spec.kernel:
        return _kernel_forward(a, keys, scale, bias, plan, own, out)
    cols = keys.new_full((plan.width,), -math.inf) if spec.columns else None
    for i in range(0, a.shape[0], t):
        anchors, total = a[i : i + t], None
        for j in range(0, m, t):
            kb = keys[j : j + t]
            diagonal = _diagonal(spec, own, i, j, len(anchors), len(kb))
            row, col = _tile_forward(anchors, kb, scale, bias, spec, diagonal)
            total = row if total is None else _combine(spec, total, row)
            if cols is not None and col is not None:
                cols[j : j + len(kb)] = torch.logaddexp(cols[j : j + len(kb)], col)
        if total is not None:
            out[i : i + t] = _combine(spec, out[i : i + t], total)
    return cols


def _block_backward(
    a: Tensor,
    keys: Tensor,
    scale: Tensor,
    bias: Tensor,
    plan: _Plan,
    own: bool,
    rows: tuple[Tensor, Tensor],
    cols: tuple[Tensor, Tensor] | None,
    sums: tuple[Tensor, Tensor, Tensor],
) -> Tensor:
    """One rank's keys [m, D] into the gradients: the anchors', scale's and bias's in place
    (``sums``); returns this rank's part of the keys' gradient [M, D] (zeros past m)."""
    spec, t = plan.spec, plan.spec.block
    if spec.kernel:
        return _kernel_backward(a, keys, scale, bias, plan, own, rows, cols, sums)
    da, ds, db = sums
    dk = keys.new_zeros((plan.width, keys.shape[1]))
    out, g_out = rows
    for i in range(0, a.shape[0], t):
        anchors, row_stats = a[i : i + t], (out[i : i + t], g_out[i : i + t])
        for j in range(0, keys.shape[0], t):
            kb = keys[j : j + t]
            diagonal = _diagonal(spec, own, i, j, len(anchors), len(kb))
            col_stats = None if cols is None else (cols[0][j : j + t], cols[1][j : j + t])
            grads = (da[i : i + t], dk[j : j + len(kb)], ds, db)
            _tile_backward(anchors, kb, scale, bias, spec, diagonal, row_stats, col_stats, grads)
    return dk


def _kernel_forward(
    a: Tensor, keys: Tensor, scale: Tensor, bias: Tensor, plan: _Plan, own: bool, out: Tensor
) -> Tensor | None:
    """:func:`_block_forward` by the fused kernels: every tile of the block in one launch (or
    one per wave), statistics in float32 (``out`` is float32 on this path)."""
    spec, m = plan.spec, keys.shape[0]
    mask = 0 if own and spec.mask_self else None  # anchor i against own key i: i - j == 0
    if spec.kind == "softplus":
        _triton.softplus_forward(a, keys, scale, bias, out)
        return None
    cols = torch.full((plan.width,), -math.inf, device=keys.device) if spec.columns else None
    _triton.lse_forward(a, keys, scale, bias, out, None if cols is None else cols[:m], mask)
    return cols


def _kernel_backward(
    a: Tensor,
    keys: Tensor,
    scale: Tensor,
    bias: Tensor,
    plan: _Plan,
    own: bool,
    rows: tuple[Tensor, Tensor],
    cols: tuple[Tensor, Tensor] | None,
    sums: tuple[Tensor, Tensor, Tensor],
) -> Tensor:
    """:func:`_block_backward` by the fused kernels, accumulating in float32."""
    spec, m = plan.spec, keys.shape[0]
    da, ds, db = sums
    dx = da if da.dtype == torch.float32 else torch.zeros(da.shape, device=da.device)
    dk = torch.zeros((plan.width, keys.shape[1]), device=keys.device)
    out, g_out = (r.float() for r in rows)
    if spec.kind == "softplus":
        parts = _triton.softplus_backward(
            a, keys, scale, bias, g_out, dx, dk[:m], deterministic=spec.deterministic
        )
    else:
        col, g_col = (None, None) if cols is None else (c.float().contiguous() for c in cols)
        mask = 0 if own and spec.mask_self else None
        parts = _triton.lse_backward(
            a, keys, scale, bias, out.contiguous(), g_out, dx, dk[:m], col, g_col, mask,
            deterministic=spec.deterministic,
        )  # fmt: skip
    if dx is not da:
        da += dx
    ds += parts[0].to(ds.dtype)
    db += parts[1].to(db.dtype)
    return dk.to(keys.dtype)


def _padded(x: Tensor, rows: int) -> Tensor:
    """``x`` with zero rows to ``rows`` (the wire's M); ``x`` itself when it has them (even
    shards: no copy of the keys)."""
    return x if x.shape[0] == rows else F.pad(x, (0, 0, 0, rows - x.shape[0]))


def _initial(spec: _Spec) -> float:
    return -math.inf if spec.kind == "lse" else 0.0


def _forward(
    a: Tensor, k: Tensor, scale: Tensor, bias: Tensor, plan: _Plan
) -> tuple[Tensor, Tensor]:
    """(each anchor's reduction [n], CLIP's column logsumexps of this rank's keys [m], else
    empty): the keys go round the ring, each block folded in tile by tile."""
    spec, dim = plan.spec, k.shape[1]
    # The kernels keep their statistics in float32 (the loss is float32 from them).
    out = a.new_full((a.shape[0],), _initial(spec), dtype=torch.float32 if spec.kernel else None)
    own = _padded(k, plan.width)  # [M, D]

    def compute(step: int, source: int, held: Tensor) -> Tensor | None:
        keys = held[: plan.rows_of(source)]
        return _block_forward(a, keys, scale, bias, plan, step == 0, out)

    ring = plan.ring(dim, (plan.width,) if spec.columns else None)
    cols = run(ring, own, compute, torch.logaddexp)
    return out, (k.new_empty((0,)) if cols is None else cols[: k.shape[0]].clone())


def _backward(
    a: Tensor,
    k: Tensor,
    scale: Tensor,
    bias: Tensor,
    out: Tensor,
    cols: Tensor,
    g_out: Tensor,
    g_cols: Tensor | None,
    plan: _Plan,
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """The forward's ring again, each key block followed by its gradient accumulator ([M, D],
    which every rank adds its anchors' part to and which comes home complete); CLIP's blocks
    carry their column logsumexps and gradients ([M, D + 2])."""
    spec, dim = plan.spec, k.shape[1]
    sums = torch.zeros_like(a), torch.zeros_like(scale), torch.zeros_like(bias)
    parts = [k]
    if spec.columns:
        g_c = torch.zeros_like(cols) if g_cols is None else g_cols
        parts += [cols[:, None], g_c[:, None]]
    own = _padded(torch.cat(parts, 1) if len(parts) > 1 else k, plan.width)  # [M, D (+ 2)]

    def compute(step: int, source: int, held: Tensor) -> Tensor:
        m = plan.rows_of(source)
        keys = held[:m, :dim]
        stats = (held[:m, dim], held[:m, dim + 1]) if spec.columns else None
        return _block_backward(a, keys, scale, bias, plan, step == 0, (out, g_out), stats, sums)

    dk = run(plan.ring(own.shape[1], (plan.width, dim)), own, compute)
    assert dk is not None
    return sums[0], dk[: k.shape[0]].contiguous(), sums[1], sums[2]


class _RingLoss(torch.autograd.Function):
    """The rows' reduction [n] and (CLIP) the columns' logsumexps [m] of one ring pass."""

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: FunctionCtx, a: Tensor, k: Tensor, scale: Tensor, bias: Tensor, plan: _Plan
    ) -> tuple[Tensor, Tensor]:
        out, cols = _forward(a, k, scale, bias, plan)
        ctx.save_for_backward(a, k, scale, bias, out, cols)
        ctx.plan = plan  # type: ignore[attr-defined]
        return out, cols

    @staticmethod
    @once_differentiable
    def backward(ctx: Any, g_out: Tensor, g_cols: Tensor | None) -> tuple[Tensor | None, ...]:
        a, k, scale, bias, out, cols = ctx.saved_tensors
        plan: _Plan = ctx.plan
        grads = _backward(a, k, scale, bias, out, cols, g_out, g_cols, plan)
        need = ctx.needs_input_grad
        return (*(gr if n else None for gr, n in zip(grads, need, strict=False)), None)


class _RingReduce(_RingLoss):
    """``ring_reduce``'s node (a survivor's error names a backward by its node)."""


class _RingClip(_RingLoss):
    """``ring_clip``'s node."""


Kernels = Literal["auto", "torch", "triton"]
_choice: list[Any] = ["auto", True]  # set_kernels' choice: which, deterministic


def set_kernels(which: Kernels = "auto", *, deterministic: bool = True) -> None:
    """Choose who does the ring and blockwise losses' per-block work in this process.

    ``"auto"`` (the default): the fused Triton kernels for CUDA tensors when Triton is
    installed (``pip install "distgrad[kernels]"``), torch's tiles otherwise and on the CPU;
    ``"torch"``: torch's tiles always (the reference); ``"triton"``: the kernels always (on
    CPU tensors only under ``TRITON_INTERPRET=1``, Triton's interpreter, which is how the tests
    run them). Both compute the same tiles with the same statistics (docs/losses.md,
    "Fused tile kernels"). Inside ``torch.compile``, and for float64 features, the torch
    tiles run either way.

    ``deterministic=False`` lets the kernels' backward accumulate the keys' gradient with
    float atomics: one launch instead of one per wave, not bitwise reproducible.

    Args:
        which: ``"auto"``, ``"torch"`` or ``"triton"``.
        deterministic: whether the kernels' backward is bitwise reproducible (no float
            atomics).

    Returns:
        None.

    Raises:
        ValueError: ``which`` is none of the three, or ``"triton"`` without Triton installed.

    Example:
        >>> dg.losses.set_kernels("torch")  # torch's tiles, the reference, everywhere
        >>> dg.losses.set_kernels()  # back to the default: the kernels for CUDA tensors
    """
    if which not in ("auto", "torch", "triton"):
        raise ValueError(f"set_kernels: which must be 'auto', 'torch' or 'triton', got {which!r}")
    if which == "triton" and not _triton.available():
        raise ValueError(
            "set_kernels('triton'): Triton is not installed; pip install \"distgrad[kernels]\" "
            '(or pip install -e ".[kernels]" in a clone)'
        )
    _choice[:] = [which, bool(deterministic)]


def _kernels_for(x: Tensor) -> tuple[bool, bool]:
    """(whether the kernels do this loss's blocks, whether deterministically)."""
    which, deterministic = _choice
    # float64 (and any dtype the kernels do not take) always takes torch's tiles.
    supported = x.dtype in (torch.float32, torch.bfloat16, torch.float16)
    if torch.compiler.is_compiling() or which == "torch" or not supported:
        return False, deterministic
    if which == "triton":
        return True, deterministic
    return x.is_cuda and _triton.available(), deterministic


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
    plan = _Plan(group, rows, _Spec(kind, False, mask_self, block, *_kernels_for(anchors)))
    if keys is anchors:  # NT-Xent: torch.compile cannot trace one tensor passed twice
        keys = keys.view_as(keys)
    out, _ = _RingReduce.apply(anchors, keys, scale, bias, plan)  # type: ignore[no-untyped-call]
    return out  # type: ignore[no-any-return]


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
    rank's images (the sum objective). Communication: forward W + 1 exchanges, the texts
    [M, D] W - 1 times and their column logsumexps [M] W times; backward W + 1, the texts with
    their column statistics [M, D + 2] W - 1 times and their gradient [M, D] W times.
    Compute: forward one [n, m_r] matmul per rank, backward three: 4 in all against the
    dense path's 6 (two directions). Memory: three [b, b] tiles.
    """
    assert block >= 1
    plan = _Plan(group, rows, _Spec("lse", True, False, block, *_kernels_for(image)))
    if text is image:  # torch.compile cannot trace one tensor passed twice
        text = text.view_as(text)
    zero = scale.new_zeros(())
    row, col = _RingClip.apply(image, text, scale, zero, plan)  # type: ignore[no-untyped-call]
    return row, col
