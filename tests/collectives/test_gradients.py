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

from typing import Any

import pytest
import torch

import distgrad as dg
from distgrad.testing import run_on_ranks
from tests.collectives.reference import (
    OPS,
    TOL,
    Case,
    call_args,
    cotangents,
    inputs,
    outputs,
    reference_grads,
    warm_up,
)


def cases(n: int) -> list[Case]:
    """A broad sweep of every op on ``n`` ranks: even and uneven sizes, several dims."""
    uneven = tuple((2 + r, 4) for r in range(n))
    out: list[Case] = [
        Case("all_gather", ((3, 4),) * n),
        Case("all_gather", uneven),
        Case("all_gather", tuple((3, 1 + r, 2) for r in range(n)), {"dim": 1}),
        Case("all_gather", tuple((2, 1 + r) for r in range(n)), {"dim": -1}),
        Case("broadcast", ((3, 2),) * n, {"src": n - 1}),
        Case("gather", uneven, {"dst": n - 1}),
        Case("gather", tuple((2, 1 + r) for r in range(n)), {"dst": 0, "dim": 1}),
        Case("scatter", ((2 * n, 3),) * n, {"src": n - 1}),
        Case(
            "scatter",
            ((3, n * (n + 1) // 2),) * n,
            {"src": 0, "dim": 1, "sizes": [r + 1 for r in range(n)]},
        ),
        Case("permute", ((3, 2),) * n, {"perm": [(r + 1) % n for r in range(n)]}),
        Case("permute", tuple((r + 1, 2) for r in range(n)), {"perm": list(reversed(range(n)))}),
        Case("all_to_all", ((2 * n, 3),) * n),
        Case(
            "all_to_all",
            tuple((3, sum(range(1, n + 1)) + r * n) for r in range(n)),
            {"dim": 1},
            tuple({"input_sizes": [s + r for s in range(1, n + 1)]} for r in range(n)),
        ),
    ]
    for op in OPS:
        out += [
            Case("all_reduce", ((3, 5),) * n, {"op": op}),
            Case("all_reduce", ((7,),) * n, {"op": op}),  # 7 entries split unevenly over ranks
            Case("reduce_scatter", ((2 * n, 3),) * n, {"op": op}),
            Case(
                "reduce_scatter",
                ((2, n * (n + 1) // 2),) * n,
                {"op": op, "dim": 1, "sizes": [r + 1 for r in range(n)]},
            ),
            Case("reduce", ((3, 4),) * n, {"op": op, "dst": n - 1}),
        ]
    return out


def edge_cases(n: int) -> list[Case]:
    """prod with zero entries, max and min with ties across ranks."""
    out = []
    for op in ("prod",):
        out += [
            Case("all_reduce", ((4, 3),) * n, {"op": op}, data="zeros"),
            Case("reduce_scatter", ((2 * n, 2),) * n, {"op": op}, data="zeros"),
            Case("reduce", ((4, 3),) * n, {"op": op, "dst": 0}, data="zeros"),
        ]
    for op in ("max", "min"):
        out += [
            Case("all_reduce", ((4, 3),) * n, {"op": op}, data="ties"),
            Case("reduce_scatter", ((2 * n, 2),) * n, {"op": op}, data="ties"),
            Case("reduce", ((4, 3),) * n, {"op": op, "dst": n - 1}, data="ties"),
        ]
    return out


def replicated_cases(n: int) -> list[Case]:
    out = [
        Case("all_gather", tuple((2 + r, 3) for r in range(n)), {"objective": "replicated"}),
        Case("broadcast", ((3, 2),) * n, {"src": n - 1, "objective": "replicated"}),
    ]
    out += [Case("all_reduce", ((3, 4),) * n, {"op": op, "objective": "replicated"}) for op in OPS]
    return out


def check_case(
    rank: int,
    n: int,
    case: Case,
    dtype: torch.dtype,
    device: str = "cpu",
    group: Any = None,
    in_place: bool = False,
    known: bool = False,
) -> None:
    """Run ``case`` as group rank ``rank`` of ``n`` and compare with the reference.

    ``known``: pass every size the op could otherwise learn from its peers (no exchange).

    ``in_place``: double the output in place before the loss (an output is a tensor of its
    own, which autograd lets the caller modify), so the gradient doubles too.
    """
    xs = inputs(case, dtype)
    expected = outputs(case, xs)
    if case.kwargs.get("objective") == "replicated":
        shared = cotangents(expected)[0]
        vs = [shared] * n
        grads = reference_grads(case, xs, [shared] + [torch.zeros_like(shared)] * (n - 1))
    else:
        vs = cotangents(expected)
        grads = reference_grads(case, xs, vs)
    x = xs[rank].to(device).requires_grad_()
    passes_none = case.op == "scatter" and rank != case.kwargs["src"]
    local = [x if r == rank else t.to(device) for r, t in enumerate(xs)]
    arg, kwargs = call_args(case, rank, local, known)
    out = getattr(dg, case.op)(arg, group=group, **kwargs)
    torch.testing.assert_close(
        out.cpu(), expected[rank], **TOL[dtype], msg=lambda m: f"forward: {m}"
    )
    if in_place:
        out.mul_(2.0)
    (out * vs[rank].to(device)).sum().backward()
    if not passes_none:
        got = (x.grad if x.grad is not None else torch.zeros_like(x)).cpu()
        want = grads[rank] * (2.0 if in_place else 1.0)
        torch.testing.assert_close(got, want, **TOL[dtype], msg=lambda m: f"gradient: {m}")


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
