"""How long survivors take to name a dead peer, on 2 to N ranks.

Each trial is a fresh group (``dg.testing.run_on_ranks``): every rank runs all_gather or
all_reduce forward and backward in a loop; the last rank SIGKILLs itself at a random step
after stamping the time in a file, and every survivor records when its distgrad call failed.
Detection time = survivor's error time minus the stamp (one machine, one clock).

Run: ``python benchmarks/dead_peer_ranks.py [--ranks 2 3 4] [--trials 5]``; prints a table.
"""

from __future__ import annotations

import argparse
import os
import random
import signal
import statistics
import tempfile
import time
from pathlib import Path

import torch

import distgrad as dg
from distgrad.errors import RankFailedError
from distgrad.testing import run_on_ranks


def _loop(rank: int, world: int, op: str, stamp: str, seed: int) -> float | None:
    victim, steps = world - 1, random.Random(seed).randint(12, 30)
    x = torch.randn(64, 128, requires_grad=True)
    for step in range(1000):
        if rank == victim and step == steps:
            Path(stamp).write_text(repr(time.time()))
            os.kill(os.getpid(), signal.SIGKILL)
        try:
            out = dg.all_gather(x) if op == "all_gather" else dg.all_reduce(x)
            out.sum().backward()
        except RuntimeError as exc:
            assert f"rank {victim}" in str(exc).splitlines()[0], str(exc)
            return time.time()
    return None


def trial(world: int, op: str, seed: int) -> list[float]:
    with tempfile.TemporaryDirectory() as folder:
        stamp = os.path.join(folder, "stamp")
        try:
            run_on_ranks(_loop, world, args=(op, stamp, seed), collective_timeout=10, grace=15)
        except RankFailedError as failure:
            killed_at = float(Path(stamp).read_text())
            return [t - killed_at for t in failure.results.values() if t is not None]
    raise AssertionError("the victim did not die")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--ranks", type=int, nargs="+", default=[2, 3, 4])
    parser.add_argument("--trials", type=int, default=5)
    args = parser.parse_args()
    print("| ranks | op | survivors' detection, ms (min / median / max) | trials |")
    print("|---|---|---|---|")
    for world in args.ranks:
        for op in ("all_gather", "all_reduce"):
            times = [t for s in range(args.trials) for t in trial(world, op, s)]
            ms = sorted(1000 * t for t in times)
            print(
                f"| {world} | {op} | {ms[0]:.0f} / {statistics.median(ms):.0f} / {ms[-1]:.0f} "
                f"| {args.trials} |",
                flush=True,
            )


if __name__ == "__main__":
    main()
