"""How long a surviving rank takes to see that its peer died, per op, pass, size and fault.

Each trial is a fresh pair of gloo processes (``dg.testing.run_on_ranks``) running one op's
forward and backward in a loop; rank 1 dies at a chosen point (``tests/faults/_inject.py``
says how) and rank 0 records when its exchange failed. Detection time = survivor's error time
minus the fault's time (one machine, one clock). The process-group timeout is 10 s, so a
survivor that waited for it shows as about 10 s. ``torch all_gather`` is torch's own
collective, not distgrad, under the same fault.

Two parts, each writing its own section of ``benchmarks/results/faults.md``:

* ``--kills`` (issue 37): repeated SIGKILLs of rank 1 on 2 and 3 ranks, for all_gather,
  all_reduce and reduce_scatter, forward and backward, at 128 KB and 32 MB, killed either in
  the wait (the victim sleeps instead of making the call and is killed once its peers have
  waited ``IN_WAIT_S``) or mid-transfer (0-30 ms into a busy loop of exchanges: inside a 32 MB
  transfer, or in whichever 128 KB call runs then). Every survivor's time counts, and its
  verdict: a first line that names rank 1 "still running" or says distgrad "cannot tell" is a
  wrong verdict for a killed peer. Targets: median <= 50 ms, worst <= 200 ms, no wrong verdict.
* ``--per-op``: every op on 2 ranks (the table of issue 12), killed as it enters the pass or
  inside a 32 MB transfer, plus exits and raises.

Run: ``python benchmarks/faults.py --kills [--trials N]`` or ``--per-op [--trials N] [--quick]``
from the repository root.
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import random
import re
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # for tests.faults._inject

from tests.faults._inject import LARGE, SMALL, Fault, inject, ops

RESULTS = Path(__file__).parent / "results" / "faults.md"
PG_TIMEOUT_S = 10.0


IN_WAIT_S = 0.1
KILL_OPS = ("all_gather", "all_reduce", "reduce_scatter")
KILLS_BEGIN, KILLS_END = "<!-- kills -->", "<!-- /kills -->"
PER_OP_BEGIN, PER_OP_END = "<!-- per op -->", "<!-- /per op -->"
WRONG = ("still running", "cannot tell")


def kill_trial(fault: Fault, world_size: int) -> list[tuple[float | None, str]]:
    """Each survivor's (detection seconds or None, first line of its error) for one kill."""
    failure, fault_at = inject(fault, PG_TIMEOUT_S, PG_TIMEOUT_S + 5, world_size)
    out: list[tuple[float | None, str]] = []
    for rank in range(world_size):
        if rank == 1:
            continue
        seen = failure.results.get(rank) if failure is not None else None
        if seen is None or seen.error_type is None or fault_at is None:
            out.append((None, "no error seen" if seen is not None else "did not report"))
        else:
            out.append((seen.when - fault_at, seen.message.splitlines()[0]))
    return out


def kills(trials: int, rng: random.Random, only: str = "") -> list[str]:
    """The kill-to-error table: one row per ranks, op, pass, size and kind of kill."""
    rows = [
        "| ranks | op | pass | size | killed | times | median ms | worst ms "
        "| outside the wait, median ms | survivor in its wait at the kill: n, median, worst ms "
        "| wrong verdicts | named | notes |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for world_size in (2, 3):
        for op in KILL_OPS:
            for where in ("forward", "backward"):
                for shape, size in ((SMALL, "128 KB"), (LARGE, "32 MB")):
                    for killed in ("in the wait", "mid-transfer"):
                        if only not in f"{world_size} ranks {op} {where} {size} {killed}":
                            continue
                        rows.append(
                            _kill_row(world_size, op, where, shape, size, killed, trials, rng)
                        )
                        print(rows[-1], flush=True)
    return rows


def _kill_row(
    world_size: int,
    op: str,
    where: str,
    shape: tuple[int, int],
    size: str,
    killed: str,
    trials: int,
    rng: random.Random,
) -> str:
    times: list[float] = []
    outside: list[float] = []  # of each time, what the survivor spent before it entered the wait
    # the times of survivors that were already waiting when the kill landed (outside ~ 0): the
    # detection itself, with no survivor's own work between exchanges in it
    waiting: list[float] = []
    wrong, named, notes = 0, 0, set()
    for _ in range(trials):
        if killed == "in the wait":
            fault = Fault(op, shape, where, delay=IN_WAIT_S, in_wait=True)
        else:
            fault = Fault(op, shape, where, delay=rng.uniform(0.0, 0.03), run_on=1_000_000)
        for took, first in kill_trial(fault, world_size):
            if took is None:
                notes.add(first)
                continue
            times.append(took)
            waited = re.search(r"([\d.]+) s into the wait", first)
            if waited is not None:
                outside.append(max(0.0, took - float(waited.group(1))))
                if outside[-1] <= 0.005:  # the message rounds to 10 ms; 5 ms of slack
                    waiting.append(took)
            blamed = "its connection to rank 1 closed" in first
            named += blamed and "rank 1 exited or crashed" in first
            if any(w in first for w in WRONG):
                wrong += 1
                notes.add(first[first.find("closed, ") :][:200])
            elif not blamed:
                notes.add(first[first.find("when its") :][:200])
    if not times:
        case = f"| {world_size} | {op} | {where} | {size} | {killed}"
        return f"{case} | 0 | | | | | | | {'; '.join(sorted(notes))} |"
    ms = sorted(t * 1000 for t in times)
    in_wait = sorted(t * 1000 for t in waiting)
    in_wait_cell = (
        f"{len(in_wait)}, {statistics.median(in_wait):.0f}, {in_wait[-1]:.0f}" if in_wait else "0"
    )
    return (
        f"| {world_size} | {op} | {where} | {size} | {killed} | {len(ms)} "
        f"| {statistics.median(ms):.0f} | {ms[-1]:.0f} "
        f"| {statistics.median(outside) * 1000 if outside else float('nan'):.0f} "
        f"| {in_wait_cell} | {wrong} | {named}/{len(ms)} "
        f"| {'; '.join(sorted(notes))} |"
    )


def _write_kills(rows: list[str], trials: int, seconds: float, load_at_start: float) -> None:
    times = [row.split(" | ") for row in rows[2:]]
    medians = [float(r[6]) for r in times if r[6].strip()]
    worst = [float(r[7]) for r in times if r[7].strip()]
    wrong = sum(int(r[10]) for r in times if r[10].strip())
    survivors = sum(int(r[5]) for r in times)
    load = f"{load_at_start:.1f} at the start of the run, {os.getloadavg()[0]:.1f} at its end"
    section = [
        KILLS_BEGIN,
        "## Kill to error (issue 37)",
        "",
        f"Measured {datetime.date.today().isoformat()} on {platform.machine()} with "
        f"{os.cpu_count()} cores (load average {load}), torch "
        f"{torch.__version__}, by `python benchmarks/faults.py --kills --trials {trials}` "
        f"({trials} kills per row, {seconds:.0f} s). Rank 1 is SIGKILLed; every other rank is a "
        "survivor and counts (a row of 3 ranks has two survivors per kill). 'in the wait': "
        f"rank 1 sleeps instead of making the call and is killed after its peers have waited "
        f"{IN_WAIT_S * 1000:.0f} ms; 'mid-transfer': killed 0-30 ms into a busy loop of "
        "exchanges (inside a 32 MB transfer, or whichever 128 KB call runs then). Times are "
        "from the kill to the survivor's error. 'wrong verdicts': a first line calling rank 1 "
        "still running or saying distgrad cannot tell; 'named': first lines saying 'rank 1 "
        "exited or crashed'. 'outside the wait': of each time, the part before the survivor "
        "entered the wait that failed (the time minus the message's 'N s into the wait'): its "
        "own work between exchanges, which no watching can shorten. 'survivor in its wait at "
        "the kill': the survivors whose outside part was under 5 ms (the message's 'N s' has "
        "10 ms steps), their count, median and worst: the detection alone.",
        "",
        f"Over all rows: {survivors} survivors' errors, worst median {max(medians):.0f} ms, "
        f"worst single {max(worst):.0f} ms, {wrong} wrong verdicts "
        "(targets: median <= 50 ms, worst <= 200 ms, 0 wrong).",
        "",
        *rows,
        KILLS_END,
    ]
    _replace_section(KILLS_BEGIN, KILLS_END, section)


def _replace_section(begin: str, end: str, section: list[str]) -> None:
    text = RESULTS.read_text() if RESULTS.exists() else "# Fault detection times\n"
    if begin in text:
        head, rest = text.split(begin, 1)
        tail = rest.split(end, 1)[1]
    else:
        head, tail = text.rstrip("\n") + "\n\n", "\n"
    RESULTS.write_text(head + "\n".join(section) + tail)


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
    parser.add_argument("--kills", action="store_true", help="issue 37's kill-to-error table")
    parser.add_argument("--per-op", action="store_true", help="issue 12's per-op table")
    parser.add_argument("--trials", type=int, default=5, help="trials per case")
    parser.add_argument("--mid-transfer-trials", type=int, default=20)
    parser.add_argument("--quick", action="store_true", help="a few cases, 1 trial: a smoke test")
    parser.add_argument("--only", default="", help="run the cases whose name contains this")
    args = parser.parse_args()
    trials = 1 if args.quick else args.trials
    rng = random.Random(0)
    rows: list[str] = []
    start = time.monotonic()
    if args.kills or not args.per_op:
        load = os.getloadavg()[0]
        rows = kills(trials, rng, args.only)
        if not args.only:  # a partial run prints its rows and leaves the table alone
            _write_kills(rows, trials, time.monotonic() - start, load)
        return
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
        PER_OP_BEGIN,
        "## Per op, 2 ranks (issue 12)",
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
    _replace_section(PER_OP_BEGIN, PER_OP_END, [*head, *rows, PER_OP_END])


if __name__ == "__main__":
    main()
