"""The memory-efficient (ring, blockwise) path against the dense path on one process.

Semantics asserted: ``ring_reduce`` under the sum objective (each rank back-propagates a random
cotangent of its own [n] output) gives the gradient of the single-process reduction over the
full logits: anchors and keys get their rows of it, scale and bias summed over ranks. Each loss
with ``block_size`` returns on every rank the single-process *dense* loss, input gradients
world_size times the dense ones, and parameter gradients whose average over ranks (DDP) equals
the dense ones. float64 throughout, tolerance 1e-10 (only the reduction order differs).
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor

import distgrad as dg
from distgrad._exchange.group import resolve
from distgrad.losses import contrastive
from distgrad.losses._blockwise import ring_clip, ring_reduce
from distgrad.testing import check_against_single_process, run_on_ranks
from tests._support import FLOAT64, rows_of, seeded
from tests.losses import cases

SHARDINGS = [[5], [4, 3], [3, 0, 2], [1, 3, 2, 1]]


def _data(rows: int, seed: int) -> list[Tensor]:
    gen = seeded(seed)
    a, k = (torch.randn(rows, 4, dtype=torch.float64, generator=gen) for _ in range(2))
    return [a, k, torch.randn(rows, dtype=torch.float64, generator=gen)]  # v: the cotangent


def _reference_reduce(a: Tensor, k: Tensor, s: Tensor, b: Tensor, kind: str, mask: bool) -> Tensor:
    logits = s * a @ k.T + b  # [B, B]
    if kind == "softplus":
        return F.softplus(logits).sum(1)
    if mask:
        logits = logits.masked_fill(torch.eye(len(a), dtype=torch.bool), float("-inf"))
    return logits.logsumexp(1)


CASES = [("lse", False, 2), ("lse", True, 2), ("lse", True, 100), ("softplus", False, 3)]


def _ring_worker(rank: int, world_size: int, sizes: list[int]) -> list[list[Tensor]]:
    start, stop = sum(sizes[:rank]), sum(sizes[: rank + 1])
    results = []
    for kind, mask, block in CASES:
        a, k, v = (t[start:stop] for t in _data(sum(sizes), 0))
        if mask:  # NT-Xent: the anchors are the keys
            k = a
        a.requires_grad_(True)
        k = k.detach().requires_grad_(True)
        s = torch.tensor(1.7, dtype=torch.float64, requires_grad=True)
        b = torch.tensor(-0.4 if kind == "softplus" else 0.0, dtype=torch.float64)
        b.requires_grad_(True)
        out = ring_reduce(
            a, k, s, b, tuple(sizes), resolve(None), kind=kind, block=block, mask_self=mask
        )
        (out * v).sum().backward()
        assert a.grad is not None and k.grad is not None and s.grad is not None
        assert b.grad is not None
        results.append([out.detach(), a.grad, k.grad, s.grad, b.grad])
    return results


@pytest.mark.parametrize("sizes", SHARDINGS, ids=str)
def test_ring_reduce_equals_the_full_reduction_with_random_cotangents(sizes: list[int]) -> None:
    """Objective: sum over ranks of <out_r, v_r> with random v; blocks smaller than, and larger
    than, a rank's keys; a rank with no rows."""
    per_rank = run_on_ranks(_ring_worker, len(sizes), args=(sizes,))
    for case, (kind, mask, _) in enumerate(CASES):
        a, k, v = _data(sum(sizes), 0)
        k = a.clone() if mask else k
        a.requires_grad_(True)
        k.requires_grad_(True)
        s = torch.tensor(1.7, dtype=torch.float64, requires_grad=True)
        b = torch.tensor(-0.4 if kind == "softplus" else 0.0, dtype=torch.float64)
        b.requires_grad_(True)
        out = _reference_reduce(a, k if not mask else a, s, b, kind, mask)
        (out * v).sum().backward()
        assert a.grad is not None and s.grad is not None and b.grad is not None
        grad_a = a.grad  # with mask_self the keys are the anchors: one gradient for both
        got = [torch.cat([r[case][i] for r in per_rank]) for i in range(3)]
        torch.testing.assert_close(got[0], out.detach(), **FLOAT64)
        if mask:
            torch.testing.assert_close(got[1] + got[2], grad_a, **FLOAT64)
        else:
            assert k.grad is not None
            torch.testing.assert_close(got[1], grad_a, **FLOAT64)
            torch.testing.assert_close(got[2], k.grad, **FLOAT64)
        torch.testing.assert_close(sum(r[case][3] for r in per_rank), s.grad, **FLOAT64)
        torch.testing.assert_close(sum(r[case][4] for r in per_rank), b.grad, **FLOAT64)


def _blockwise(loss: Callable[..., Tensor], block: int) -> Callable[..., Tensor]:
    return lambda m, a, b: loss(m, a, b, block_size=block)


BLOCKWISE = [cases.nt_xent, cases.info_nce, cases.clip_loss, cases.siglip_loss]


def _views(rows: int) -> dict[str, Tensor]:
    gen = seeded(1)
    base = torch.randn(rows, 5, dtype=torch.float64, generator=gen)
    noise = [0.1 * torch.randn(rows, 5, dtype=torch.float64, generator=gen) for _ in range(2)]
    return {"a": base + noise[0], "b": base + noise[1]}


@pytest.mark.parametrize("loss", BLOCKWISE, ids=lambda f: f.__name__)
def test_blockwise_loss_equals_dense_loss_in_one_process(loss: Callable[..., Tensor]) -> None:
    """No process group: block sizes 1, 2 and 7 against the dense path, value and gradients."""
    views = _views(7)
    reference = cases.Learnable()
    loss(reference, views["a"], views["b"]).backward()
    for block in (1, 2, 7):
        model = cases.Learnable()
        value = loss(model, views["a"], views["b"], block_size=block)
        value.backward()
        torch.testing.assert_close(value, loss(reference, views["a"], views["b"]), **FLOAT64)
        for (name, p), q in zip(model.named_parameters(), reference.parameters(), strict=True):
            assert (p.grad is None) == (q.grad is None), name
            if p.grad is not None:
                torch.testing.assert_close(p.grad, q.grad, **FLOAT64, msg=name)


def _sharded_blockwise(rank: int, world_size: int, name: str, sizes: list[int]) -> list[Tensor]:
    loss = getattr(cases, name)
    views = _views(sum(sizes))
    model = cases.Learnable()
    a, b = (rows_of(views[v], sizes, rank) for v in "ab")  # rank as data: also simulated
    value = loss(model, a, b, block_size=2)
    value.backward()
    return [value.detach()] + [
        torch.zeros(()) if p.grad is None else p.grad for p in model.parameters()
    ]


@pytest.mark.parametrize("loss", BLOCKWISE, ids=lambda f: f.__name__)
def test_blockwise_loss_on_ranks_equals_dense_loss_in_one_process(
    loss: Callable[..., Tensor],
) -> None:
    """Every rank returns the dense single-process value; the average over ranks of the
    parameter gradients (DDP) equals the dense single-process gradients."""
    _check_on_ranks(loss, [[4, 3], [3, 0, 4], [1, 3, 2, 1]], simulate=False)


@pytest.mark.parametrize("loss", BLOCKWISE, ids=lambda f: f.__name__)
def test_blockwise_loss_simulated_equals_dense_loss_in_one_process(
    loss: Callable[..., Tensor],
) -> None:
    """The same, every rank simulated in this process (``run_on_ranks(simulate=True)``), on
    even shards of 2 to 8 ranks: the ring kernel loops over the blocks of each rank's own
    rows, a Python path per rank, so uneven shards are refused (tests/testing/test_simulate.py)."""
    _check_on_ranks(loss, [[4, 4], [2, 2, 2, 2], [1] * 8], simulate=True)


@pytest.mark.slow
def test_blockwise_clip_simulated_at_64_ranks_equals_dense_loss_in_one_process() -> None:
    """The ring of 64 ranks, each two rows: 64 shifts each way."""
    _check_on_ranks(cases.clip_loss, [[2] * 64], simulate=True)


def _check_on_ranks(
    loss: Callable[..., Tensor], shardings: list[list[int]], simulate: bool
) -> None:
    """Each sharding (the same rows in all) against the dense loss in one process."""
    views = _views(sum(shardings[0]))
    reference = cases.Learnable()
    value = loss(reference, views["a"], views["b"])
    value.backward()
    for sizes in shardings:
        per_rank = run_on_ranks(
            _sharded_blockwise, len(sizes), args=(loss.__name__, sizes), simulate=simulate
        )
        for result in per_rank:
            torch.testing.assert_close(result[0], value.detach(), **FLOAT64)
        for i, q in enumerate(reference.parameters(), start=1):
            averaged = sum(r[i] for r in per_rank) / len(sizes)
            expected = torch.zeros(()) if q.grad is None else q.grad
            torch.testing.assert_close(averaged, expected, **FLOAT64, check_dtype=False)


def nt_xent_blockwise(m: cases.Learnable, a: Tensor, b: Tensor) -> Tensor:
    return cases.nt_xent(m, a, b, block_size=3)


def test_checker_agrees_for_blockwise_nt_xent_on_three_uneven_ranks() -> None:
    """dg.testing.check_against_single_process: inputs and parameters, [3, 1, 3] shards."""
    report = check_against_single_process(
        nt_xent_blockwise,
        _views(7),
        world_size=3,
        shard_sizes=[3, 1, 3],
        model=cases.Learnable,  # type: ignore[arg-type]
    )
    assert report.ok, str(report)


def _dims_differ(rank: int, world_size: int) -> str:
    try:
        dg.losses.info_nce(torch.ones(2, 3 + rank), torch.ones(2, 3 + rank), block_size=2)
    except dg.errors.CollectiveMismatchError as exc:
        return str(exc)
    return "no error"


def test_blockwise_dims_differing_across_ranks_raise_on_every_rank() -> None:
    for message in run_on_ranks(_dims_differ, 2, timeout=30):
        assert "info_nce on rank" in message
        assert (
            "ranks disagree on the shape outside dim 0 (rank 0: (2, 3); rank 1: (2, 4))" in message
        )


def _ring_clip_worker(rank: int, world_size: int, sizes: list[int]) -> list[Tensor]:
    start, stop = sum(sizes[:rank]), sum(sizes[: rank + 1])
    gen = seeded(4)
    x, y, v_row, v_col = (
        torch.randn(sum(sizes), 4, dtype=torch.float64, generator=gen)[start:stop] for _ in range(4)
    )
    x.requires_grad_(True)
    y.requires_grad_(True)
    s = torch.tensor(1.3, dtype=torch.float64, requires_grad=True)
    row, col = ring_clip(x, y, s, tuple(sizes), resolve(None), block=2)
    ((row * v_row[:, 0]).sum() + (col * v_col[:, 0]).sum()).backward()
    assert x.grad is not None and y.grad is not None and s.grad is not None
    return [row.detach(), col.detach(), x.grad, y.grad, s.grad]


@pytest.mark.parametrize("sizes", SHARDINGS, ids=str)
def test_ring_clip_equals_row_and_column_logsumexps_with_random_cotangents(
    sizes: list[int],
) -> None:
    """Objective: sum over ranks of <row_r, u_r> + <col_r, v_r>, random u, v; row i is the
    logsumexp of row i of s X Y^T, col j of column j; texts get the sum over all images."""
    per_rank = run_on_ranks(_ring_clip_worker, len(sizes), args=(sizes,))
    gen = seeded(4)
    x, y, u, v = (torch.randn(sum(sizes), 4, dtype=torch.float64, generator=gen) for _ in range(4))
    x.requires_grad_(True)
    y.requires_grad_(True)
    s = torch.tensor(1.3, dtype=torch.float64, requires_grad=True)
    logits = s * x @ y.T
    row, col = logits.logsumexp(1), logits.logsumexp(0)
    ((row * u[:, 0]).sum() + (col * v[:, 0]).sum()).backward()
    for i, want in enumerate([row.detach(), col.detach(), x.grad, y.grad]):
        torch.testing.assert_close(torch.cat([r[i] for r in per_rank]), want, **FLOAT64)
    torch.testing.assert_close(sum(r[4] for r in per_rank), s.grad, **FLOAT64)


def test_auto_picks_the_ring_only_when_the_dense_logits_would_be_large() -> None:
    """choose_block: dense (None) while the float32 logits [factor * max B_l, factor * B] fit
    AUTO_DENSE_BYTES, the device's ring block beyond; an int or None passes through."""
    x = torch.ones(1, 4)
    fits = 2**14  # [2**14, 2**15] float32: exactly 2 GiB
    assert contrastive.choose_block("auto", [fits, fits], x) is None
    assert contrastive.choose_block("auto", [fits + 1, fits], x) == contrastive.AUTO_BLOCK["cpu"]
    assert contrastive.choose_block("auto", [fits // 2, fits // 2], x, factor=2) is None
    assert contrastive.choose_block("auto", [fits // 2 + 1, fits // 2], x, factor=2) is not None
    assert contrastive.choose_block(7, [1, 1], x) == 7
    assert contrastive.choose_block(None, [10**6, 10**6], x) is None


def _auto(rank: int, world_size: int, limit: int) -> list[Tensor]:
    contrastive.AUTO_DENSE_BYTES = limit  # in this rank's process only
    views = _views(7)
    rows = slice(0, 4) if rank == 0 else slice(4, 7)
    model = cases.Learnable()
    value = cases.siglip_loss(model, views["a"][rows], views["b"][rows], block_size="auto")
    value.backward()
    grads = [torch.zeros(()) if p.grad is None else p.grad for p in model.parameters()]
    return [value.detach(), *grads]


@pytest.mark.parametrize("limit", [0, 2**40], ids=["ring", "dense"])
def test_auto_block_size_equals_the_dense_loss_on_either_path(limit: int) -> None:
    """block_size="auto" on 2 ranks, the ring forced (limit 0) or the dense path (a limit no
    batch reaches): the dense single-process value on every rank, DDP-averaged gradients."""
    views = _views(7)
    reference = cases.Learnable()
    value = cases.siglip_loss(reference, views["a"], views["b"])
    value.backward()
    per_rank = run_on_ranks(_auto, 2, args=(limit,))
    for result in per_rank:
        torch.testing.assert_close(result[0], value.detach(), **FLOAT64)
    for i, q in enumerate(reference.parameters(), start=1):
        averaged = sum(r[i] for r in per_rank) / 2
        expected = torch.zeros(()) if q.grad is None else q.grad
        torch.testing.assert_close(averaged, expected, **FLOAT64, check_dtype=False)
