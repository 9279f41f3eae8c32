"""Each op's backward against float64 central finite differences taken across ranks.

Objective: F = sum_r <op(x)_r, v_r> with a different random cotangent per rank. For a handful
of entries (rank s, index i), every rank recomputes F with x_s[i] moved by +-h; F is summed over
ranks with a raw all_reduce (outside autograd), and (F+ - F-) / 2h must equal rank s's autograd
gradient at i. This checks the adjoints without trusting any reference implementation.
Tolerance: central differences of these (at most quadratic, for prod up to degree N) functions
with h = 1e-6 in float64 agree to about 1e-7 relative; we allow 1e-6.

Double backward: for the linear ops, d/dv_r of <dF/dx, w> is op(w)_r. We check that
torch.autograd.grad with create_graph=True runs through the partner ops (whose own backward is
a collective again) and gives the single-process answer, float64 to 1e-10.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

import distgrad as dg
from distgrad.testing import run_on_ranks
from tests._support import FLOAT64, seeded
from tests.collectives.reference import OPS, Case, cotangents, inputs, outputs

H = 1e-6


def fd_cases(n: int) -> list[Case]:
    out = [
        Case("all_gather", tuple((1 + r, 2) for r in range(n))),
        Case("all_to_all", ((2 * n,),) * n),
        Case("broadcast", ((2,),) * n, {"src": n - 1}),
        Case("gather", tuple((1 + r,) for r in range(n)), {"dst": 0}),
        Case("scatter", ((2 * n,),) * n, {"src": 0}),
        Case("permute", ((2,),) * n, {"perm": [(r + 1) % n for r in range(n)]}),
    ]
    for op in OPS:
        out += [
            Case("all_reduce", ((3,),) * n, {"op": op}),
            Case("reduce_scatter", ((n,),) * n, {"op": op}),
            Case("reduce", ((2,),) * n, {"op": op, "dst": 0}),
        ]
    return out


def _objective(case: Case, rank: int, x: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    passes_none = case.op == "scatter" and rank != case.kwargs["src"]
    out = getattr(dg, case.op)(None if passes_none else x, **case.kwargs_for(rank))
    return (out * v).sum()


def _check_fd(rank: int, n: int) -> list[str]:
    failures = []
    for case in fd_cases(n):
        xs = inputs(case, torch.float64, seed=3)
        vs = cotangents(outputs(case, xs), seed=4)
        x = xs[rank].clone().requires_grad_()
        _objective(case, rank, x, vs[rank]).backward()
        grad = x.grad if x.grad is not None else torch.zeros_like(x)
        for owner in range(n):
            for index in range(min(2, xs[owner].numel())):
                slopes = []
                for step in (H, -H):
                    moved = xs[rank].clone()
                    if rank == owner:
                        moved.view(-1)[index] += step
                    with torch.no_grad():
                        value = _objective(case, rank, moved, vs[rank])
                    dist.all_reduce(value)  # raw: the objective is the sum over ranks
                    slopes.append(value.item())
                numeric = (slopes[0] - slopes[1]) / (2 * H)
                if rank == owner:
                    analytic = grad.view(-1)[index].item()
                    if abs(numeric - analytic) > 1e-6 * max(1.0, abs(analytic)):
                        failures.append(
                            f"{case}: d/dx_{owner}[{index}] numeric {numeric} vs "
                            f"autograd {analytic}"
                        )
    return failures


def test_backward_of_every_op_matches_finite_differences_across_ranks() -> None:
    for world_size in (2, 3):
        failures = [f for r in run_on_ranks(_check_fd, world_size) for f in r]
        assert not failures, "\n".join(failures)


def _double_backward(rank: int, n: int) -> list[str]:
    """grad of <dF/dx, w> w.r.t. v, through the backward's own collectives."""
    failures = []
    # scatter is left out: its non-source ranks have no input to take a gradient for, so
    # torch.autograd.grad(objective, x) there would skip the backward collective.
    linear = [
        c for c in fd_cases(n) if c.kwargs.get("op", "sum") in ("sum", "avg") and c.op != "scatter"
    ]
    for case in linear:
        xs = inputs(case, torch.float64, seed=5)
        vs = cotangents(outputs(case, xs), seed=6)
        ws = [
            torch.randn(x.shape, dtype=torch.float64, generator=seeded(9 + r))
            for r, x in enumerate(xs)
        ]
        # Single process: F = sum_r <op(x)_r, v_r> is linear in x, so dF/dx = op^T(v) and
        # d<op^T(v), w>/dv = op(w).
        ref_vs = [v.clone().requires_grad_() for v in vs]
        ref_xs = [x.clone().requires_grad_() for x in xs]
        total = sum((o * v).sum() for o, v in zip(outputs(case, ref_xs), ref_vs, strict=True))
        gx = torch.autograd.grad(total, ref_xs, create_graph=True, allow_unused=True)
        second = sum((g * w).sum() for g, w in zip(gx, ws, strict=True) if g is not None)
        expected = torch.autograd.grad(second, ref_vs, allow_unused=True)[rank]
        expected = expected if expected is not None else torch.zeros_like(vs[rank])
        x = xs[rank].clone().requires_grad_()
        v = vs[rank].clone().requires_grad_()
        objective = _objective(case, rank, x, v)
        (g,) = torch.autograd.grad(objective, x, create_graph=True, allow_unused=True)
        assert g is not None
        (got,) = torch.autograd.grad((g * ws[rank]).sum(), v, allow_unused=True)
        got = got if got is not None else torch.zeros_like(v)
        if not torch.allclose(got, expected, **FLOAT64):
            failures.append(f"{case}: double backward {got} vs {expected}")
    return failures


def test_double_backward_of_linear_ops_matches_single_process() -> None:
    failures = [f for r in run_on_ranks(_double_backward, 2) for f in r]
    assert not failures, "\n".join(failures)
