"""Each pattern against the reference users trust, on the same inputs.

Semantics asserted (random cotangents; the objective is the sum over ranks of each rank's
share, so every rank's input gradient is its slice of the reference's and parameter gradients
summed over ranks are the reference's):

* SyncBatchNorm against ``torch.nn.BatchNorm1d`` / ``BatchNorm2d`` on the whole batch over
  three training steps: outputs, input and affine gradients, ``running_mean``,
  ``running_var`` (torch's unbiased variance), ``num_batches_tracked`` (momentum 0.1 and
  ``None``), then the output in eval mode; also without affine parameters or running
  statistics (batch statistics in eval too); uneven per-rank batches with an empty rank.
* ring_attention against ``F.scaled_dot_product_attention`` on the whole sequence, causal and
  not, a custom scale, ``Dv != D``, float64 and float32.
* route/dispatch/combine against a dense loop over every expert on one process, with the
  capacity rule written out independently (a Python loop over tokens in order).

float64 is compared at atol 1e-10, rtol 0 (another summation order costs about 1e-15); float32 at
torch's float32 defaults (the ring sums blocks in another order than SDPA's kernel).
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from distgrad import parallel as P
from distgrad.testing import run_on_ranks
from tests._support import FLOAT64_ABSOLUTE, seeded
from tests.parallel import patterns as pt

DT = torch.float64


def _rows(t: torch.Tensor, sizes: list[int], rank: int, dim: int = 0) -> torch.Tensor:
    return torch.split(t, sizes, dim=dim)[rank]


def _summed(t: torch.Tensor) -> torch.Tensor:
    out = t.clone()
    dist.all_reduce(out)
    return out


def _deviation(got: torch.Tensor, want: torch.Tensor, what: str, **tol: float) -> float:
    torch.testing.assert_close(got, want, **(tol or FLOAT64_ABSOLUTE), msg=lambda m: f"{what}: {m}")
    return float((got - want).detach().abs().max()) if got.numel() else 0.0


# -- synchronized batch norm against torch's batch norm --------------------------------------


def _bn_case(rank: int, sizes: list[int], shape: tuple[int, ...], momentum: float | None) -> float:
    channels = shape[0]
    ours = P.SyncBatchNorm(channels, momentum=momentum, dtype=DT)
    theirs = (torch.nn.BatchNorm1d if len(shape) < 3 else torch.nn.BatchNorm2d)(
        channels, momentum=momentum, dtype=DT
    )
    with torch.no_grad():
        for p, q in zip(ours.parameters(), theirs.parameters(), strict=True):
            p.copy_(1 + 0.5 * torch.randn(p.shape, dtype=DT, generator=seeded(3)))
            q.copy_(p)
    worst = 0.0
    for step in range(3):
        g = seeded(100 + step)
        full = 4.0 * torch.randn(sum(sizes), *shape, dtype=DT, generator=g) + step
        cot = torch.randn(full.shape, dtype=DT, generator=g)
        x = _rows(full, sizes, rank).requires_grad_()
        whole = full.clone().requires_grad_()
        y, want = ours(x), theirs(whole)
        (y * _rows(cot, sizes, rank)).sum().backward()
        (want * cot).sum().backward()
        worst = max(
            worst,
            _deviation(y, _rows(want, sizes, rank), "output"),
            _deviation(x.grad, _rows(whole.grad, sizes, rank), "input gradient"),  # type: ignore[arg-type]
            _deviation(_summed(ours.weight.grad), theirs.weight.grad, "weight gradient"),  # type: ignore[arg-type]
            _deviation(_summed(ours.bias.grad), theirs.bias.grad, "bias gradient"),  # type: ignore[arg-type]
            _deviation(ours.running_mean, theirs.running_mean, "running_mean"),  # type: ignore[arg-type]
            _deviation(ours.running_var, theirs.running_var, "running_var (unbiased)"),  # type: ignore[arg-type]
        )
        assert int(ours.num_batches_tracked) == int(theirs.num_batches_tracked) == step + 1  # type: ignore[arg-type]
        ours.zero_grad()
        theirs.zero_grad()
    ours.eval()
    theirs.eval()
    full = torch.randn(sum(sizes), *shape, dtype=DT, generator=seeded(9))
    with torch.no_grad():
        want = _rows(theirs(full), sizes, rank)
        return max(worst, _deviation(ours(_rows(full, sizes, rank)), want, "eval output"))


def _bn_plain_case(rank: int, sizes: list[int]) -> float:
    """affine=False, track_running_stats=False: batch statistics in training and in eval."""
    ours = P.SyncBatchNorm(3, affine=False, track_running_stats=False, dtype=DT)
    theirs = torch.nn.BatchNorm2d(3, affine=False, track_running_stats=False, dtype=DT)
    assert ours.running_mean is None and not list(ours.parameters())
    worst = 0.0
    for mode in ("train", "eval"):
        ours.train(mode == "train")
        theirs.train(mode == "train")
        g = seeded(200)
        full = torch.randn(sum(sizes), 3, 2, 2, dtype=DT, generator=g)
        cot = torch.randn(full.shape, dtype=DT, generator=g)
        x, whole = _rows(full, sizes, rank).requires_grad_(), full.clone().requires_grad_()
        y, want = ours(x), theirs(whole)
        (y * _rows(cot, sizes, rank)).sum().backward()
        (want * cot).sum().backward()
        worst = max(
            worst,
            _deviation(y, _rows(want, sizes, rank), f"{mode}: output"),
            _deviation(x.grad, _rows(whole.grad, sizes, rank), f"{mode}: input gradient"),  # type: ignore[arg-type]
        )
    return worst


def _bn_against_torch(rank: int, n: int, sizes: list[int]) -> float:
    # Why this exists: torch's own SyncBatchNorm refuses CPU tensors under a process group.
    with pytest.raises(ValueError, match="SyncBatchNorm expected input tensor to be on GPU"):
        torch.nn.SyncBatchNorm(3)(torch.randn(4, 3))
    shapes = [(3, 4, 4), (5,), (5, 6)]  # BatchNorm2d, BatchNorm1d on [B, C] and [B, C, L]
    worst = max(_bn_case(rank, sizes, s, m) for s in shapes for m in (0.1, None))
    return max(worst, _bn_plain_case(rank, sizes))


@pytest.mark.parametrize(("n", "sizes"), [(2, [7, 2]), (3, [4, 0, 5]), (4, [1, 3, 0, 5])])
def test_sync_batch_norm_matches_torch_batch_norm_on_the_whole_batch(
    n: int, sizes: list[int]
) -> None:
    worst = max(run_on_ranks(_bn_against_torch, n, args=(sizes,)))
    assert worst < 1e-10


# -- ring attention against scaled_dot_product_attention -------------------------------------


def _ring_case(
    rank: int, sizes: list[int], causal: bool, scale: float | None, dtype: torch.dtype, dv: int
) -> float:
    g = seeded(7 + int(causal))
    s = sum(sizes)
    q, k = (torch.randn(2, 3, s, 4, dtype=dtype, generator=g) for _ in range(2))
    v = torch.randn(2, 3, s, dv, dtype=dtype, generator=g)
    cot = torch.randn(2, 3, s, dv, dtype=dtype, generator=g)
    whole = [t.clone().requires_grad_() for t in (q, k, v)]
    want = F.scaled_dot_product_attention(*whole, is_causal=causal, scale=scale)
    (want * cot).sum().backward()
    mine = [_rows(t, sizes, rank, 2).requires_grad_() for t in (q, k, v)]
    got = P.ring_attention(*mine, causal=causal, scale=scale, sizes=sizes)
    (got * _rows(cot, sizes, rank, 2)).sum().backward()
    tol: dict[str, float] = {} if dtype == DT else {"rtol": 1.3e-6, "atol": 1e-5}
    worst = _deviation(got, _rows(want, sizes, rank, 2), "output", **tol)
    for name, a, b in zip("qkv", mine, whole, strict=True):
        worst = max(worst, _deviation(a.grad, _rows(b.grad, sizes, rank, 2), f"d{name}", **tol))  # type: ignore[arg-type]
    return worst if dtype == DT else 0.0


def _ring_against_sdpa(rank: int, n: int, sizes: list[int]) -> float:
    cases = [
        (c, sc, dt, dv)
        for c in (False, True)
        for sc in (None, 0.3)
        for dt in (DT, torch.float32)
        for dv in (4, 5)  # 4: blocks through torch's fused kernel; 5: through matmuls
    ]
    return max(_ring_case(rank, sizes, *case) for case in cases)


@pytest.mark.parametrize(("n", "sizes"), [(2, [3, 6]), (3, [4, 0, 5]), (4, [2, 1, 3, 3])])
def test_ring_attention_matches_sdpa_on_the_whole_sequence(n: int, sizes: list[int]) -> None:
    worst = max(run_on_ranks(_ring_against_sdpa, n, args=(sizes,)))
    assert worst < 1e-10


# -- MoE against a dense loop over the experts ------------------------------------------------


def dense_moe(
    model: pt.MoE, x: torch.Tensor, k: int, capacity: int | None, normalize: bool
) -> torch.Tensor:
    """Every expert on every token, masked: the reference, written without route()."""
    weights, chosen = torch.softmax(model.router(x), -1).topk(k, -1)
    if normalize:
        weights = weights / weights.sum(-1, keepdim=True)
    taken = [0] * pt.EXPERTS
    keep = torch.zeros_like(chosen, dtype=torch.bool)
    for t in range(x.shape[0]):  # the global order: tokens in order, each token's choices
        for j in range(k):
            e = int(chosen[t, j])
            if capacity is None or taken[e] < capacity:
                keep[t, j], taken[e] = True, taken[e] + 1
    out = torch.zeros_like(x)
    for e, expert in enumerate(model.experts):
        gate = (weights * ((chosen == e) & keep)).sum(-1, keepdim=True)  # [T, 1]
        out = out + gate * torch.tanh(expert(x))
    return out


def _moe_against_dense(rank: int, n: int, sizes: list[int]) -> float:
    ours, theirs = pt.MoE(), pt.MoE()
    worst = 0.0
    settings: list[tuple[int, int | None, list[int] | None, bool]] = [
        (2, 3, None, True),
        (1, None, [0] * (n - 1) + [pt.EXPERTS], True),
        (2, 1, None, False),  # gate weights as the softmax gives them
        (3, 4, [pt.EXPERTS] + [0] * (n - 1), True),
    ]
    for step, (k, capacity, split, normalize) in enumerate(settings):  # sizes change each step
        g = seeded(40 + step)
        full = torch.randn(sum(sizes), pt.D_MODEL, dtype=DT, generator=g)
        cot = torch.randn(full.shape, dtype=DT, generator=g)
        whole = full.clone().requires_grad_()
        want = dense_moe(theirs, whole, k, capacity, normalize)
        (want * cot).sum().backward()
        x = _rows(full, sizes, rank).requires_grad_()
        routing = P.route(
            ours.router(x), k, capacity=capacity, experts_per_rank=split, normalize=normalize
        )
        got = pt.moe_layer(ours, x, routing)
        (got * _rows(cot, sizes, rank)).sum().backward()
        worst = max(
            worst,
            _deviation(got, _rows(want, sizes, rank), f"step {step}: output"),
            _deviation(x.grad, _rows(whole.grad, sizes, rank), f"step {step}: input gradient"),  # type: ignore[arg-type]
        )
        for (name, p), q in zip(ours.named_parameters(), theirs.parameters(), strict=True):
            grad = p.grad if p.grad is not None else torch.zeros_like(p)
            want_grad = q.grad if q.grad is not None else torch.zeros_like(q)
            worst = max(worst, _deviation(_summed(grad), want_grad, f"step {step}: {name}"))
        ours.zero_grad()
        theirs.zero_grad()
    return worst


@pytest.mark.parametrize(("n", "sizes"), [(2, [6, 7]), (3, [5, 0, 6]), (4, [3, 4, 1, 4])])
def test_moe_matches_a_dense_loop_over_experts(n: int, sizes: list[int]) -> None:
    worst = max(run_on_ranks(_moe_against_dense, n, args=(sizes,)))
    assert worst < 1e-10


def _ring_saves_only_this_rank_s_blocks(rank: int, n: int) -> int:
    s = 3
    q, k, v = (torch.randn(2, 2, s, 4, dtype=DT, requires_grad=True) for _ in range(3))
    out = P.ring_attention(q, k, v, causal=True, sizes=[s] * n)
    saved = out.grad_fn.saved_tensors  # type: ignore[union-attr]
    (out * torch.randn_like(out)).sum().backward()  # every rank runs its backward
    return sum(t.numel() for t in saved)


def test_ring_attention_keeps_only_this_rank_s_blocks_for_backward() -> None:
    """Memory: what the backward keeps is this rank's q, k, v, output and log-sum-exp
    (4 x 48 + 12 values), never another rank's keys and values, whatever the ring's length."""
    assert run_on_ranks(_ring_saves_only_this_rank_s_blocks, 4) == [4 * 48 + 12] * 4
