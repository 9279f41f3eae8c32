"""How long a surviving rank takes to see that its peer died, per op, pass, size and fault.

Each trial is a fresh pair of gloo processes (``dg.testing.run_on_ranks``) running one op's
forward and backward in a loop; rank 1 dies at a chosen point (``tests/faults/_inject.py``
says how) and rank 0 records when its exchange failed. Detection time = survivor's error time
minus the fault's time (one machine, one clock). The process-group timeout is 10 s, so a
survivor that waited for it shows as about 10 s. ``torch all_gather`` is torch's own
collective, not distgrad, under the same fault.

Run: ``python benchmarks/faults.py [--trials N] [--quick]`` from the repository root; writes
``benchmarks/results/faults.md``.
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import random
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # for tests.faults._inject

from tests.faults._inject import LARGE, SMALL, Fault, inject, ops

RESULTS = Path(__file__).parent / "results" / "faults.md"
PG_TIMEOUT_S = 10.0


def trial(fault: Fault) -> tuple[float | None, str]:
    """(detection seconds or None, a note) for one trial of ``fault``."""
    failure, fault_at = inject(fault, PG_TIMEOUT_S, PG_TIMEOUT_S + 5)
    if failure is None:
        return None, "no fault seen"
    seen = failure.results.get(0)
    if seen is None or seen.error_type is None or fault_at is None:
        return None, "survivor did not report"
    return seen.when - fault_at, seen.message.splitlines()[0][:160]


def cases(quick: bool) -> list[tuple[str, Fault]]:
    names = list(ops(2, 8))
    out: list[tuple[str, Fault]] = []
    for shape, label in ((SMALL, "128 KB"), (LARGE, "32 MB")):
        for name in names:
            for where in ("forward", "backward"):
                if name == "torch all_gather" and where == "backward":
                    continue
                out.append((f"{name} {where} {label} sigkill", Fault(name, shape, where)))
    for kind in ("exit", "raise"):
        for name in ("all_gather", "all_reduce"):
            out.append((f"{name} backward 128 KB {kind}", Fault(name, SMALL, "backward", kind)))
    return out[:: 6 if quick else 1]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--trials", type=int, default=5, help="trials per case")
    parser.add_argument("--mid-transfer-trials", type=int, default=20)
    parser.add_argument("--quick", action="store_true", help="a few cases, 1 trial: a smoke test")
    parser.add_argument("--only", default="", help="run the cases whose name contains this")
    args = parser.parse_args()
    trials = 1 if args.quick else args.trials
    rng = random.Random(0)
    rows: list[str] = []
    start = time.monotonic()
    plan = [(name, fault, trials) for name, fault in cases(args.quick)]
    if not args.quick:  # the case the issue measured: a kill during 32 MB exchanges
        for name in ("all_gather", "all_to_all", "torch all_gather"):
            fault = Fault(name, LARGE, "forward")
            plan.append(
                (f"{name} forward 32 MB sigkill mid-transfer", fault, args.mid_transfer_trials)
            )
    plan = [case for case in plan if args.only in case[0]]
    for name, fault, n in plan:
        times: list[float] = []
        notes: set[str] = set()
        for _ in range(n):
            delay = rng.uniform(0.0, 0.03) if fault.shape == LARGE else 0.0
            took, note = trial(Fault(**{**fault.__dict__, "delay": delay}))
            if took is None:
                notes.add(note)
            else:
                times.append(took)
        rows.append(_row(name, times, n, notes))
        print(rows[-1], flush=True)
    if not args.only:  # a partial run prints its rows and leaves the table alone
        _write(rows, trials, time.monotonic() - start, args.quick)


def _row(name: str, times: list[float], n: int, notes: set[str]) -> str:
    if not times:
        return f"| {name} | 0/{n} | | | | {'; '.join(sorted(notes))} |"
    ms = sorted(t * 1000 for t in times)
    slow = sum(t >= PG_TIMEOUT_S - 1 for t in times)
    return (
        f"| {name} | {len(times)}/{n} | {ms[0]:.0f} | {statistics.median(ms):.0f} | {ms[-1]:.0f} "
        f"| {slow} waited for the timeout{'; ' + '; '.join(sorted(notes)) if notes else ''} |"
    )


def _write(rows: list[str], trials: int, seconds: float, quick: bool) -> None:
    today = datetime.date.today().isoformat()
    head = [
        "# Fault detection times",
        "",
        f"Measured {today} on {platform.machine()} with {os.cpu_count()} cores, torch "
        f"{torch.__version__}, by `python benchmarks/faults.py{' --quick' if quick else ''}` "
        f"({trials} trials per case unless named, {seconds:.0f} s). Process-group timeout "
        f"{PG_TIMEOUT_S:.0f} s. A 32 MB case kills the peer 0-30 ms after it entered the pass "
        "(inside the transfer); a 128 KB case kills it as it enters the pass.",
        "",
        "| case | detected | min ms | median ms | max ms | notes |",
        "|---|---|---|---|---|---|",
    ]
    RESULTS.parent.mkdir(exist_ok=True)
    RESULTS.write_text("\n".join([*head, *rows, ""]))


if __name__ == "__main__":
    main()
