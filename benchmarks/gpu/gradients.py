"""Part ``gradients``: the reference sweep of every op against single-process autograd."""

from __future__ import annotations

import traceback

import torch
from tests.collectives.reference import cases, check_case, edge_cases, replicated_cases, warm_up

from .ranks import bind, failure, on_ranks, setups, short
from .report import Section
from .step import OPS


def _sweep(rank: int, n: int, device: str, op: str) -> list[tuple[str, int, str]]:
    """(dtype, cases passed, first failure) for every case of ``op`` in the reference sweep,
    past the checked calls, with and without the sizes given. An error that is not a wrong
    value (a backend that rejects the call) ends the op: its peers may be left mid-exchange."""
    bind(rank, device)
    warm_up(device)
    chosen = [c for c in cases(n) + edge_cases(n) + replicated_cases(n) if c.op == op]
    found = []
    for dtype, async_op in ((torch.float64, False), (torch.float32, False), (torch.float64, True)):
        passed, first = 0, ""
        for case in chosen:
            for known in (False, True):
                try:
                    check_case(rank, n, case, dtype, device, known=known, async_op=async_op)
                    passed += 1
                except AssertionError as exc:
                    first = first or f"{case.kwargs} known={known}: {short(exc)}"
                except Exception as exc:
                    traceback.print_exc()  # the whole error, for the log; the row has its head
                    found.append((str(dtype), passed, f"{case.kwargs}: {short(exc)}"))
                    return found
        found.append((f"{dtype}{', async_op=True' if async_op else ''}", passed, first))
    return found


def part(device: str, gpus: int) -> Section:
    section = Section(
        "gradients",
        "Every case of the reference sweep (tests/collectives/reference.py: even and uneven "
        "sizes, several dims, every reduce op, prod with zeros, max/min with ties, the "
        "replicated objective), forward and input gradient against single-process autograd "
        "with a different random cotangent per rank, past the checked calls, with and without "
        "the sizes given; float64 once more with async_op=True (the result must still be in "
        "flight when the call returns). Tolerances: float64 rtol 1e-10, float32 rtol 1e-5.",
        ("setup", "op", "dtype", "cases", "result"),
    )
    for setup in setups(device, gpus):
        for op in OPS:
            count = 2 * sum(
                1
                for c in cases(setup.world_size)
                + edge_cases(setup.world_size)
                + replicated_cases(setup.world_size)
                if c.op == op
            )
            per_rank = on_ranks(
                section,
                setup,
                (op, "-", f"-/{count}"),
                _sweep,
                (setup.device, op),
                timeout=120,
                collective_timeout=30,
            )
            if per_rank is None:
                continue
            for i, (dtype, _, _) in enumerate(per_rank[0]):
                worst = min(r[i][1] if i < len(r) else 0 for r in per_rank)
                firsts = [r[i][2] for r in per_rank if i < len(r) and r[i][2]]
                result = "pass" if worst == count and not firsts else failure(firsts[0], setup)
                section.rows.append((setup.label, op, dtype, f"{worst}/{count}", result))
            if len(per_rank[0]) < 2:
                section.rows.append((setup.label, op, "torch.float32", "-", "not run: see above"))
    return section
