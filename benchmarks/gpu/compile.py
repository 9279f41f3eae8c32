"""Part ``compile``: every call of a training step in one ``torch.compile(fullgraph=True)``
graph, with eager's gradients."""

from __future__ import annotations

import torch
from tests.collectives.reference import warm_up
from torch import Tensor

from .ranks import bind, on_ranks, setups, short
from .report import Section
from .step import leaf, step_calls


def _compiled(rank: int, n: int, device: str, backend: str) -> tuple[int, int, list[str], str]:
    """(graphs, breaks, break reasons, '' or the first mismatch) of every call in one step
    under ``torch.compile(fullgraph=True)``, against the eager step, float64."""
    where = bind(rank, device)
    calls = step_calls(rank, n, where, torch.float64)
    warm_up(device)

    def step(x: Tensor) -> Tensor:
        return sum(
            (call(x) * (i + 1) for i, (_, call) in enumerate(calls)),
            torch.zeros((), device=x.device, dtype=x.dtype),
        )

    x = leaf(rank, where, torch.float64, 3)
    explained = torch._dynamo.explain(step)(x)
    reasons = [str(r.reason)[:200] for r in explained.break_reasons]
    torch._dynamo.reset()
    compiled = torch.compile(step, fullgraph=True, backend=backend)
    for seed in (4, 5):
        x = leaf(rank, where, torch.float64, seed)
        want = step(x)
        (want_grad,) = torch.autograd.grad(want, x)
        got = compiled(x)
        (got_grad,) = torch.autograd.grad(got, x)
        for g, w, what in ((got, want, "loss"), (got_grad, want_grad, "gradient")):
            try:  # the compiler fuses and reorders arithmetic: 1e-9 relative in float64
                torch.testing.assert_close(g, w, rtol=1e-9, atol=1e-9)
            except AssertionError as exc:
                return (
                    explained.graph_count,
                    explained.graph_break_count,
                    reasons,
                    f"{what}: {short(exc)}",
                )
    return explained.graph_count, explained.graph_break_count, reasons, ""


def part(device: str, gpus: int) -> Section:
    # inductor compiles C++ for a CPU graph (60-100 s per step on 2 cores, tests/compile);
    # aot_eager traces the same graph with AOT autograd and proves the logic in seconds.
    backend = "inductor" if device == "cuda" else "aot_eager"
    section = Section(
        "compile",
        f"Every op and loss of `sync`'s step summed in one function, `torch.compile("
        f'fullgraph=True, backend="{backend}")`, float64: `torch._dynamo.explain` must count '
        "one graph and no break, and two steps on fresh data must give eager's loss and "
        "gradient (1e-9 relative: the compiler reorders arithmetic)."
        + ("" if device == "cuda" else " CPU mode uses aot_eager, not inductor."),
        ("setup", "backend", "graphs", "breaks", "result"),
    )
    setup = setups(device, gpus)[0]
    per_rank = on_ranks(
        section,
        setup,
        (backend, "-", "-"),
        _compiled,
        (setup.device, backend),
        timeout=400,
        collective_timeout=120,
    )
    if per_rank is None:
        return section
    graphs, breaks, reasons, _ = per_rank[0]
    if (graphs, breaks) != (1, 0):
        result = f"FAIL: {graphs} graphs, {breaks} breaks: {'; '.join(reasons)}"
    else:
        result = next((f"FAIL: rank {r}: {m[3]}" for r, m in enumerate(per_rank) if m[3]), "pass")
    section.rows.append((setup.label, backend, str(graphs), str(breaks), result))
    return section
