"""CLIP's and SigLIP's dense paths (one logits product per rank) against the formulas as
written in one process: CLIP with its two cross-entropies over two products (``s X Y^T`` and
``s Y X^T``), SigLIP with ``-log sigmoid(z_ij l_ij)`` and its sign matrix.

Semantics asserted (docs/losses.md, "The gradient contract"): on every rank the value is the
single-process loss; each rank's input gradients are world_size times the single-process
gradient of its rows; the scale and bias gradients summed over ranks are world_size times the
single-process ones. Double backward (CLIP): every rank takes ``g_r = dL_r/d(x_r, y_r)`` with
``create_graph=True`` and back-propagates ``<g_r, v_r>`` with a random ``v``; under the sum
objective that is ``W <dL/dz, v>``, so each rank's rows get ``W (H v)_r``. float64, tolerance
FLOAT64 (only the order of the sums differs), 1 to 4 ranks, uneven and empty shards. Each test
runs on processes and simulated (``run_on_ranks(simulate=True)``: every rank in this process,
the rank as data), and simulated also at 8 ranks and, in the slow tier, at 64.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor

import distgrad as dg
from distgrad.testing import run_on_ranks
from tests._support import FLOAT64, rows_of, seeded

SHARDINGS = [[7], [4, 3], [3, 0, 4], [1, 3, 2, 1], [7, 0]]
# Simulated: every rank in one process, so eight ranks cost what two do on processes.
SIMULATED = [*SHARDINGS, [1, 0, 2, 1, 1, 0, 1, 1]]
RUNS = [
    *(pytest.param(sizes, False, id=f"{sizes}-processes") for sizes in SHARDINGS),
    *(pytest.param(sizes, True, id=f"{sizes}-simulated") for sizes in SIMULATED),
    pytest.param([1, 2] * 32, True, id="64 ranks-simulated", marks=pytest.mark.slow),
]
SCALE, BIAS = 6.5, -2.0


def _batch(rows: int) -> list[Tensor]:
    """Images and texts [rows, 5], correlated, and two random cotangents of that shape."""
    gen = seeded(3)
    base = torch.randn(rows, 5, dtype=torch.float64, generator=gen)
    image = base + 0.3 * torch.randn(rows, 5, dtype=torch.float64, generator=gen)
    text = base + 0.3 * torch.randn(rows, 5, dtype=torch.float64, generator=gen)
    v = [torch.randn(rows, 5, dtype=torch.float64, generator=gen) for _ in range(2)]
    return [image, text, *v]


def two_products_clip(x: Tensor, y: Tensor, s: Tensor) -> Tensor:
    """CLIP as written: two logits products, a cross-entropy each way."""
    x, y = F.normalize(x, dim=1), F.normalize(y, dim=1)
    labels = torch.arange(len(x))
    return (F.cross_entropy(s * x @ y.T, labels) + F.cross_entropy(s * y @ x.T, labels)) / 2


def signs_siglip(x: Tensor, y: Tensor, s: Tensor, b: Tensor) -> Tensor:
    """SigLIP as written: ``-log sigmoid(z_ij l_ij)`` with a sign matrix, a sum per image."""
    x, y = F.normalize(x, dim=1), F.normalize(y, dim=1)
    signs = 2 * torch.eye(len(x), dtype=x.dtype) - 1
    return -F.logsigmoid(signs * (s * x @ y.T + b)).sum() / len(x)


def _leaves(sizes: list[int], rank: int | None) -> list[Tensor]:
    x, y, vx, vy = (t if rank is None else rows_of(t, sizes, rank) for t in _batch(sum(sizes)))
    s = torch.tensor(SCALE, dtype=torch.float64)
    b = torch.tensor(BIAS, dtype=torch.float64)
    return [t.clone().requires_grad_(True) for t in (x, y, s, b)] + [vx, vy]


def _first_order(rank: int, world_size: int, sizes: list[int]) -> list[list[Tensor]]:
    found = []
    for name in ("clip", "siglip"):
        x, y, s, b, _, _ = _leaves(sizes, rank)
        if name == "clip":
            loss = dg.losses.clip_loss(x, y, s, sizes=sizes)
        else:
            loss = dg.losses.siglip_loss(x, y, s, b, sizes=sizes)
        loss.backward()
        grads = [torch.zeros(()) if t.grad is None else t.grad for t in (x, y, s, b)]
        found.append([loss.detach(), *grads])
    return found


@pytest.mark.parametrize(("sizes", "simulate"), RUNS)
def test_one_product_dense_paths_equal_the_written_formulas(
    sizes: list[int], simulate: bool
) -> None:
    """Value on every rank, input gradients W times the single-process rows, scale and bias
    gradients summed over ranks W times the single-process ones."""
    per_rank = run_on_ranks(_first_order, len(sizes), args=(sizes,), simulate=simulate)
    w = len(sizes)
    for case, name in enumerate(("clip", "siglip")):
        x, y, s, b, _, _ = _leaves(sizes, None)
        want = two_products_clip(x, y, s) if name == "clip" else signs_siglip(x, y, s, b)
        want.backward()
        for result in per_rank:
            torch.testing.assert_close(result[case][0], want.detach(), **FLOAT64, msg=name)
        for i, ref in enumerate((x.grad, y.grad), start=1):
            got = torch.cat([r[case][i] for r in per_rank])
            torch.testing.assert_close(got, w * ref, **FLOAT64, msg=f"{name} input {i}")
        for i, ref in enumerate((s.grad, b.grad), start=3):
            if ref is None:  # CLIP has no bias
                continue
            got = sum(r[case][i] for r in per_rank)
            torch.testing.assert_close(got, w * ref, **FLOAT64, msg=f"{name} scalar {i}")


def _second_order(rank: int, world_size: int, sizes: list[int]) -> list[Tensor]:
    x, y, s, _, vx, vy = _leaves(sizes, rank)
    loss = dg.losses.clip_loss(x, y, s, sizes=sizes)
    gx, gy = torch.autograd.grad(loss, [x, y], create_graph=True)
    ((gx * vx).sum() + (gy * vy).sum()).backward()
    assert x.grad is not None and y.grad is not None and s.grad is not None
    return [gx.detach(), gy.detach(), x.grad, y.grad, s.grad]


@pytest.mark.parametrize(
    ("sizes", "simulate"),
    [
        pytest.param(sizes, sim, id=f"{sizes}-{'simulated' if sim else 'processes'}")
        for sim in (False, True)
        for sizes in ([4, 3], [3, 0, 4], [1, 3, 2, 1])
    ],
)
def test_clip_dense_path_is_twice_differentiable(sizes: list[int], simulate: bool) -> None:
    """First-order gradients W times the single-process ones; the Hessian-vector products of
    the objective sum_r <g_r, v_r> equal W times the single-process ones (rows on their owner,
    the scale's summed over ranks)."""
    per_rank = run_on_ranks(_second_order, len(sizes), args=(sizes,), simulate=simulate)
    w = len(sizes)
    x, y, s, _, vx, vy = _leaves(sizes, None)
    gx, gy = torch.autograd.grad(two_products_clip(x, y, s), [x, y], create_graph=True)
    ((gx * vx).sum() + (gy * vy).sum()).backward()
    for i, ref in enumerate((gx.detach(), gy.detach(), x.grad, y.grad)):
        got = torch.cat([r[i] for r in per_rank])
        torch.testing.assert_close(got, w * ref, **FLOAT64, msg=f"output {i}")
    torch.testing.assert_close(sum(r[4] for r in per_rank), w * s.grad, **FLOAT64)


def test_clip_dense_path_is_twice_differentiable_in_one_process() -> None:
    """No process group (world size 1): the Hessian-vector product equals the written formula's."""
    x, y, s, _, vx, vy = _leaves([7], None)
    gx, gy = torch.autograd.grad(dg.losses.clip_loss(x, y, s), [x, y], create_graph=True)
    ((gx * vx).sum() + (gy * vy).sum()).backward()
    got = [x.grad, y.grad, s.grad]
    x, y, s, _, vx, vy = _leaves([7], None)
    gx, gy = torch.autograd.grad(two_products_clip(x, y, s), [x, y], create_graph=True)
    ((gx * vx).sum() + (gy * vy).sum()).backward()
    for mine, ref in zip(got, [x.grad, y.grad, s.grad], strict=True):
        torch.testing.assert_close(mine, ref, **FLOAT64)
