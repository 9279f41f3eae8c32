"""Mixed precision: collectives and losses under ``torch.autocast`` match one process under the
same autocast.

Semantics asserted: an encoder (``nn.Linear``, float32 weights) runs under
``torch.autocast("cpu", dtype=torch.bfloat16)``, so its outputs are bfloat16, as in mixed
precision training. On 2 gloo ranks, each with its rows, the collectives' outputs and input
gradients, and each loss's value and parameter gradients (averaged over ranks, as DDP does),
equal the same code run in one process on the whole batch under the same autocast.

Tolerances, and why: the collectives move bfloat16 values without arithmetic, or sum two of
them (one rounding, the same in one process): equal to 1e-2 relative (two bfloat16 ulps), and
the gradients the same. The losses compute in float32 from the same bfloat16 features (a
Linear's rows do not depend on which other rows share the batch), so their values agree to
float32 rounding of sums in another order (1e-5 relative); the parameter gradients pass back
through the bfloat16 encoder (2e-2 relative, about five bfloat16 ulps).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn

import distgrad as dg
from distgrad.testing import run_on_ranks
from tests._support import seeded

ROWS = (3, 5)  # rank 0's and rank 1's rows
BF16 = {"dtype": torch.bfloat16}
LOSSES = ["info_nce", "nt_xent", "clip_loss", "siglip_loss", "barlow_twins"]


def _encoder() -> nn.Linear:
    torch.manual_seed(0)
    return nn.Linear(6, 8)


def _batch() -> tuple[Tensor, Tensor]:
    gen = seeded(1)
    return torch.randn(sum(ROWS), 6, generator=gen), torch.randn(sum(ROWS), 6, generator=gen)


def _loss(name: str, a: Tensor, b: Tensor, **kwargs: Any) -> Tensor:
    out: Tensor = getattr(dg.losses, name)(a, b, **kwargs)
    return out


def _run(rank: int, world_size: int, block_size: int | None) -> dict[str, Any]:
    """Every loss and two collectives on this rank's rows; one process when world_size is 1."""
    start = sum(ROWS[:rank]) if world_size > 1 else 0
    stop = start + (ROWS[rank] if world_size > 1 else sum(ROWS))
    sizes = list(ROWS) if world_size > 1 else None
    a, b = (t[start:stop] for t in _batch())
    found: dict[str, Any] = {}
    for name in LOSSES:
        encoder = _encoder()
        with torch.autocast("cpu", **BF16):
            za, zb = encoder(a), encoder(b)
            assert za.dtype == torch.bfloat16  # the features are bfloat16, as in AMP training
            ring = {} if name == "barlow_twins" or block_size is None else {"block_size": 2}
            loss = _loss(name, za, zb, sizes=sizes, **ring)
        loss.backward()
        found[name] = (loss.detach(), [p.grad for p in encoder.parameters()])
    encoder = _encoder()
    with torch.autocast("cpu", **BF16):
        z = encoder(a)
        if world_size > 1:
            gathered, summed = dg.all_gather(z, sizes=sizes), dg.all_reduce(z[:3])
        else:  # what the two ranks compute, in one process
            gathered, summed = z, z[:3] + z[ROWS[0] : ROWS[0] + 3]
    v = torch.linspace(-1, 1, gathered.numel()).view_as(gathered)
    ((gathered * v).sum() + summed.sum()).backward()
    grads = [p.grad for p in encoder.parameters()]
    found["collectives"] = (gathered.detach(), summed.detach(), grads)
    return found


def _close(got: Tensor, want: Tensor, rtol: float, what: str, scale: float = 1.0) -> None:
    """Equal to ``rtol`` relative, or absolute against ``scale`` (the largest entry of the
    gradients compared: an entry that should be 0, such as Barlow Twins' bias gradient, is
    bfloat16 noise of that size)."""
    torch.testing.assert_close(
        got.float(), want.float(), rtol=rtol, atol=rtol * scale, msg=lambda m: f"{what}: {m}"
    )


def _largest(grads: list[Tensor]) -> float:
    return max(float(g.abs().max()) for g in grads)


def _compare(block_size: int | None) -> None:
    ranks = run_on_ranks(_run, 2, args=(block_size,), timeout=60)
    (one,) = run_on_ranks(_run, 1, args=(block_size,), init="process_group", timeout=60)
    for name in LOSSES:
        want_value, want_grads = one[name]
        for rank in ranks:
            _close(rank[name][0], want_value, 1e-5, f"{name} value")
        for i, want in enumerate(want_grads):  # DDP averages the ranks' gradients
            got = sum(r[name][1][i] for r in ranks) / 2
            what = f"{name} gradient of encoder parameter {i}"
            _close(got, want, 2e-2, what, _largest(want_grads))
    want_gathered, want_summed, want_grads = one["collectives"]
    for rank in ranks:
        gathered, summed, _ = rank["collectives"]
        assert gathered.dtype == summed.dtype == torch.bfloat16
        _close(gathered, want_gathered, 1e-2, "all_gather output")
        _close(summed, want_summed, 1e-2, "all_reduce output")
    for i, want in enumerate(want_grads):  # the sum objective, averaged as DDP does
        got = sum(r["collectives"][2][i] for r in ranks) / 2
        what = f"collectives: gradient of encoder parameter {i}"
        _close(got, want, 2e-2, what, _largest(want_grads))


def test_collectives_and_losses_under_bfloat16_autocast_match_one_process() -> None:
    _compare(block_size=None)


def test_ring_losses_under_bfloat16_autocast_match_one_process() -> None:
    _compare(block_size=2)


def test_losses_compute_in_float32_under_bfloat16_autocast() -> None:
    """A loss of bfloat16 features under autocast equals the float64 loss of the same features
    to float32 rounding (1e-5 relative): the logits and their reductions are not computed in
    bfloat16 (measured with bfloat16 logits, InfoNCE at B=1024, D=128, t=0.07: logits off by
    up to 0.09, the value by 1e-4, the features' gradient by 6e-3 relative)."""
    a, b = _batch()
    encoder = _encoder()
    for name in LOSSES:
        for ring in ({}, {"block_size": 3}) if name != "barlow_twins" else ({},):
            with torch.autocast("cpu", **BF16):
                za, zb = encoder(a), encoder(b)
                loss = _loss(name, za, zb, **ring)
            exact = _loss(name, za.double(), zb.double(), **ring)
            assert loss.dtype == torch.float32, name
            _close(loss, exact, 1e-5, f"{name} {ring}")
