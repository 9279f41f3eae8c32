"""Fused tile kernels, in Triton, for the blockwise losses' per-block work.

The ring and blockwise losses reduce, for this rank's anchors ``x`` [n, D] and one block of
keys ``y`` [c, D], over the logits ``l_ij = s <x_i, y_j> + b``:

* ``lse``: each row's logsumexp over the block's columns, folded into a running row logsumexp
  (``row``), and, when ``col`` is given, each column's over the rows, folded into a running
  column logsumexp (CLIP's text direction; InfoNCE's ``key_to_query``). ``mask_offset``
  leaves out the entries with ``i - j == mask_offset`` (NT-Xent: an anchor against itself);
* ``softplus``: each row's sum of ``softplus(l_ij)`` (SigLIP, every pair a negative; its
  positives are corrected outside), added into ``row``;

and the backward of the same, given the final statistics and the incoming gradient of each
row's (and column's) result: ``dL/dl_ij = g_i exp(l_ij - row_i) + g'_j exp(l_ij - col_j)``
(``lse``) or ``g_i sigmoid(l_ij)`` (``softplus``), then ``dx += s dl y``, ``dy += s dl^T x``,
``ds += sum dl * <x, y>``, ``db += sum dl``.

Each kernel works on tiles of ``BM`` rows by ``BN`` columns, with an online max: no tile of
logits is ever stored, so the loss keeps, beyond the features and their gradients (float32
accumulators), one or two float32 statistics per row and per column. Forward: 1 tile-matmul
per tile, rows and columns from the same pass. Backward: 3 per tile, for both directions
together (the logits again, then ``dl y`` and ``dl^T x``). The embedding dim is any size: the
tile-matmuls run over it in chunks of ``BD``.

**Deterministic by default.** Where a tile updates both a row block and a column block (the
column statistics, the keys' gradient), the tiles run in *waves*: in wave ``w`` program ``q``
takes row block ``q`` and column block ``(q + w) mod C`` (or the transpose when there are more
row blocks than column blocks), so within a wave no two programs touch the same rows or the
same columns, and each row's and column's accumulation happens in wave order, the same on
every run. ``max(R, C)`` launches of ``min(R, C)`` programs. ``deterministic=False`` runs the
backward as one launch over row blocks, each looping over every column block, with the keys'
gradient accumulated by float atomics (faster, not bitwise reproducible). The scale's and
bias's gradients are written per program and summed in a fixed order.

Inputs in float32, bfloat16 or float16; statistics, accumulation and the gradients'
accumulators in float32. float32 tiles multiply in IEEE float32 (not TF32); bfloat16 and
float16 tiles multiply in their own type with float32 accumulation on a GPU, the gradient of the
logits rounded to the input type first, as FlashAttention does (widened to float32 under the
interpreter, which cannot multiply them; the tolerance for bfloat16 inputs: ``BF16`` in
tests/losses/test_kernels.py).

Triton is an optional dependency (the ``kernels`` extra): :func:`available` says whether it is
installed, and the kernels are compiled on first use, under ``TRITON_INTERPRET=1`` as Triton's
interpreter on CPU tensors (how CI tests them), else for the GPU.
"""

from __future__ import annotations

import functools
import importlib.util
import os
from typing import Any

import torch
from torch import Tensor

__all__ = ["available", "lse_backward", "lse_forward", "softplus_backward", "softplus_forward"]

BM, BN, BD = 32, 32, 32  # tile rows, tile columns, the embedding dim's chunk


def available() -> bool:
    """Whether Triton is installed (the kernels can be built)."""
    return importlib.util.find_spec("triton") is not None


@functools.cache
def _kernels() -> Any:
    """The kernels, built on first use: Triton's decorators read TRITON_INTERPRET when the
    module that holds them is imported (``_triton_kernels``, which imports triton itself)."""
    from distgrad.losses import _triton_kernels as k

    return k.forward, k.backward


def _blocks(n: int, c: int) -> tuple[int, int]:
    return max(1, -(-n // BM)), max(1, -(-c // BN))


def _launch(kernel: Any, waves: bool, n: int, c: int, args: tuple[Any, ...], **flags: Any) -> None:
    """Run the forward ``kernel`` over every tile: in waves, or one launch over row blocks."""
    R, C = _blocks(n, c)
    sizes = {"BM": BM, "BN": BN, "BD": BD}
    if not waves:
        kernel[(R,)](*args, 0, R, C, WAVES=False, **sizes, **flags)
        return
    for wave in range(max(R, C)):
        kernel[(min(R, C),)](*args, wave, R, C, WAVES=True, **sizes, **flags)


def _check(x: Tensor, y: Tensor) -> tuple[Tensor, Tensor]:
    """``x`` and ``y`` as the kernels read them: rows of unit stride (a strided view of a
    ring's block is read in place, not copied)."""
    assert x.dim() == 2 and y.dim() == 2 and x.shape[1] == y.shape[1], (x.shape, y.shape)
    assert x.dtype == y.dtype and x.dtype in (torch.float32, torch.bfloat16, torch.float16)
    return tuple(t if t.stride(1) == 1 else t.contiguous() for t in (x, y))  # type: ignore[return-value]


def _low(x: Tensor) -> bool:
    """Whether tiles multiply in the input's own type: bfloat16 and float16 on a GPU. Triton's
    interpreter cannot (its numpy dot misreads them: measured, 2.5e10 off on a 16x16 bf16
    tile), so there they are widened to float32 first."""
    interpreting = os.environ.get("TRITON_INTERPRET", "") not in ("", "0")
    return x.dtype in (torch.bfloat16, torch.float16) and not interpreting


def lse_forward(
    x: Tensor,
    y: Tensor,
    scale: Tensor,
    bias: Tensor,
    row: Tensor,
    col: Tensor | None = None,
    mask_offset: int | None = None,
) -> None:
    """Fold the block ``y`` into the running float32 logsumexps ``row`` [n] (and ``col`` [c]),
    in place."""
    x, y = _check(x, y)
    forward, _ = _kernels()
    n, c, D = x.shape[0], y.shape[0], x.shape[1]
    cols = col if col is not None else row  # unused when HAS_COL is off
    args = (x, y, scale, bias, row, cols, n, c, D, x.stride(0), y.stride(0), mask_offset or 0)
    _launch(forward, col is not None, n, c, args, SOFTPLUS=False, HAS_COL=col is not None,
            HAS_MASK=mask_offset is not None, LOW=_low(x))  # fmt: skip


def softplus_forward(x: Tensor, y: Tensor, scale: Tensor, bias: Tensor, row: Tensor) -> None:
    """Add each row's ``sum_j softplus(l_ij)`` over the block ``y`` into ``row`` [n] (float32)."""
    x, y = _check(x, y)
    forward, _ = _kernels()
    n, c, D = x.shape[0], y.shape[0], x.shape[1]
    args = (x, y, scale, bias, row, row, n, c, D, x.stride(0), y.stride(0), 0)
    _launch(forward, False, n, c, args, SOFTPLUS=True, HAS_COL=False, HAS_MASK=False,
            LOW=_low(x))  # fmt: skip


def _backward(
    x: Tensor,
    y: Tensor,
    scale: Tensor,
    bias: Tensor,
    row: Tensor,
    g_row: Tensor,
    col: Tensor | None,
    g_col: Tensor | None,
    mask_offset: int | None,
    dx: Tensor,
    dy: Tensor,
    softplus: bool,
    deterministic: bool,
) -> tuple[Tensor, Tensor]:
    x, y = _check(x, y)
    assert dx.dtype == dy.dtype == torch.float32 and dx.is_contiguous() and dy.is_contiguous()
    _, backward = _kernels()
    n, c, D = x.shape[0], y.shape[0], x.shape[1]
    R, C = _blocks(n, c)
    waves = deterministic
    P = min(R, C) if waves else R
    part = torch.zeros(2 * max(R, C) * P if waves else 2 * R, dtype=torch.float32, device=x.device)
    has_col = col is not None
    cols, g_cols = (col, g_col) if has_col else (row, g_row)
    args = (x, y, scale, bias, row, g_row.float().contiguous(), cols, g_cols, dx, dy, part,
            n, c, D, x.stride(0), y.stride(0), mask_offset or 0)  # fmt: skip
    flags = {"SOFTPLUS": softplus, "HAS_COL": has_col, "HAS_MASK": mask_offset is not None}
    if waves:
        for wave in range(max(R, C)):
            backward[(P,)](*args, wave, R, C, P, WAVES=True, LOW=_low(x), BM=BM, BN=BN, BD=BD,
                           **flags)  # fmt: skip
    else:
        backward[(R,)](*args, 0, R, C, P, WAVES=False, LOW=_low(x), BM=BM, BN=BN, BD=BD,
                       **flags)  # fmt: skip
    sums = part.view(-1, 2).sum(0)  # in program order: deterministic
    return sums[0], sums[1]


def lse_backward(
    x: Tensor,
    y: Tensor,
    scale: Tensor,
    bias: Tensor,
    row: Tensor,
    g_row: Tensor,
    dx: Tensor,
    dy: Tensor,
    col: Tensor | None = None,
    g_col: Tensor | None = None,
    mask_offset: int | None = None,
    *,
    deterministic: bool = True,
) -> tuple[Tensor, Tensor]:
    """Add the block's part of the gradients into the float32 accumulators ``dx`` [n, D] and
    ``dy`` [c, D]; return the scale's and the bias's parts (float32 scalars). ``row``/``col``
    are the final logsumexps, ``g_row``/``g_col`` the gradients of them."""
    return _backward(x, y, scale, bias, row, g_row, col, g_col, mask_offset, dx, dy, False,
                     deterministic)  # fmt: skip


def softplus_backward(
    x: Tensor,
    y: Tensor,
    scale: Tensor,
    bias: Tensor,
    g_row: Tensor,
    dx: Tensor,
    dy: Tensor,
    *,
    deterministic: bool = True,
) -> tuple[Tensor, Tensor]:
    """As :func:`lse_backward`, for the softplus sums."""
    return _backward(x, y, scale, bias, g_row, g_row, None, None, None, dx, dy, True,
                     deterministic)  # fmt: skip
