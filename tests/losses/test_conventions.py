"""distgrad's losses against the papers' formulas, and other code's conventions measured.

Semantics asserted:
* ``clip_loss`` and ``siglip_loss`` with ``normalize=False`` on features the model already
  normalised equal CLIP's and SigLIP's formulas (written from the papers in tests/losses/
  ported.py, as open_clip computes them) on the full batch: on 2 gloo ranks, dense and ring, the
  value on every rank, input gradients world_size times the formula's (the contract of
  docs/losses.md), and the scalars' gradients averaged over ranks equal to the formula's.
  float64, tolerance 1e-10 (reduction order).
* The figures of docs/losses.md, "Coming from open_clip / SimCLR / Barlow Twins code": each
  port's gradient factor under DDP averaging and whether its value is rank-local, measured with
  dg.testing.check_against_single_process on 2 ranks (8 rows, a Linear(5, 4) encoder).
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor

import distgrad as dg
from distgrad.testing import GradReport, check_against_single_process, run_on_ranks
from tests._support import FLOAT64, seeded
from tests.losses import ported as P

ROWS, DIM = 8, 5


def _raw(seed: int = 1) -> tuple[Tensor, Tensor]:
    """Paired raw features: two noisy copies of the same points (not normalised)."""
    gen = seeded(seed)
    base = torch.randn(ROWS, DIM, dtype=torch.float64, generator=gen)
    noise = 0.3 * torch.randn(2, ROWS, DIM, dtype=torch.float64, generator=gen)
    return 3 * (base + noise[0]), 3 * (base + noise[1])


def _unit() -> tuple[Tensor, Tensor]:
    x, y = _raw()
    return F.normalize(x, dim=1), F.normalize(y, dim=1)


def _distgrad(
    kind: str, x: Tensor, y: Tensor, s: Tensor, b: Tensor, block: int | None, normalize: bool
) -> Tensor:
    if kind == "clip":
        return dg.losses.clip_loss(x, y, s, normalize=normalize, block_size=block)
    return dg.losses.siglip_loss(x, y, s, b, normalize=normalize, block_size=block)


def _formula(kind: str, x: Tensor, y: Tensor, s: Tensor, b: Tensor) -> Tensor:
    return P.clip_formula(x, y, s) if kind == "clip" else P.siglip_formula(x, y, s, b)


def _leaves(x: Tensor, y: Tensor) -> list[Tensor]:
    s, b = torch.tensor(P.SCALE), torch.tensor(P.BIAS)
    return [t.double().clone().requires_grad_() for t in (x, y, s, b)]


CASES = [("clip", None), ("clip", 3), ("siglip", None), ("siglip", 3)]


def _on_ranks(rank: int, world_size: int) -> list[list[Tensor]]:
    rows = slice(rank * ROWS // world_size, (rank + 1) * ROWS // world_size)
    out = []
    for kind, block in CASES:
        x, y = _unit()
        x, y, s, b = _leaves(x[rows], y[rows])
        loss = _distgrad(kind, x, y, s, b, block, normalize=False)
        loss.backward()
        out.append([loss.detach(), *(t.grad for t in (x, y, s, b) if t.grad is not None)])
    return out


def test_clip_and_siglip_equal_the_papers_formulas_on_prenormalised_features() -> None:
    per_rank = run_on_ranks(_on_ranks, 2)
    for i, (kind, block) in enumerate(CASES):
        x, y, s, b = _leaves(*_unit())
        expected = _formula(kind, x, y, s, b)
        expected.backward()
        scalar_grads = [s.grad] if kind == "clip" else [s.grad, b.grad]
        for rank, result in enumerate(per_rank):
            value, gx, gy, *_ = result[i]
            rows = slice(rank * ROWS // 2, (rank + 1) * ROWS // 2)
            where = f"{kind} block={block} rank {rank}"
            torch.testing.assert_close(value, expected.detach(), **FLOAT64, msg=where)
            assert x.grad is not None and y.grad is not None
            torch.testing.assert_close(gx, 2 * x.grad[rows], **FLOAT64, msg=where)
            torch.testing.assert_close(gy, 2 * y.grad[rows], **FLOAT64, msg=where)
        for j, want in enumerate(scalar_grads):
            averaged = sum(r[i][3 + j] for r in per_rank) / 2
            torch.testing.assert_close(averaged, want, **FLOAT64, msg=f"{kind} scalar {j}")


@pytest.mark.parametrize("kind", ["clip", "siglip"])
def test_normalize_false_takes_raw_features_as_given(kind: str) -> None:
    """On raw features, normalize=False is the formula on them; the default normalises."""
    x, y, s, b = _leaves(*_raw())
    as_given = _distgrad(kind, x, y, s, b, None, normalize=False)
    torch.testing.assert_close(as_given, _formula(kind, x, y, s, b), **FLOAT64)
    normalised = _formula(kind, F.normalize(x, dim=1), F.normalize(y, dim=1), s, b)
    default = _distgrad(kind, x, y, s, b, None, normalize=True)
    torch.testing.assert_close(default, normalised, **FLOAT64)
    assert abs(as_given.item() - default.item()) > 1.0  # the switch matters on raw features


@pytest.mark.parametrize("kind", ["clip", "siglip"])
def test_normalising_prenormalised_features_again_changes_no_encoder_gradient(kind: str) -> None:
    """The second normalisation of a unit vector has Jacobian I - x x^T, which the first one
    already applied: same value, same encoder gradient (only the features' own gradient loses
    its radial part)."""
    results = []
    for normalize in (False, True):
        encoder = P.Encoder()
        x, y = _raw()
        fx, fy = F.normalize(encoder(x), dim=1), F.normalize(encoder(y), dim=1)
        s, b = P.SCALE, P.BIAS
        if kind == "clip":
            loss = dg.losses.clip_loss(fx, fy, s, normalize=normalize)
        else:
            loss = dg.losses.siglip_loss(fx, fy, s, b, normalize=normalize)
        loss.backward()
        results.append((loss.detach(), [p.grad for p in encoder.parameters()]))
    (v0, g0), (v1, g1) = results
    torch.testing.assert_close(v0, v1, **FLOAT64)
    for a, c in zip(g0, g1, strict=True):
        torch.testing.assert_close(a, c, **FLOAT64)


# ------------------------------------------------------------------ measured conventions


def _pairs(first: str, second: str) -> dict[str, Tensor]:
    """Rank 0's half of the pairs is noisier (harder) than rank 1's."""
    gen = seeded(2)
    base = torch.randn(ROWS, DIM, dtype=torch.float64, generator=gen)
    noise = torch.randn(2, ROWS, DIM, dtype=torch.float64, generator=gen)
    level = torch.tensor([0.6] * (ROWS // 2) + [0.2] * (ROWS // 2), dtype=torch.float64)[:, None]
    return {first: base + level * noise[0], second: base + level * noise[1]}


def _check(fn: object, names: tuple[str, str], gradients: str = "averaged") -> GradReport:
    return check_against_single_process(
        fn,  # type: ignore[arg-type]
        _pairs(*names),
        world_size=2,
        model=P.Encoder,
        gradients=gradients,  # type: ignore[arg-type]
    )


def _scales(report: GradReport) -> set[float | None]:
    """The factors (got / expected, least squares) of the gradients that differ."""
    return {None if c.scale is None else round(c.scale, 6) for c in report.checks if not c.ok}


def _value_ratios(report: GradReport) -> list[float]:
    return [x / report.reference_loss for x in report.losses]


IMAGE_TEXT, VIEWS = ("image", "text"), ("view1", "view2")


def test_open_clip_default_clip_loss_gives_one_over_w_of_the_gradient_under_ddp() -> None:
    """ClipLoss() (no local_loss, no gather_with_grad): the global value on every rank, and
    each rank's features get only their own slot's gradient: right if summed, x1/2 under DDP."""
    report = _check(P.open_clip_default, IMAGE_TEXT)
    assert report.contracts == {"averaged": False, "summed": True}
    assert _scales(report) == {0.5}
    assert _value_ratios(report) == pytest.approx([1.0, 1.0], rel=1e-12)
    assert "every gradient is scaled by 1/2" in report.diagnoses[0]


def test_open_clip_default_gives_the_scale_its_exact_gradient_and_the_encoder_1_over_w() -> None:
    """ClipLoss() with a learnable logit scale: every rank's loss is the whole global loss, so
    the scale's gradient is exact on every rank (DDP's average keeps it); the encoder's is 1/2
    (W = 2). Under DDP the two get different effective learning rates."""
    report = check_against_single_process(
        P.open_clip_default_learnable_scale,  # type: ignore[arg-type]
        _pairs(*IMAGE_TEXT),
        world_size=2,
        model=P.EncoderAndScale,
    )
    params = {c.name: c for c in report.checks if c.name.startswith("param ")}
    assert params["param logit_scale"].ok, params
    wrong = {name: round(c.scale or 0.0, 6) for name, c in params.items() if not c.ok}
    assert wrong == {"param linear.weight": 0.5, "param linear.bias": 0.5}, wrong


def test_open_clip_local_loss_without_gather_with_grad_misses_cross_rank_terms() -> None:
    report = _check(P.open_clip_local_loss, IMAGE_TEXT)
    assert report.contracts == {"averaged": False, "summed": False}
    assert "misses the terms that flow through other ranks" in report.diagnoses[0]


def test_open_clip_recommended_flags_are_exact_but_report_a_rank_local_value() -> None:
    """local_loss=True, gather_with_grad=True: exact under DDP; each rank's value is the mean
    over its own rows (measured on this batch, rank 0 holding the noisier half: CLIP 1.37x and
    0.63x of the truth, SigLIP 0.89x and 1.11x), averaging to it."""
    for fn in (P.open_clip_local_loss_gather_with_grad, P.open_clip_siglip):
        report = _check(fn, IMAGE_TEXT)
        assert report.ok, str(report)
        ratios = _value_ratios(report)
        assert all(abs(r - 1) > 0.1 for r in ratios), ratios
        assert sum(ratios) / 2 == pytest.approx(1.0, rel=1e-12)


def test_distgrad_clip_and_siglip_are_exact_with_the_global_value_on_every_rank() -> None:
    for fn in (P.distgrad_clip, P.distgrad_siglip):
        report = _check(fn, IMAGE_TEXT)
        assert report.ok, str(report)
        assert _value_ratios(report) == pytest.approx([1.0, 1.0], rel=1e-12)


def test_official_simclr_loss_is_twice_nt_xent_and_exact_with_summed_gradients() -> None:
    """The TF2 script: mean(loss_a + loss_b) counts both directions (2x nt_xent's mean over
    2B anchors), and it divides by the replica count because the replicas' gradients are
    summed: exact then; under DDP's averaging it would be x1/2."""
    x, y = _raw()
    encoder = P.Encoder()
    official, ours = P.simclr_official(encoder, x, y), P.distgrad_nt_xent(encoder, x, y)
    torch.testing.assert_close(official, 2 * ours, **FLOAT64)
    assert _check(P.simclr_official, VIEWS, gradients="summed").ok
    assert _scales(_check(P.simclr_official, VIEWS)) == {0.5}


def test_a_gatherlayer_simclr_port_gives_one_over_w_of_the_gradient_under_ddp() -> None:
    """The whole global batch's NT-Xent on every rank, gathered by a GatherLayer whose
    backward keeps its own slice: the global value, x1/2 under DDP."""
    report = _check(P.simclr_gatherlayer_port, VIEWS)
    assert report.contracts == {"averaged": False, "summed": True}
    assert _scales(report) == {0.5}


def test_official_barlow_twins_gives_one_over_w_of_the_gradient_under_ddp() -> None:
    """The raw all_reduce of c is invisible to autograd: each rank's gradient is its own rows'
    part of dL/dz, exactly right if summed, x1/2 under DDP. distgrad's barlow_twins: exact."""
    report = _check(P.barlow_twins_official, VIEWS)
    assert report.contracts == {"averaged": False, "summed": True}
    assert _scales(report) == {0.5}
    assert _value_ratios(report) == pytest.approx([1.0, 1.0], rel=1e-12)
    ours = _check(P.distgrad_barlow_twins, VIEWS)
    assert ours.ok, str(ours)
    assert ours.reference_loss == pytest.approx(report.reference_loss, rel=1e-12)


def test_clip_loss_module_clamps_in_the_forward_where_open_clip_clamps_the_parameter() -> None:
    """CLIPLoss clamps exp(log_logit_scale) at 100 in the forward, so above 100 the parameter
    gets no gradient and stays where it is; open_clip's clamp_(0, log 100) after each step
    keeps it at most log 100 and lets it come back down. Random pairs (a smaller scale is
    better), SGD lr 0.1, 50 steps from a scale of 150."""
    gen = seeded(0)
    x, y = (torch.randn(64, 16, dtype=torch.float64, generator=gen) for _ in range(2))

    def train(criterion: dg.losses.CLIPLoss, clamp_after_step: bool) -> float:
        optimizer = torch.optim.SGD(criterion.parameters(), lr=0.1)
        for _ in range(50):
            optimizer.zero_grad()
            criterion(x, y).backward()
            optimizer.step()
            if clamp_after_step:
                with torch.no_grad():
                    criterion.log_logit_scale.clamp_(0, math.log(100))
        return criterion.log_logit_scale.exp().item()

    forward_clamp = dg.losses.CLIPLoss(150.0).double()
    forward_clamp(x, y).backward()
    assert forward_clamp.log_logit_scale.grad is not None
    assert forward_clamp.log_logit_scale.grad.item() == 0.0
    assert train(forward_clamp, clamp_after_step=False) == pytest.approx(150.0)
    open_clip_way = dg.losses.CLIPLoss(150.0, max_logit_scale=math.inf).double()
    with torch.no_grad():
        open_clip_way.log_logit_scale.clamp_(0, math.log(100))
    assert train(open_clip_way, clamp_after_step=True) < 10.0
