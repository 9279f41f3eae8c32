"""Every collective's forward and gradient against single-process ground truth.

Semantics asserted (docs/semantics.md): with ``objective="sum"`` the objective is
``sum_r <out_r, v_r>`` with a *different* random cotangent ``v_r`` on every rank, and each rank's
input gradient must equal autograd of that objective computed in one process on every rank's
data (tests/collectives/reference.py). With ``objective="replicated"`` every rank uses the same
cotangent and the objective counts once: ``<out, v>``.

Tolerances: float64 to 1e-10 relative (the reductions may add in a different order than the
reference); float32 to 1e-5 relative for the same reason.
"""

from __future__ import annotations

import pytest
import torch

import distgrad as dg
from distgrad.testing import run_on_ranks
from tests.collectives.reference import (
    cases,
    check_case,
    edge_cases,
    replicated_cases,
    warm_up,
)


def check_all(
    rank: int, n: int, which: str, dtype_name: str, device: str = "cpu", debug: bool = False
) -> list[str]:
    """Every case of ``which``: in debug mode as given; otherwise past the checked first calls
    on the group, as given and again with every size known (no metadata at all)."""
    dtype = getattr(torch, dtype_name)
    if device == "cuda":
        torch.cuda.set_device(rank)
    dg.set_debug(debug)
    if not debug:
        warm_up(device)
    if which == "in_place":
        # Outputs of the linear ops; prod/max/min outputs are saved by their local reduction's
        # backward, so modifying them in place is an autograd error, as with torch.prod.
        chosen = [c for c in cases(n) if c.kwargs.get("op", "sum") in ("sum", "avg")]
    else:
        chosen = {"main": cases, "edge": edge_cases, "replicated": replicated_cases}[which](n)
    failures = []
    for case in chosen:
        for known in (False, True) if not debug else (False,):
            try:
                check_case(rank, n, case, dtype, device, in_place=which == "in_place", known=known)
            except (AssertionError, RuntimeError) as exc:
                failures.append(f"rank {rank}: {case} (sizes known: {known}): {str(exc)[:300]}")
    return failures


def _assert_none_failed(results: list[list[str]]) -> None:
    failures = [f for per_rank in results for f in per_rank]
    assert not failures, "\n".join(failures)


@pytest.mark.parametrize("world_size", [1, 2, 3])
@pytest.mark.parametrize("dtype_name", ["float64", "float32"])
def test_every_op_matches_single_process_autograd(world_size: int, dtype_name: str) -> None:
    """Forward and input gradient of every op, even and uneven sizes, random cotangents; past
    the checked first calls, with and without the sizes given."""
    _assert_none_failed(run_on_ranks(check_all, world_size, args=("main", dtype_name)))


@pytest.mark.parametrize("world_size", [2, 3])
def test_every_op_matches_single_process_autograd_in_debug_mode(world_size: int) -> None:
    """The same sweep with every call checked across ranks, forward and backward."""
    results = run_on_ranks(check_all, world_size, args=("main", "float64", "cpu", True))
    _assert_none_failed(results)


def test_every_op_matches_single_process_autograd_on_four_ranks() -> None:
    _assert_none_failed(run_on_ranks(check_all, 4, args=("main", "float64")))


@pytest.mark.parametrize("world_size", [2, 3])
def test_prod_with_zeros_and_max_min_with_ties_match_torch(world_size: int) -> None:
    """prod: no NaN, a single zero gets the product of the others; max/min: ties split evenly."""
    _assert_none_failed(run_on_ranks(check_all, world_size, args=("edge", "float64")))


@pytest.mark.parametrize("world_size", [1, 2, 3])
def test_replicated_objective_counts_the_shared_loss_once(world_size: int) -> None:
    _assert_none_failed(run_on_ranks(check_all, world_size, args=("replicated", "float64")))


def test_outputs_can_be_modified_in_place() -> None:
    """Every op returns a tensor of its own: doubling it in place doubles the gradient."""
    _assert_none_failed(run_on_ranks(check_all, 2, args=("in_place", "float64")))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU (NCCL)")
def test_every_op_matches_single_process_autograd_on_nccl() -> None:
    """The same sweep on NCCL with CUDA tensors, one rank per visible GPU."""
    world_size = torch.cuda.device_count()
    for which in ("main", "edge", "replicated"):
        results = run_on_ranks(
            check_all, world_size, args=(which, "float64", "cuda"), backend="nccl"
        )
        _assert_none_failed(results)
