"""``info_nce`` with hard negatives and both directions, against the formula as written in one
process and against sentence-transformers' ``MultipleNegativesRankingLoss``.

Semantics asserted (docs/losses.md, "Hard negatives" and "The gradient contract"): each rank
back-propagates its loss times a random scalar ``c_r`` (its own, so a gradient routed to the
wrong rank shows); under the sum objective the gradients are those of the single-process
``R = (W / B) sum_i c_owner(i) l_i``, with ``l_i`` query i's term of the written formula: the
rows of the queries, keys and negatives on their owner, the temperature's summed over ranks;
the value on every rank is the single-process mean ``(1/B) sum_i l_i``. Double backward of the
dense path: each rank's first-order gradients are W times the single-process ones and the
Hessian-vector products of ``sum_r <g_r, v_r>`` (random v) W times the single-process ones.
float64, tolerance FLOAT64 (only the order of the sums differs), 1 to 4 ranks, uneven and empty
shards, dense and ring paths.

Against sentence-transformers 6.2 (its own loss file, loaded by path: ``tests/losses/mnrl.py``;
skipped where it is not installed): even shards (its gathers need them), cosine similarity,
``scale=20``, ``gather_across_devices=True``; its value on a rank is the mean over that rank's
queries, so the mean over ranks of its values is distgrad's value, and the gradients, each rank
back-propagating ``c_r`` times its loss, are equal.
"""

from __future__ import annotations

import os

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor

import distgrad as dg
from distgrad.errors import CollectiveArgumentError, CollectiveMismatchError
from distgrad.testing import run_on_ranks
from tests._support import FLOAT64, rows_of, seeded
from tests.losses import mnrl

DIM, TEMPERATURE = 5, 0.4
QUERY = ("query_to_key",)
BOTH = ("query_to_key", "key_to_query")
# The default tier keeps two shardings (uneven, and an empty rank on 3 ranks); the others
# are the slow tier's (the default tier sits near its 5 minutes on 2 cores).
slow = pytest.mark.slow
SHARDINGS = [
    pytest.param([7], marks=slow),
    [4, 3],
    [3, 0, 4],
    pytest.param([1, 3, 2, 1], marks=slow),
    pytest.param([7, 0], marks=slow),
]
# (m hard negatives per query, directions, partition, block_size): the dense path (None), and
# the ring with blocks smaller and larger than a shard
CASES = [
    (1, QUERY, "joint", None),
    (3, QUERY, "joint", None),
    (2, BOTH, "joint", None),
    (2, BOTH, "per_direction", None),
    (0, BOTH, "joint", None),
    (1, QUERY, "joint", 2),
    (3, QUERY, "joint", 100),
    (2, BOTH, "joint", 2),
    (2, BOTH, "per_direction", 3),
    (0, BOTH, "per_direction", 2),
]


def _batch(rows: int, m: int) -> list[Tensor]:
    """Queries, their keys and m hard negatives per query (each close to its query's key, so
    a negative mistaken for a positive moves the loss a lot), and a scalar cotangent per row's
    rank drawn later."""
    gen = seeded(7)
    base = torch.randn(rows, DIM, dtype=torch.float64, generator=gen)
    query = base + 0.3 * torch.randn(rows, DIM, dtype=torch.float64, generator=gen)
    key = base + 0.3 * torch.randn(rows, DIM, dtype=torch.float64, generator=gen)
    noise = torch.randn(rows, m, DIM, dtype=torch.float64, generator=gen)
    negatives = base[:, None] + 0.6 * noise
    return [query, key, negatives]


def _weights(world_size: int) -> Tensor:
    """Each rank's random scalar cotangent."""
    return torch.rand(world_size, dtype=torch.float64, generator=seeded(11)) + 0.5


def _shard(sizes: list[int], rank: int | None, m: int) -> list[Tensor]:
    """Leaves: this rank's rows (all rows for None), and the temperature."""
    batch = _batch(sum(sizes), m)
    mine = batch if rank is None else [rows_of(t, sizes, rank) for t in batch]  # rank as data
    q, k, n = (t.clone().requires_grad_(True) for t in mine)
    return [q, k, n, torch.tensor(TEMPERATURE, dtype=torch.float64, requires_grad=True)]


def written_terms(
    q: Tensor, k: Tensor, n: Tensor, t: Tensor, directions: tuple[str, ...], partition: str
) -> Tensor:
    """[B]: each query's term, on the whole batch, as docs/losses.md writes it: its candidates
    every key and every negative, its label its own key; with both directions also its key
    against every query, in one softmax (joint) or averaged (per_direction)."""
    q, k, n = F.normalize(q, dim=1), F.normalize(k, dim=1), F.normalize(n, dim=2)
    candidates = torch.cat([k, n.flatten(0, 1)])  # [B (1 + m), D]
    by_query = torch.logsumexp(q @ candidates.T / t, 1)
    positive = (q * k).sum(1) / t
    if directions == QUERY:
        return by_query - positive
    by_key = torch.logsumexp(k @ q.T / t, 1)
    if partition == "joint":
        return torch.logaddexp(by_query, by_key) - positive
    return (by_query + by_key) / 2 - positive


def _first_order(
    rank: int, world_size: int, sizes: list[int], cases: list[int]
) -> list[list[Tensor]]:
    c = _weights(world_size).select(0, rank)  # (not [rank]: also simulated)
    found = []
    for m, directions, partition, block in (CASES[i] for i in cases):
        q, k, n, t = _shard(sizes, rank, m)
        loss = dg.losses.info_nce(
            q,
            k,
            negatives=n if m else None,
            directions=directions,  # type: ignore[arg-type]
            partition=partition,  # type: ignore[arg-type]
            temperature=t,
            sizes=sizes,
            block_size=block,
        )
        (c * loss).backward()
        grads = [torch.zeros_like(x) if x.grad is None else x.grad for x in (q, k, n, t)]
        found.append([loss.detach(), *grads])
    return found


@pytest.mark.parametrize("sizes", SHARDINGS, ids=str)
def test_hard_negatives_and_both_directions_equal_the_written_formula(sizes: list[int]) -> None:
    """Value on every rank; queries', keys' and negatives' rows on their owner; the
    temperature's summed over ranks; dense and ring, m = 0 to 3, both partitions."""
    _check_first_order(sizes, list(range(len(CASES))), simulate=False)


@pytest.mark.parametrize(
    "sizes", [[7], [4, 3], [3, 0, 4], [1, 3, 2, 1], [1, 0, 2, 1, 1, 0, 1, 1]], ids=str
)
def test_hard_negatives_and_both_directions_simulated(sizes: list[int]) -> None:
    """The same, every rank simulated in this process: the dense cases on every sharding, the
    ring's on even shards (its kernel loops over each rank's own blocks: uneven is refused)."""
    dense = [i for i, case in enumerate(CASES) if case[3] is None]
    _check_first_order(sizes, dense, simulate=True)


def test_hard_negatives_on_the_ring_simulated_on_even_shards() -> None:
    ring = [i for i, case in enumerate(CASES) if case[3] is not None]
    _check_first_order([2, 2, 2, 2], ring, simulate=True)


def _check_first_order(sizes: list[int], cases: list[int], simulate: bool) -> None:
    per_rank = run_on_ranks(_first_order, len(sizes), args=(sizes, cases), simulate=simulate)
    w, total = len(sizes), sum(sizes)
    owner = torch.repeat_interleave(_weights(w), torch.tensor(sizes))  # [B]: c of each row
    for case, (m, directions, partition, block) in enumerate(CASES[i] for i in cases):
        q, k, n, t = _shard(sizes, None, m)
        terms = written_terms(q, k, n, t, directions, partition)
        ((w / total) * (owner * terms).sum()).backward()
        what = f"m={m} {directions} {partition} block {block}"
        for result in per_rank:
            torch.testing.assert_close(result[case][0], terms.mean().detach(), **FLOAT64, msg=what)
        for i, ref in enumerate((q.grad, k.grad, n.grad), start=1):
            got = torch.cat([r[case][i] for r in per_rank])
            torch.testing.assert_close(
                got, ref, **FLOAT64, msg=lambda e, i=i, what=what: f"{what} {i}: {e}"
            )
        got_t = sum(r[case][4] for r in per_rank)
        torch.testing.assert_close(got_t, t.grad, **FLOAT64, msg=f"{what}: temperature")


DOUBLE = [(2, QUERY, "joint"), (2, BOTH, "joint"), (1, BOTH, "per_direction"), (0, BOTH, "joint")]


def _directional(m: int, rank: int | None, sizes: list[int]) -> list[Tensor]:
    """Random directions ``v`` for the gradients of the queries, keys and negatives."""
    gen = seeded(23)
    rows = slice(None) if rank is None else slice(sum(sizes[:rank]), sum(sizes[: rank + 1]))
    shapes = [(sum(sizes), DIM), (sum(sizes), DIM), (sum(sizes), m, DIM)]
    return [torch.randn(s, dtype=torch.float64, generator=gen)[rows] for s in shapes]


def _second_order(rank: int, world_size: int, sizes: list[int]) -> list[list[Tensor]]:
    found = []
    for m, directions, partition in DOUBLE:
        q, k, n, t = _shard(sizes, rank, m)
        loss = dg.losses.info_nce(
            q,
            k,
            negatives=n if m else None,
            directions=directions,  # type: ignore[arg-type]
            partition=partition,  # type: ignore[arg-type]
            temperature=t,
            sizes=sizes,
        )
        inputs = [q, k, n] if m else [q, k]
        grads = torch.autograd.grad(loss, inputs, create_graph=True)
        v = _directional(m, rank, sizes)
        sum((g * d).sum() for g, d in zip(grads, v, strict=False)).backward()  # type: ignore[union-attr]
        seconds = [torch.zeros_like(x) if x.grad is None else x.grad for x in (q, k, n, t)]
        firsts = [g.detach() for g in grads] + [torch.zeros_like(n)] * (3 - len(grads))
        found.append([*firsts, *seconds])
    return found


@pytest.mark.parametrize(
    "sizes",
    [
        pytest.param([7], marks=slow),
        [4, 3],
        pytest.param([3, 0, 4], marks=slow),
        pytest.param([1, 3, 2, 1], marks=slow),
    ],
    ids=str,
)
def test_hard_negatives_dense_path_is_twice_differentiable(sizes: list[int]) -> None:
    """First-order gradients W times the single-process ones; Hessian-vector products of
    sum_r <g_r, v_r> W times the single-process ones (rows on their owner, the temperature's
    summed over ranks)."""
    per_rank = run_on_ranks(_second_order, len(sizes), args=(sizes,))
    w = len(sizes)
    for case, (m, directions, partition) in enumerate(DOUBLE):
        q, k, n, t = _shard(sizes, None, m)
        inputs = [q, k, n] if m else [q, k]
        loss = written_terms(q, k, n, t, directions, partition).mean()
        grads = torch.autograd.grad(loss, inputs, create_graph=True)
        v = _directional(m, None, sizes)
        sum((g * d).sum() for g, d in zip(grads, v, strict=False)).backward()  # type: ignore[union-attr]
        firsts = [g.detach() for g in grads] + [torch.zeros_like(n)] * (3 - len(grads))
        seconds = [torch.zeros_like(x) if x.grad is None else x.grad for x in (q, k, n)]
        what = f"m={m} {directions} {partition}"
        for i, ref in enumerate([*firsts, *seconds]):
            got = torch.cat([r[case][i] for r in per_rank])
            torch.testing.assert_close(
                got, w * ref, **FLOAT64, msg=lambda e, i=i, what=what: f"{what} {i}: {e}"
            )
        got_t = sum(r[case][6] for r in per_rank)
        ref_t = torch.zeros(()) if t.grad is None else t.grad
        torch.testing.assert_close(got_t, w * ref_t, **FLOAT64, msg=f"{what}: temperature")


# ---------------------------------------------------------------- sentence-transformers 6.2

# CI installs it (.ci/run), so there a missing reference fails rather than skips.
needs_st = pytest.mark.skipif(
    mnrl.loss_module_path() is None and not os.environ.get("CI"),
    reason=f"sentence-transformers {mnrl.VERSION} not installed "
    f"(pip install --no-deps sentence-transformers=={mnrl.VERSION}.0)",
)
SCALE = 20.0
ST_CASES = [
    (m, directions, partition, block)
    for m in (0, 1, 3)
    for directions, partition in ((QUERY, "joint"), (BOTH, "joint"), (BOTH, "per_direction"))
    for block in (None, 2)
]
ST_DIRECTIONS = {QUERY: ("query_to_doc",), BOTH: ("query_to_doc", "doc_to_query")}


def _against_st(rank: int, world_size: int, rows: int) -> list[list[Tensor]]:
    c = _weights(world_size)[rank]
    sizes = [rows] * world_size
    found = []
    for m, directions, partition, block in ST_CASES:
        results = []
        for which in ("distgrad", "sentence-transformers"):
            q, k, n, _ = _shard(sizes, rank, m)
            if which == "distgrad":
                loss = dg.losses.info_nce(
                    q,
                    k,
                    negatives=n if m else None,
                    directions=directions,  # type: ignore[arg-type]
                    partition=partition,  # type: ignore[arg-type]
                    temperature=1 / SCALE,
                    block_size=block,
                )
            else:  # its inputs: queries, positives, then one [B_l, D] tensor per negative column
                loss = mnrl.multiple_negatives_ranking_loss(
                    [q, k, *n.unbind(1)],
                    scale=SCALE,
                    directions=ST_DIRECTIONS[directions],
                    partition_mode=partition,
                )
            (c * loss).backward()
            assert q.grad is not None and k.grad is not None
            neg = torch.zeros_like(n) if n.grad is None else n.grad
            results.append([loss.detach(), q.grad, k.grad, neg])
        found.append([*results[0], *results[1]])
    return found


@needs_st
@pytest.mark.parametrize(
    "world_size", [pytest.param(1, marks=slow), 2, pytest.param(3, marks=slow), 4]
)
def test_info_nce_equals_sentence_transformers_multiple_negatives_ranking_loss(
    world_size: int,
) -> None:
    """Every case of ST_CASES: distgrad's value is the mean over ranks of sentence-transformers'
    (each its own queries' mean), and every gradient is equal on every rank."""
    per_rank = run_on_ranks(_against_st, world_size, args=(2,))
    for case, (m, directions, partition, block) in enumerate(ST_CASES):
        what = f"m={m} {directions} {partition} block {block}"
        st_value = torch.stack([r[case][4] for r in per_rank]).mean()
        for r in per_rank:
            torch.testing.assert_close(r[case][0], st_value, **FLOAT64, msg=what)
            for i in range(1, 4):
                torch.testing.assert_close(
                    r[case][i],
                    r[case][4 + i],
                    **FLOAT64,
                    msg=lambda e, i=i, what=what: f"{what} {i}: {e}",
                )


# ---------------------------------------------------------------- the layout, and bad input


def test_the_data_tells_a_wrong_candidate_layout_from_the_right_one() -> None:
    """The mistake of sentence-transformers PR #3453 on these data: each rank's keys and
    negatives gathered as one block (columns ``K_0 N_0 K_1 N_1``) while the labels assume
    every key first (``offset_r + i``); on 2 ranks of 4 rows with 2 negatives, the loss it
    computes is far from the written one, so the tests above would catch it."""
    sizes, m = [4, 4], 2
    q, k, n, t = (x.detach() for x in _shard(sizes, None, m))
    right = written_terms(q, k, n, t, QUERY, "joint").mean()
    q, k, n = F.normalize(q, dim=1), F.normalize(k, dim=1), F.normalize(n, dim=2)
    blocks = [torch.cat([k[r * 4 : r * 4 + 4], n[r * 4 : r * 4 + 4].flatten(0, 1)]) for r in (0, 1)]
    logits = q @ torch.cat(blocks).T / t  # [8, 24]: K_0 N_0 K_1 N_1
    wrong = F.cross_entropy(logits, torch.arange(8))  # labels for K_0 K_1 N_0 N_1
    assert abs(float(wrong - right)) > 0.5, (float(wrong), float(right))


def _bad_options(rank: int, world_size: int) -> list[str]:
    x = torch.ones(3, 4)
    calls = [
        # rank 1 passes 2 negatives per query, rank 0 one
        lambda: dg.losses.info_nce(x, x, negatives=torch.ones(3, 1 + rank, 4)),
        lambda: dg.losses.info_nce(x, x, negatives=torch.ones(2, 1, 4)),
        lambda: dg.losses.info_nce(x, x, directions=("key_to_query",)),  # type: ignore[arg-type]
        lambda: dg.losses.info_nce(x, x, partition="mean"),  # type: ignore[arg-type]
        # rank 0 both directions, rank 1 one: different exchanges
        lambda: dg.losses.info_nce(x, x, directions=BOTH if rank == 0 else QUERY),  # type: ignore[arg-type]
    ]
    seen = []
    for call in calls:
        try:
            call()
        except (CollectiveArgumentError, CollectiveMismatchError) as exc:
            seen.append(str(exc))
        else:
            seen.append("no error")
    return seen


def test_bad_negatives_and_directions_raise_a_clear_error_on_every_rank() -> None:
    """Each mistake raises on both ranks, naming what was expected."""
    for seen in run_on_ranks(_bad_options, 2, timeout=30):
        assert "ranks disagree on negatives per query (rank 0: 1; rank 1: 2)" in seen[0], seen[0]
        assert "negatives must be [3, m, 4] (m per query), got (2, 1, 4)" in seen[1], seen[1]
        assert "directions must be ('query_to_key',) or" in seen[2], seen[2]
        partition = "partition must be one of ['joint', 'per_direction'], got 'mean'"
        assert partition in seen[3], seen[3]
        assert "every rank must pass the same directions" in seen[4], seen[4]


def test_info_nce_module_passes_negatives_and_directions_on() -> None:
    """``InfoNCELoss(directions=, partition=)(q, k, negatives=)`` is the function's loss (one
    process, no group): the same value."""
    q, k, n, _ = (x.detach() for x in _shard([6], None, 2))
    module = dg.losses.InfoNCELoss(TEMPERATURE, directions=BOTH, partition="per_direction")
    t = float(module.log_temperature.exp())  # the module's float32 parameter, exponentiated
    want = dg.losses.info_nce(
        q, k, negatives=n, directions=BOTH, partition="per_direction", temperature=t
    )
    torch.testing.assert_close(module(q, k, negatives=n), want, **FLOAT64)
