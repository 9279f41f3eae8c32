"""The Triton kernels of :mod:`distgrad.losses._triton` (which says what they compute and
how). Imported only when a kernel is first used: it imports triton, an optional dependency."""

# mypy: ignore-errors

import triton
import triton.language as tl


@triton.jit
def logits(X, Y, rows, cols, n, c, D, sx, sy, BM: tl.constexpr, BN: tl.constexpr,
           BD: tl.constexpr, LOW: tl.constexpr):  # fmt: skip
    raw = tl.zeros((BM, BN), dtype=tl.float32)
    for d0 in range(0, D, BD):
        d = d0 + tl.arange(0, BD)
        x = tl.load(X + rows[:, None] * sx + d[None, :],
                    mask=(rows[:, None] < n) & (d[None, :] < D), other=0.0)  # fmt: skip
        y = tl.load(Y + cols[:, None] * sy + d[None, :],
                    mask=(cols[:, None] < c) & (d[None, :] < D), other=0.0)  # fmt: skip
        if LOW:
            raw += tl.dot(x, tl.trans(y))
        else:
            raw += tl.dot(x.to(tl.float32), tl.trans(y.to(tl.float32)), input_precision="ieee")
    return raw


@triton.jit
def logaddexp(a, b):
    m = tl.maximum(a, b)
    safe = tl.where(m == float("-inf"), 0.0, m)
    total = tl.exp(a - safe) + tl.exp(b - safe)
    return tl.where(m == float("-inf"), m, safe + tl.log(tl.where(total > 0, total, 1.0)))


@triton.jit
def tile_of(q, wave, R, C, WAVES: tl.constexpr):
    """(row block, first column block) of program ``q``: in wave ``wave`` its one tile,
    else row block ``q`` from column block 0 on."""
    rb = q
    cb = q * 0
    if WAVES:
        rb = tl.where(R <= C, q, (q + wave) % R)
        cb = tl.where(R <= C, (q + wave) % C, q)
    return rb, cb


@triton.jit
def forward(X, Y, S, B, ROW, COL, n, c, D, sx, sy, mask_offset, wave, R, C,
            SOFTPLUS: tl.constexpr, HAS_COL: tl.constexpr, HAS_MASK: tl.constexpr,
            WAVES: tl.constexpr, LOW: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr,
            BD: tl.constexpr):  # fmt: skip
    q = tl.program_id(0)
    rb, first = tile_of(q, wave, R, C, WAVES)
    rows = rb * BM + tl.arange(0, BM)
    scale = tl.load(S).to(tl.float32)
    bias = tl.load(B).to(tl.float32)
    m_i = tl.full((BM,), float("-inf"), tl.float32)  # online max and sum of this pass
    l_i = tl.zeros((BM,), tl.float32)
    last = first + 1 if WAVES else C
    for cb in range(first, last):
        cols = cb * BN + tl.arange(0, BN)
        raw = logits(X, Y, rows, cols, n, c, D, sx, sy, BM, BN, BD, LOW)
        lg = raw * scale + bias
        valid = (rows[:, None] < n) & (cols[None, :] < c)
        if HAS_MASK:
            valid = valid & ((rows[:, None] - cols[None, :]) != mask_offset)
        if SOFTPLUS:
            sp = tl.maximum(lg, 0.0) + tl.log(1.0 + tl.exp(-tl.abs(lg)))
            l_i += tl.sum(tl.where(valid, sp, 0.0), 1)
        else:
            lg = tl.where(valid, lg, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(lg, 1))
            safe = tl.where(m_new == float("-inf"), 0.0, m_new)
            l_i = l_i * tl.exp(m_i - safe) + tl.sum(tl.exp(lg - safe[:, None]), 1)
            m_i = m_new
            if HAS_COL:
                cmax = tl.max(lg, 0)
                csafe = tl.where(cmax == float("-inf"), 0.0, cmax)
                csum = tl.sum(tl.exp(lg - csafe[None, :]), 0)
                csum = tl.where(csum > 0, csum, 1.0)  # an empty column: no log of 0
                tile_col = tl.where(cmax == float("-inf"), cmax, csafe + tl.log(csum))
                old = tl.load(COL + cols, mask=cols < c, other=float("-inf"))
                tl.store(COL + cols, logaddexp(old, tile_col), mask=cols < c)
    if SOFTPLUS:
        old = tl.load(ROW + rows, mask=rows < n, other=0.0)
        tl.store(ROW + rows, old + l_i, mask=rows < n)
    else:
        safe = tl.where(m_i == float("-inf"), 0.0, m_i)
        part = tl.where(m_i == float("-inf"), m_i, safe + tl.log(tl.where(l_i > 0, l_i, 1.0)))
        old = tl.load(ROW + rows, mask=rows < n, other=float("-inf"))
        tl.store(ROW + rows, logaddexp(old, part), mask=rows < n)


@triton.jit
def backward(X, Y, S, B, ROW, GROW, COL, GCOL, DX, DY, PART, n, c, D, sx, sy,
             mask_offset, wave, R, C, P,
             SOFTPLUS: tl.constexpr, HAS_COL: tl.constexpr, HAS_MASK: tl.constexpr,
             WAVES: tl.constexpr, LOW: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr,
             BD: tl.constexpr):  # fmt: skip
    q = tl.program_id(0)
    rb, first = tile_of(q, wave, R, C, WAVES)
    rows = rb * BM + tl.arange(0, BM)
    scale = tl.load(S).to(tl.float32)
    bias = tl.load(B).to(tl.float32)
    g_row = tl.load(GROW + rows, mask=rows < n, other=0.0)
    row = tl.load(ROW + rows, mask=rows < n, other=float("inf"))  # padding: exp(-inf) = 0
    d_scale = tl.zeros((BM,), tl.float32)
    d_bias = tl.zeros((BM,), tl.float32)
    last = first + 1 if WAVES else C
    for cb in range(first, last):
        cols = cb * BN + tl.arange(0, BN)
        raw = logits(X, Y, rows, cols, n, c, D, sx, sy, BM, BN, BD, LOW)  # matmul 1
        lg = raw * scale + bias
        valid = (rows[:, None] < n) & (cols[None, :] < c)
        if HAS_MASK:
            valid = valid & ((rows[:, None] - cols[None, :]) != mask_offset)
        if SOFTPLUS:
            w = g_row[:, None] * tl.sigmoid(lg)
        else:
            w = g_row[:, None] * tl.exp(lg - row[:, None])
            if HAS_COL:
                col = tl.load(COL + cols, mask=cols < c, other=float("inf"))
                g_col = tl.load(GCOL + cols, mask=cols < c, other=0.0)
                w += g_col[None, :] * tl.exp(lg - col[None, :])
        w = tl.where(valid, w, 0.0)  # dL/dlogits
        d_scale += tl.sum(w * raw, 1)
        d_bias += tl.sum(w, 1)
        w = w * scale  # dL/draw
        for d0 in range(0, D, BD):
            d = d0 + tl.arange(0, BD)
            xm = (rows[:, None] < n) & (d[None, :] < D)
            ym = (cols[:, None] < c) & (d[None, :] < D)
            x = tl.load(X + rows[:, None] * sx + d[None, :], mask=xm, other=0.0)
            y = tl.load(Y + cols[:, None] * sy + d[None, :], mask=ym, other=0.0)
            if LOW:
                wl = w.to(x.dtype)
                dx = tl.dot(wl, y)  # matmul 2
                dy = tl.dot(tl.trans(wl), x)  # matmul 3
            else:
                dx = tl.dot(w, y.to(tl.float32), input_precision="ieee")
                dy = tl.dot(tl.trans(w), x.to(tl.float32), input_precision="ieee")
            dx_at = DX + rows[:, None] * D + d[None, :]
            tl.store(dx_at, tl.load(dx_at, mask=xm, other=0.0) + dx, mask=xm)
            dy_at = DY + cols[:, None] * D + d[None, :]
            if WAVES:
                tl.store(dy_at, tl.load(dy_at, mask=ym, other=0.0) + dy, mask=ym)
            else:
                tl.atomic_add(dy_at, dy, mask=ym)
    slot = wave * P + q
    tl.store(PART + 2 * slot, tl.sum(d_scale, 0))
    tl.store(PART + 2 * slot + 1, tl.sum(d_bias, 0))
