"""Single-process ground truth for every collective: all ranks simulated in one process.

Seeds, cotangents and tolerances come from tests/_support.py; this module adds what only the
collectives need: the cases, every rank's inputs, the reference outputs and gradients, and
checking one case on a rank. benchmarks/gpu_check.py imports its public names from here.

``outputs(case, xs)`` returns what each rank's call returns when rank r passed ``xs[r]``, built
from plain torch ops on the global data, so autograd of ``sum_r <outputs[r], v[r]>`` is the
gradient every distributed test compares with (the sum objective of docs/semantics.md).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

import distgrad as dg
from distgrad.collectives._signature import CHECKED_CALLS
from tests._support import FLOAT32, FLOAT64, Tolerance, cotangent, seeded

OPS = ("sum", "avg", "prod", "max", "min")
# The reductions may add in a different order than the reference (tests/_support.py).
TOL: dict[torch.dtype, Tolerance] = {torch.float64: FLOAT64, torch.float32: FLOAT32}


@dataclass(frozen=True)
class Case:
    op: str  # the distgrad function name
    shapes: tuple[tuple[int, ...], ...]  # rank r's input shape; None entries mean "pass None"
    kwargs: dict[str, Any] = field(default_factory=dict)
    per_rank_kwargs: tuple[dict[str, Any], ...] | None = None  # e.g. all_to_all input_sizes
    data: str = "randn"  # "randn", "zeros" (prod with zero entries) or "ties" (max/min ties)

    def kwargs_for(self, rank: int) -> dict[str, Any]:
        extra = self.per_rank_kwargs[rank] if self.per_rank_kwargs else {}
        return {**self.kwargs, **extra}


def inputs(case: Case, dtype: torch.dtype, seed: int = 0) -> list[Tensor]:
    """Every rank's input, the same on every process.

    "zeros": entry 0 is zero on every rank (several zeros) and entry 1 on rank 0 only (a single
    zero, whose gradient is the product of the others). "ties": small integers, so many entries
    tie across ranks.
    """
    xs = []
    for r, shape in enumerate(case.shapes):
        gen = seeded(seed * 100 + r)
        if case.data == "ties":
            x = torch.randint(0, 3, shape, generator=gen).to(dtype)
        else:
            x = torch.randn(shape, dtype=dtype, generator=gen)
        if case.data == "zeros":
            flat = x.view(-1)
            flat[0] = 0.0
            if r == 0 and flat.numel() > 1:
                flat[1] = 0.0
        xs.append(x)
    return xs


def cotangents(outs: list[Tensor], seed: int = 1) -> list[Tensor]:
    """A different random cotangent for every rank's output (a symmetric loss hides misrouting)."""
    return [cotangent(seed * 1000 + r, o) for r, o in enumerate(outs)]


def _reduce(stacked: Tensor, op: str) -> Tensor:
    if op == "sum":
        return stacked.sum(0)
    if op == "avg":
        return stacked.mean(0)
    if op == "prod":
        return stacked.prod(0)
    if op == "max":
        return stacked.amax(0)
    return stacked.amin(0)


def outputs(case: Case, xs: list[Tensor]) -> list[Tensor]:
    n = len(xs)
    k = case.kwargs
    op = case.op
    dim = k.get("dim", 0)
    if op == "all_gather":
        return [torch.cat(xs, dim)] * n
    if op == "all_reduce":
        return [_reduce(torch.stack(xs), k.get("op", "sum"))] * n
    if op == "reduce_scatter":
        red = _reduce(torch.stack(xs), k.get("op", "sum"))
        sizes = k.get("sizes") or [red.shape[dim] // n] * n
        return list(red.split(list(sizes), dim))
    if op == "all_to_all":
        parts = []
        for s in range(n):
            sizes = case.kwargs_for(s).get("input_sizes") or [xs[s].shape[dim] // n] * n
            parts.append(xs[s].split(list(sizes), dim))
        return [torch.cat([parts[s][r] for s in range(n)], dim) for r in range(n)]
    if op == "broadcast":
        return [xs[k["src"]]] * n
    if op == "reduce":
        red = _reduce(torch.stack(xs), k.get("op", "sum"))
        return [red if r == k["dst"] else torch.zeros_like(red) for r in range(n)]
    if op == "gather":
        full = torch.cat(xs, dim)
        empty = full.narrow(dim, 0, 0)
        return [full if r == k["dst"] else empty for r in range(n)]
    if op == "scatter":
        src = xs[k["src"]]
        sizes = k.get("sizes") or [src.shape[dim] // n] * n
        return list(src.split(list(sizes), dim))
    if op == "permute":
        perm = k["perm"]
        out: list[Tensor] = [xs[0]] * n
        for r in range(n):
            out[perm[r]] = xs[r]
        return out
    raise AssertionError(op)


def call_args(case: Case, rank: int, xs: list[Tensor], known: bool) -> tuple[Any, dict[str, Any]]:
    """What rank ``rank`` passes to ``case``'s op, as a user would: (x, keyword arguments).

    ``known``: also pass every size a rank could otherwise only learn from its peers
    (``sizes`` of all_gather and gather, ``output_sizes``, ``recv_shape``, and for scatter the
    sizes on every rank with a tensor shaped like its part on the receivers), so that the call
    exchanges no metadata. A scatter with ``sizes`` always takes that form (sizes are given on
    every rank or on none); without them its receivers pass None and learn the shapes.
    """
    n = len(xs)
    kwargs = case.kwargs_for(rank)
    dim = kwargs.get("dim", 0)
    x: Any = xs[rank]
    if case.op == "scatter":
        src = xs[kwargs["src"]]
        sizes = kwargs.get("sizes") or [src.shape[dim] // n] * n
        known = known or "sizes" in kwargs
        if rank != kwargs["src"]:
            if not known:
                return None, kwargs
            x = src.narrow(dim, 0, sizes[rank]).detach().clone().requires_grad_()  # as the source
        return x, ({**kwargs, "sizes": sizes} if known else kwargs)
    if not known:
        return x, kwargs
    if case.op in ("all_gather", "gather"):
        return x, {**kwargs, "sizes": [t.shape[dim % t.dim()] for t in xs]}
    if case.op == "permute":
        return x, {**kwargs, "recv_shape": tuple(xs[list(kwargs["perm"]).index(rank)].shape)}
    if case.op == "all_to_all":
        split = [
            case.kwargs_for(s).get("input_sizes") or [xs[s].shape[dim] // n] * n for s in range(n)
        ]
        return x, {**kwargs, "output_sizes": [split[s][rank] for s in range(n)]}
    return x, kwargs


def reference_grads(case: Case, xs: list[Tensor], vs: list[Tensor]) -> list[Tensor]:
    """d/dx_r of sum_r <outputs[r], vs[r]>, computed in one process."""
    leaves = [x.detach().clone().requires_grad_() for x in xs]
    outs = outputs(case, leaves)
    total = sum((o * v).sum() for o, v in zip(outs, vs, strict=True))
    grads = torch.autograd.grad(total, leaves, allow_unused=True)
    return [g if g is not None else torch.zeros_like(x) for g, x in zip(grads, xs, strict=True)]


def warm_up(device: str = "cpu", group: Any = None) -> None:
    """Make the calls that are checked across ranks, so that the next ones on ``group`` are not
    (as in a long training run)."""
    for _ in range(CHECKED_CALLS):
        dg.all_reduce(torch.zeros(1, device=device), group=group)


def outcome(call: Callable[..., object], *args: Any, **kwargs: Any) -> tuple[str, str]:
    """What ``call(*args, **kwargs)`` did on this rank: ``(exception type name, message)``, or
    ``("no error", "")``; ranks compare these to show an error is the same on every rank."""
    try:
        call(*args, **kwargs)
    except Exception as exc:
        return type(exc).__name__, f"{exc}"
    return "no error", ""


# ---------------------------------------------------------------------------------------------
# The sweep of cases, and checking one on a rank (test_gradients.py, test_subgroups.py).


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
    async_op: bool = False,
) -> None:
    """Run ``case`` as group rank ``rank`` of ``n`` and compare with the reference.

    ``async_op``: call the op with ``async_op=True``; its result must be an ``AsyncTensor``
    still waiting for its data, and every value and gradient must be the blocking call's.

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
    if async_op:
        kwargs["async_op"] = True
    out = getattr(dg, case.op)(arg, group=group, **kwargs)
    if async_op and n > 1:  # (alone, an op is a copy: nothing to wait for)
        assert isinstance(out, dg.AsyncTensor) and not out.done, f"not in flight: {type(out)}"
    torch.testing.assert_close(
        out.cpu(), expected[rank], **TOL[dtype], msg=lambda m: f"forward: {m}"
    )
    if in_place:
        out.mul_(2.0)
    # out.device, not device: a receiving rank of a scatter that passes no x gets its part on
    # the group's default device (CPU for gloo, even with CUDA tensors elsewhere).
    (out * vs[rank].to(out.device)).sum().backward()
    if not passes_none:
        assert x.grad is None or type(x.grad) is torch.Tensor, f"x.grad is a {type(x.grad)}"
        got = (x.grad if x.grad is not None else torch.zeros_like(x)).cpu()
        want = grads[rank] * (2.0 if in_place else 1.0)
        torch.testing.assert_close(got, want, **TOL[dtype], msg=lambda m: f"gradient: {m}")
