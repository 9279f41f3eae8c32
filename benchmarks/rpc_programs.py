"""The six canonical RPC programs (examples/rpc_programs): step time with distgrad over step
time with torch, the import switched alone.

Each round runs every program once per mode (torch, FAST, and SMART where distributed autograd
runs), each on fresh processes, in a shuffled order; a run's step time is the median of its
steps after the first (the first pays lazy imports and warm-up), on the rank that trains
(the slowest training rank where several do). The ratio is paired: a mode's step time over
torch's in the same round, then the median over rounds. Correctness is tested in
tests/rpc/test_programs.py, not here.

Run: ``python benchmarks/rpc_programs.py [--rounds N]``; writes
``benchmarks/results/rpc_programs.md``.
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import random
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # examples/ from the checkout

import torch
from examples.rpc_programs import PROGRAMS
from examples.rpc_programs.runner import launch, modes_for

RESULTS = Path(__file__).parent / "results" / "rpc_programs.md"


def step_time(name: str, mode: str) -> float:
    """The program's step time in seconds: per rank, the median of its steps but the first;
    the slowest rank that trains."""
    ranks = launch(name, mode, timeout=120)
    return max(statistics.median(r.times[1:]) for r in ranks if len(r.times) > 1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    times: dict[tuple[str, str], list[float]] = {}
    ratios: dict[tuple[str, str], list[float]] = {}
    for round_ in range(args.rounds):
        runs = [(name, mode) for name in PROGRAMS for mode in modes_for(name)]
        random.shuffle(runs)
        got = {run: step_time(*run) for run in runs}
        for (name, mode), t in got.items():
            times.setdefault((name, mode), []).append(t)
            if mode != "torch":
                ratios.setdefault((name, mode), []).append(t / got[(name, "torch")])
        print(f"round {round_ + 1}/{args.rounds} done", flush=True)
    lines = [
        "# The canonical RPC programs: distgrad's step time over torch's",
        "",
        f"Written by `benchmarks/rpc_programs.py --rounds {args.rounds}` on "
        f"{datetime.date.today()}: torch {torch.__version__}, Python {platform.python_version()}, "
        f"{os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.1f} at the end.",
        "",
        "Step: one training step of the program (forward, backward, optimizer step; for",
        "agent_observer one episode and its update), the median of a run's steps after the",
        "first, on the slowest training rank; ratio: the median over rounds of the paired",
        "ratio (this mode over torch in the same round), with its range.",
        "",
        "| program | mode | step (ms), median | ratio to torch | range |",
        "|---|---|---|---|---|",
    ]
    for name in PROGRAMS:
        for mode in modes_for(name):
            ms = 1000 * statistics.median(times[(name, mode)])
            if mode == "torch":
                lines.append(f"| {name} | torch | {ms:.1f} | 1 | |")
                continue
            r = ratios[(name, mode)]
            lines.append(
                f"| {name} | {mode} | {ms:.1f} | {statistics.median(r):.2f}x "
                f"| {min(r):.2f}-{max(r):.2f} |"
            )
    RESULTS.write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
