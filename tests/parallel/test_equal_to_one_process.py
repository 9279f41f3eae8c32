"""Every parallel pattern equals the same model on one process on the whole batch.

Semantics asserted (docs/patterns.md): each rank returns its share of the global loss (a
random cotangent dotted with its output rows), so under distgrad's sum contract every input
gradient equals its slice of the single-process gradient and every parameter gradient,
summed over ranks, equals the single-process one ("summed"). Megatron's replicated contract
(every rank returns the whole loss, counted once) satisfies the same check. Checked with
dg.testing.check_against_single_process (float64, real gloo ranks in debug mode, atol 1e-10
and rtol 0: the ranks sum in another order than one process, which costs about 1e-15) on 2,
3 and 4 ranks with uneven shards, an empty one included where the pattern allows it.
"""

from __future__ import annotations

import pytest
import torch

from distgrad.testing import check_against_single_process
from tests._support import FLOAT64_ABSOLUTE, leaf
from tests.parallel import patterns as pt

DT = torch.float64


def _randn(*shape: int, seed: int) -> torch.Tensor:
    return leaf(seed, *shape, requires_grad=False)  # float64, as DT


def _check(fn: object, inputs: dict[str, torch.Tensor], n: int, sizes: list[int], **kw: object):  # type: ignore[no-untyped-def]
    report = check_against_single_process(
        fn,  # type: ignore[arg-type]
        inputs,
        world_size=n,
        shard_sizes=sizes,
        gradients="summed",
        **FLOAT64_ABSOLUTE,
        **kw,  # type: ignore[arg-type]
    )
    assert report.ok, f"{n} ranks, shards {sizes}:\n{report}"
    return report


# (world size, rows per rank): uneven everywhere, and an empty rank where the pattern allows it.
TP_SHARDS = [(2, [5, 3]), (3, [2, 4, 3]), (4, [3, 1, 2, 3])]


@pytest.mark.parametrize(("n", "sizes"), TP_SHARDS)
def test_tensor_and_sequence_parallel_mlp_equals_one_process(n: int, sizes: list[int]) -> None:
    """Column- then row-parallel MLP, 7 hidden features split unevenly; sequence parallel
    (rows sharded, uneven) and plain tensor parallel, both under the sum contract."""
    inputs = {
        "x": _randn(sum(sizes), pt.D_MODEL, seed=1),
        "v": _randn(sum(sizes), pt.D_MODEL, seed=2),
    }
    _check(pt.tp_loss, inputs, n, sizes, model=pt.MLP)


@pytest.mark.parametrize(("n", "sizes"), TP_SHARDS)
def test_megatron_replicated_regions_equal_one_process(n: int, sizes: list[int]) -> None:
    """copy_to_region (f) and reduce_from_region (g) under the replicated contract."""
    inputs = {
        "x": _randn(sum(sizes), pt.D_MODEL, seed=3),
        "v": _randn(sum(sizes), pt.D_MODEL, seed=4),
    }
    _check(pt.tp_megatron_loss, inputs, n, sizes, model=pt.MLP)


@pytest.mark.parametrize(("n", "sizes"), [(2, [7, 5]), (3, [4, 0, 8]), (4, [3, 5, 1, 3])])
def test_moe_dispatch_and_combine_equal_one_process(n: int, sizes: list[int]) -> None:
    """Two routings in one loss (top-2 with dropped tokens, then top-1 with every expert on the
    last rank): the split sizes differ per rank and per step; a rank may have no tokens."""
    inputs = {
        "x": _randn(sum(sizes), pt.D_MODEL, seed=5),
        "v": _randn(sum(sizes), pt.D_MODEL, seed=6),
    }
    _check(pt.moe_loss, inputs, n, sizes, model=pt.MoE)


@pytest.mark.parametrize(("n", "sizes"), [(2, [5, 3]), (3, [4, 0, 3]), (4, [1, 3, 2, 2])])
def test_ring_attention_equals_one_process(n: int, sizes: list[int]) -> None:
    """Causal and not, the sequence (dim 2 of [batch, heads, seq, dim]) split unevenly."""
    s = sum(sizes)
    inputs = {
        name: _randn(2, 2, s, 3, seed=10 + i) for i, name in enumerate(("q", "k", "v", "cot"))
    }
    _check(pt.ring_loss, inputs, n, sizes, shard_dim=2)


@pytest.mark.parametrize(("n", "sizes"), [(2, [6, 0]), (3, [3, 0, 4]), (4, [2, 3, 0, 3])])
def test_sync_batch_norm_equals_one_process(n: int, sizes: list[int]) -> None:
    """BatchNorm2d- and 1d-shaped inputs, uneven per-rank batches with an empty rank."""
    b = sum(sizes)
    inputs = {
        "image": _randn(b, 3, 2, 2, seed=20),
        "flat": _randn(b, 4, seed=21),
        "v": _randn(b, 4, seed=22),
    }
    _check(pt.bn_loss, inputs, n, sizes, model=pt.Norms)
