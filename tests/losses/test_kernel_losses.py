"""Every ring-able loss through the fused tile kernels (``dg.losses.set_kernels("triton")``,
run by Triton's interpreter on CPU tensors) equals the float64 single-process loss.

Semantics asserted (as tests/losses/test_blockwise.py, the sum objective): each rank, float32
features, ``block_size=2`` (several tiles per block, several blocks per rank), returns the
single-process loss of the whole batch; its features' gradients are world_size times its rows
of the single-process gradient, and the learnable scale's and bias's gradients, averaged over
ranks (DDP), are the single-process ones. Reference: the same loss's dense path in one process
in float64. CLIP in both directions, SigLIP with a learnable scale and bias, InfoNCE with two
hard negatives per query in both directions, NT-Xent; uneven shards on 1 to 4 ranks.
float32 against float64: 1e-5 relative (``KERNEL``).
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch import Tensor

import distgrad as dg
from distgrad.losses import _triton
from distgrad.testing import run_on_ranks
from tests._support import rows_of, seeded

pytestmark = pytest.mark.skipif(not _triton.available(), reason="needs triton (the kernels extra)")

KERNEL = {"rtol": 1e-5, "atol": 1e-6}  # float32 tiles against the float64 reference
DIM = 6
LOSSES = ("clip", "siglip", "info_nce", "nt_xent")


def _batch(total: int) -> list[Tensor]:
    g = seeded(total)
    x, y = (torch.randn(total, DIM, dtype=torch.float64, generator=g) for _ in range(2))
    negatives = torch.randn(total, 2, DIM, dtype=torch.float64, generator=g)
    return [x, y, negatives]


def _loss(name: str, x: Tensor, y: Tensor, n: Tensor, s: Tensor, b: Tensor, **kw: object) -> Tensor:
    if name == "clip":
        return dg.losses.clip_loss(x, y, s, **kw)  # type: ignore[arg-type]
    if name == "siglip":
        return dg.losses.siglip_loss(x, y, s, b, **kw)  # type: ignore[arg-type]
    if name == "info_nce":
        both = ("query_to_key", "key_to_query")
        return dg.losses.info_nce(x, y, negatives=n, directions=both, temperature=1 / s, **kw)  # type: ignore[arg-type]
    return dg.losses.nt_xent(x, y, temperature=1 / s, **kw)  # type: ignore[arg-type]


def _on_rank(rank: int, world: int, sizes: list[int]) -> None:
    dg.losses.set_kernels("triton")
    # A group of each rank alone (made by every rank, as new_group wants): the reference runs
    # in one process whatever the world.
    alone = [dist.new_group([r]) for r in range(world)][rank]
    total = sum(sizes)
    for name in LOSSES:
        # The reference: float64, one process, the whole batch, the dense path.
        ref = [t.clone().requires_grad_() for t in _batch(total)]
        s64 = torch.tensor(4.0, dtype=torch.float64, requires_grad=True)
        b64 = torch.tensor(-2.0, dtype=torch.float64, requires_grad=True)
        want = _loss(name, *ref, s64, b64, group=alone)
        want.backward()
        # This rank: float32 rows of it, the ring path through the kernels.
        mine = [rows_of(t, sizes, rank).float().requires_grad_() for t in _batch(total)]
        s = torch.tensor(4.0, requires_grad=True)
        b = torch.tensor(-2.0, requires_grad=True)
        got = _loss(name, *mine, s, b, sizes=sizes, block_size=2)
        torch.testing.assert_close(got.double(), want.detach(), **KERNEL, msg=name)
        got.backward()
        used = 3 if name == "info_nce" else 2
        for t, r in zip(mine[:used], ref[:used], strict=True):
            assert t.grad is not None and r.grad is not None
            expected = world * rows_of(r.grad, sizes, rank)
            torch.testing.assert_close(t.grad.double(), expected, **KERNEL, msg=name)
        for p, r in ((s, s64), (b, b64)):
            if r.grad is None:
                continue
            assert p.grad is not None
            mean = dg.all_reduce(p.grad.double(), op="avg")
            torch.testing.assert_close(mean, r.grad, **KERNEL, msg=f"{name}: scale/bias")


@pytest.mark.parametrize(
    "sizes",
    [
        [5],
        [4, 3],
        pytest.param([3, 1, 2], marks=pytest.mark.slow),
        pytest.param([2, 3, 1, 2], marks=pytest.mark.slow),
    ],
    ids=lambda s: f"{len(s)} ranks {s}",
)
def test_every_ring_loss_through_the_kernels_equals_one_float64_process(sizes: list[int]) -> None:
    run_on_ranks(_on_rank, len(sizes), args=(sizes,), timeout=240)
