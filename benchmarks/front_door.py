"""How long the README's two commands take: ``distgrad demo`` and ``python -m pytest -q``.

Each is run as the README gives it, from the repository's root in this environment, a new
process each time: the demo ``--runs`` times in a row (its own report lands in a temporary
folder), the default test tier once (``--no-tests`` skips it). Reported: each run's wall time,
the demo's median, the tier's summary line, and the machine's load, which the tier's time
depends on (its processes fill both cores). Writes benchmarks/results/front_door.md, which the
README's opening quotes.

    .venv/bin/python benchmarks/front_door.py [--runs 3] [--no-tests]
"""

from __future__ import annotations

import argparse
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]


def _timed(command: list[str], cwd: Path, *, must_pass: bool = True) -> tuple[float, str]:
    started = time.perf_counter()
    done = subprocess.run(command, cwd=cwd, capture_output=True, text=True, timeout=1800)
    seconds = time.perf_counter() - started
    if must_pass:
        assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return seconds, done.stdout


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--no-tests", action="store_true")
    args = parser.parse_args()
    demo = [sys.executable, "-m", "distgrad", "demo"]
    demos: list[tuple[float, float]] = []  # (seconds, load average before)
    table = ""
    for _ in range(args.runs):
        with tempfile.TemporaryDirectory() as folder:
            load = os.getloadavg()[0]
            seconds, table = _timed(demo, Path(folder))
            demos.append((seconds, load))
    tier_row = ""
    if not args.no_tests:
        load = os.getloadavg()[0]
        tier = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider"]
        seconds, out = _timed(tier, ROOT, must_pass=False)  # its summary says what failed
        summary = next(line for line in reversed(out.splitlines()) if " passed" in line)
        summary = re.sub(r" in [\d.]+s.*$", "", summary.strip("= "))
        tier_row = f"| python -m pytest -q | 1 | {seconds:.0f} | {summary} | {load:.2f} |"
    loads = [load for _, load in demos]
    lines = [
        "# The README's two commands",
        "",
        f"`benchmarks/front_door.py --runs {args.runs}`: torch {torch.__version__}, "
        f"{os.cpu_count()} cores, the machine's load as it was (the load "
        "average before each command is in the table). Wall time of each command, a new "
        "process, from this environment, as the README gives it.",
        "",
        "| command | runs | median wall (s) | result | load average before |",
        "| --- | --- | --- | --- | --- |",
        f"| distgrad demo | {len(demos)} | {statistics.median(t for t, _ in demos):.1f} | "
        f"exit 0 | {min(loads):.2f}-{max(loads):.2f} |",
    ]
    if tier_row:
        lines.append(tier_row)
    lines += ["", "Each demo run, in seconds: " + ", ".join(f"{t:.1f}" for t, _ in demos) + "."]
    lines += ["", "The demo's table (the last run):", "", "```", table.strip(), "```"]
    text = "\n".join(lines) + "\n"
    (ROOT / "benchmarks" / "results" / "front_door.md").write_text(text)
    print(text)


if __name__ == "__main__":
    main()
