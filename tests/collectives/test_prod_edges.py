"""prod's gradient at the edges equals the documented formula, on every rank.

The formula (docs/semantics.md, "Non-linear reductions"): rank r's entry gets the incoming
gradient times the product of the *other* ranks' entries, with no division. The reference
below writes that exclusive product out explicitly in float64, in one process, and rounds it to
the tested dtype; inputs hold inf, nan, one zero, several zeros, products that overflow
(1e200 * 1e200) and products that underflow (1e-200 * 1e-200), where torch.prod's own backward
(which divides) gives nan, inf or 0 instead.

Tolerance: with 2 or 3 ranks every exclusive product is at most one multiplication, so it is
correctly rounded; the multiplication by the incoming gradient adds one more rounding, and the
reference rounds once: 1 ulp of relative difference (rtol 2 ulp). inf and nan must match
exactly (same positions, same signs).
"""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch

import distgrad as dg
from distgrad.testing import run_on_ranks
from tests._support import seeded

# Per world size: entries as columns, one row per rank. float64 values; the float32 variant
# scales the overflow and underflow columns into float32's range (1e30, 1e-30).
_BIG, _SMALL = "big", "small"
_COLUMNS: dict[int, list[list[Any]]] = {
    2: [
        [math.inf, 2.0],  # torch.prod's backward gives nan on rank 0; the formula 2 * g
        [2.0, math.inf],
        [-math.inf, 3.0],
        [math.nan, 5.0],
        [0.0, 7.0],  # one zero
        [0.0, 0.0],  # several zeros
        [0.0, math.inf],  # 0 * inf: the zero's gradient is inf * g, the inf's is 0 * g
        [_BIG, _BIG],  # the full product overflows; each exclusive product does not
        [_SMALL, _SMALL],  # the full product underflows; each exclusive product does not
        [_BIG, _SMALL],
        [1.5, -2.5],
        [-0.0, 4.0],
    ],
    3: [
        [math.inf, 2.0, 3.0],
        [math.inf, math.inf, 3.0],
        [math.nan, 2.0, 3.0],
        [0.0, 2.0, 3.0],
        [0.0, 0.0, 3.0],
        [0.0, 0.0, 0.0],
        [0.0, math.inf, 3.0],
        [_BIG, _BIG, 1.0],
        [_SMALL, _SMALL, 1.0],
        [_BIG, _SMALL, 4.0],
        [_BIG, _BIG, _SMALL],  # rank 2's exclusive product overflows, as the formula says
        [1.5, -2.5, 0.5],
    ],
}
_SCALE = {torch.float64: (1e200, 1e-200), torch.float32: (1e30, 1e-30)}
_OPS = ("all_reduce", "reduce_scatter", "reduce")
_DST = 1  # reduce's destination: not rank 0, so a rank mix-up shows


def _entries(world_size: int, dtype: torch.dtype) -> torch.Tensor:
    """[world_size, entries]: rank r's input is row r."""
    big, small = _SCALE[dtype]
    value = {_BIG: big, _SMALL: small}
    rows = [
        [value.get(v, v) if isinstance(v, str) else v for v in col] for col in _COLUMNS[world_size]
    ]
    return torch.tensor(rows, dtype=torch.float64).T.contiguous()


def _cotangent(op: str, world_size: int, entries: int) -> torch.Tensor:
    """[world_size, output entries]: each rank's random cotangent for its output."""
    out = entries if op != "reduce_scatter" else entries // world_size
    gen = seeded(7)
    return torch.rand(world_size, out, dtype=torch.float64, generator=gen) + 0.5


def _exclusive_product(x: torch.Tensor) -> torch.Tensor:
    """[R, E] -> [R, E]: entry (r, e) is the product over s != r of x[s, e], written out."""
    out = torch.ones_like(x)
    for r in range(x.shape[0]):
        for s in range(x.shape[0]):
            if s != r:
                out[r] = out[r] * x[s]
    return out


def _reference(op: str, x: torch.Tensor, v: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Every rank's gradient, [R, E], in float64 from the formula, rounded to ``dtype``."""
    world_size, entries = x.shape
    if op == "all_reduce":
        incoming = v.sum(0).expand(world_size, entries)  # every rank's output is the product
    elif op == "reduce":
        incoming = v[_DST].expand(world_size, entries)  # only dst's output carries the product
    else:
        incoming = v.reshape(-1).expand(world_size, entries)  # rank r owns slice r
    return (incoming * _exclusive_product(x.to(dtype).double())).to(dtype)


def _grads(rank: int, world_size: int, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    x_all = _entries(world_size, dtype).to(dtype)
    out = {}
    for op in _OPS:
        x = x_all[rank].clone().requires_grad_(True)
        v = _cotangent(op, world_size, x.numel())[rank].to(dtype)
        if op == "all_reduce":
            y = dg.all_reduce(x, "prod")
        elif op == "reduce":
            y = dg.reduce(x, _DST, "prod")
        else:
            y = dg.reduce_scatter(x, "prod")
        (y * v).sum().backward()
        assert x.grad is not None
        out[op] = x.grad
    return out


@pytest.mark.parametrize("world_size", [2, 3])
def test_prod_gradient_is_the_incoming_gradient_times_the_others_product(world_size: int) -> None:
    """Objective: sum over ranks of <prod(x), v_r>; inf, nan, zeros, overflow and underflow.

    Both dtypes run in one launch per world size (each launch costs a process start).
    """
    per_rank = run_on_ranks(_grads_both, world_size)
    failures = []
    for dtype in (torch.float64, torch.float32):
        x = _entries(world_size, dtype)
        for op in _OPS:
            v = _cotangent(op, world_size, x.shape[1])
            expected = _reference(op, x, v, dtype)
            for rank, grads in enumerate(per_rank):
                got = grads[str(dtype)][op]
                eps = torch.finfo(dtype).eps
                try:
                    torch.testing.assert_close(
                        got, expected[rank], rtol=2 * eps, atol=0.0, equal_nan=True
                    )
                except AssertionError as exc:
                    failures.append(
                        f"{op} {dtype} rank {rank}: {exc}\n got {got}\n want {expected[rank]}"
                    )
    assert not failures, "\n".join(failures)


def _grads_both(rank: int, world_size: int) -> dict[str, dict[str, torch.Tensor]]:
    return {str(dtype): _grads(rank, world_size, dtype) for dtype in (torch.float64, torch.float32)}


def test_the_formula_differs_from_torch_prod_backward_where_it_divides() -> None:
    """The reference is not torch.prod's backward: (inf, 2) gives nan there, 2 * g here."""
    x = torch.tensor([[math.inf], [2.0]], dtype=torch.float64, requires_grad=True)
    x.prod(0).sum().backward()
    assert x.grad is not None and math.isnan(x.grad[0, 0].item())
    assert _exclusive_product(x.detach())[:, 0].tolist() == [2.0, math.inf]
