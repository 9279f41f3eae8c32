"""The fused tile kernels (distgrad/losses/_triton.py) equal float64 torch, under Triton's
interpreter on CPU tensors: each block's logsumexps (rows, columns, a masked diagonal) and
softplus sums, folded into running statistics, and the gradients of the anchors, the keys,
the scale and the bias, accumulated over two blocks, with random incoming gradients.
float32 to 1e-5 relative; bfloat16 to ``BF16`` (its 8-bit mantissa rounds every input and the
gradient of the logits before the tile-matmuls). Deterministic mode is bitwise reproducible;
the opt-in atomics agree with it. (tests/conftest.py sets TRITON_INTERPRET=1.)
"""

from __future__ import annotations

import pytest
import torch
from torch import Tensor

from distgrad.losses import _triton
from tests._support import seeded

pytestmark = pytest.mark.skipif(not _triton.available(), reason="needs triton (the kernels extra)")

FLOAT32 = {"rtol": 1e-5, "atol": 1e-5}
BF16 = {"rtol": 3e-2, "atol": 3e-2}  # bfloat16 inputs: about 2-3 significant digits


def _data(dtype: torch.dtype, n: int, c: int, d: int) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    g = seeded(n * 1000 + c)
    x = torch.nn.functional.normalize(torch.randn(n, d, generator=g), dim=1).to(dtype)
    y = torch.nn.functional.normalize(torch.randn(c, d, generator=g), dim=1).to(dtype)
    return x, y, torch.tensor(7.5), torch.tensor(-1.25)


def _reference(x: Tensor, y: Tensor, s: Tensor, b: Tensor, mask: int | None) -> Tensor:
    lg = s.double() * (x.double() @ y.double().T) + b.double()
    if mask is not None:
        i, j = torch.meshgrid(torch.arange(len(x)), torch.arange(len(y)), indexing="ij")
        lg = lg.masked_fill(i - j == mask, float("-inf"))
    return lg


SHAPES = [(37, 50, 40), (64, 29, 70), (5, 3, 16)]  # uneven tiles, a dim that is no power of 2


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("n", "c", "d"), SHAPES)
@pytest.mark.parametrize("mask", [None, 3])
def test_logsumexp_rows_and_columns_fold_into_running_statistics(
    dtype: torch.dtype, n: int, c: int, d: int, mask: int | None
) -> None:
    x, y, s, b = _data(dtype, n, c, d)
    start_row = torch.randn(n, generator=seeded(1))  # what earlier blocks left
    start_col = torch.randn(c, generator=seeded(2))
    row, col = start_row.clone(), start_col.clone()
    _triton.lse_forward(x, y, s, b, row, col, mask)
    lg = _reference(x, y, s, b, mask)
    want_row = torch.logaddexp(start_row.double(), lg.logsumexp(1))
    want_col = torch.logaddexp(start_col.double(), lg.logsumexp(0))
    tol = FLOAT32 if dtype == torch.float32 else BF16
    torch.testing.assert_close(row.double(), want_row, **tol)
    torch.testing.assert_close(col.double(), want_col, **tol)
    only_rows = start_row.clone()
    _triton.lse_forward(x, y, s, b, only_rows, None, mask)
    torch.testing.assert_close(only_rows, row)


@pytest.mark.parametrize(("n", "c", "d"), SHAPES)
def test_softplus_sums_add_into_the_rows(n: int, c: int, d: int) -> None:
    x, y, s, b = _data(torch.float32, n, c, d)
    row = torch.ones(n)
    _triton.softplus_forward(x, y, s, b, row)
    want = 1 + torch.nn.functional.softplus(_reference(x, y, s, b, None)).sum(1)
    torch.testing.assert_close(row.double(), want, **FLOAT32)


def _two_blocks_backward(
    kind: str, dtype: torch.dtype, n: int, c: int, d: int, mask: int | None, deterministic: bool
) -> tuple[Tensor, ...]:
    x, y, s, b = _data(dtype, n, c, d)
    halves = [y[: c // 2 + 1], y[c // 2 + 1 :]]
    lg = _reference(x, y, s, b, mask)
    g_row = torch.randn(n, generator=seeded(3))
    g_col = torch.randn(c, generator=seeded(4))
    row = lg.logsumexp(1).float()
    col = lg.logsumexp(0).float()
    dx, dy = torch.zeros(n, d), torch.zeros(c, d)
    ds, db = torch.zeros(()), torch.zeros(())
    start = 0
    for block in halves:
        part = slice(start, start + len(block))
        offset = None if mask is None else mask + start
        if kind == "lse":
            dyb = torch.zeros(len(block), d)
            got = _triton.lse_backward(
                x, block, s, b, row, g_row, dx, dyb, col[part].contiguous(),
                g_col[part].contiguous(), offset, deterministic=deterministic,
            )  # fmt: skip
        else:
            dyb = torch.zeros(len(block), d)
            got = _triton.softplus_backward(
                x, block, s, b, g_row, dx, dyb, deterministic=deterministic
            )
        dy[part] = dyb
        ds, db = ds + got[0], db + got[1]
        start += len(block)
    return dx, dy, ds, db


@pytest.mark.parametrize("kind", ["lse", "softplus"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("n", "c", "d"), SHAPES)
def test_gradients_over_two_blocks_equal_float64_autograd(
    kind: str, dtype: torch.dtype, n: int, c: int, d: int
) -> None:
    """Objective: sum_i g_i row_i (+ sum_j g'_j col_j for lse, both directions), with
    row_i the logsumexp (or softplus sum) over every column of both blocks."""
    mask = 2 if kind == "lse" else None
    dx, dy, ds, db = _two_blocks_backward(kind, dtype, n, c, d, mask, True)
    x, y, s, b = (t.double().requires_grad_() for t in _data(dtype, n, c, d))
    lg = s * (x @ y.T) + b
    if mask is not None:
        i, j = torch.meshgrid(torch.arange(n), torch.arange(c), indexing="ij")
        lg = lg.masked_fill(i - j == mask, float("-inf"))
    g_row = torch.randn(n, generator=seeded(3)).double()
    g_col = torch.randn(c, generator=seeded(4)).double()
    if kind == "lse":
        total = (lg.logsumexp(1) * g_row).sum() + (lg.logsumexp(0) * g_col).sum()
    else:
        total = (torch.nn.functional.softplus(lg).sum(1) * g_row).sum()
    total.backward()
    tol = FLOAT32 if dtype == torch.float32 else BF16
    for got, want in ((dx, x.grad), (dy, y.grad), (ds, s.grad), (db, b.grad)):
        assert want is not None
        torch.testing.assert_close(got.double(), want, **tol)


def test_the_deterministic_backward_is_bitwise_reproducible_and_atomics_agree() -> None:
    first = _two_blocks_backward("lse", torch.float32, 64, 29, 70, 2, True)
    again = _two_blocks_backward("lse", torch.float32, 64, 29, 70, 2, True)
    atomic = _two_blocks_backward("lse", torch.float32, 64, 29, 70, 2, False)
    for a, b_, c_ in zip(first, again, atomic, strict=True):
        assert torch.equal(a, b_)
        torch.testing.assert_close(c_, a, **FLOAT32)
