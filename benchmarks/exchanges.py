"""Which exchange to use on gloo, per op, size and world size: the raw candidates, paired.

distgrad picks one exchange for each raw op on gloo (``distgrad._exchange``); this benchmark
measures the candidates it chose between, without autograd, in the same processes and rounds:

* reduce-scatter (sum, equal slices): gloo's all_to_all and a local sum (what distgrad runs at
  every size), an all_reduce and this rank's slice (what it ran below 256 KB per slice until
  2026-11-26), and gloo's own reduce-scatter (faster on some rows, but its work cannot be
  waited on in ticks, so distgrad cannot use it: docs/semantics.md);
* all_gather (equal sizes): gloo's all_gather (distgrad's below 256 KB per rank), concurrent
  point-to-point pairs (above), and gloo's all_to_all of the piece repeated once per rank;
* all_reduce (sum): gloo's all_reduce (distgrad's), and an all_to_all, a local sum and an
  all_gather (two steps whatever the ranks, against a ring's 2(N-1)).

Each timing is the slower rank's, from a barrier until the result is there; each cell is the
median over rounds of the candidate's time over the first candidate's in the same round. With
more ranks than the machine has cores, the ranks share them, and every step of a ring waits
for its next rank to be scheduled: the 4- and 8-rank rows measure that machine, not a cluster.

Run: ``python benchmarks/exchanges.py [--world-sizes 2,4,8] [--rounds 200]``; writes
``benchmarks/results/exchanges.md``.
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import random
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from distgrad._exchange import ops
from distgrad._exchange.group import Group, resolve
from distgrad._exchange.inflight import drive
from distgrad._exchange.pairs import exchange_by_pairs
from distgrad.testing import run_on_ranks

RESULTS = Path(__file__).parent / "results" / "exchanges.md"
COLUMNS = 128
# Per rank (all_gather, all_reduce) or per slice (reduce-scatter), float32 x 128 columns.
SIZES = {"4 KB": 8, "32 KB": 64, "256 KB": 512}

Candidate = Callable[[], torch.Tensor]


def _reduce_scatter(x: torch.Tensor, group: Group) -> dict[str, Candidate]:
    n, rows = group.size, x.shape[0] // group.size
    sizes = [rows] * n
    assert group.pg is not None
    pg = group.pg

    def all_to_all_and_sum() -> torch.Tensor:
        return ops.reduce_scatter.eager(x, sizes, group=group)

    def all_reduce_and_slice() -> torch.Tensor:
        total = ops.all_reduce.eager(x, "sum", group=group)
        return total.narrow(0, group.rank * rows, rows).clone()

    def gloo_reduce_scatter() -> torch.Tensor:
        out = x.new_empty((rows, *x.shape[1:]))
        options = dist.ReduceScatterOptions()
        options.reduceOp = dist.ReduceOp.SUM
        pg._reduce_scatter_base(out, x, options).wait()
        return out

    return {
        "all_to_all + sum (distgrad)": all_to_all_and_sum,
        "all_reduce + slice": all_reduce_and_slice,
        "gloo's reduce-scatter": gloo_reduce_scatter,
    }


def _all_gather(x: torch.Tensor, group: Group) -> dict[str, Candidate]:
    n, rows = group.size, x.shape[0]
    sizes = [rows] * n

    def gloo_all_gather() -> torch.Tensor:
        return ops.all_gather.eager(x, sizes, group=group)

    def pairs() -> torch.Tensor:
        out = x.new_empty((rows * n, *x.shape[1:]))
        drive(exchange_by_pairs([x] * n, list(out.split(rows)), group))  # distgrad's pairs
        return out

    def all_to_all() -> torch.Tensor:
        return ops.all_to_all.eager(x.repeat(n, 1), sizes, sizes, group=group)

    return {
        "gloo's all_gather (distgrad)": gloo_all_gather,
        "pairs": pairs,
        "all_to_all of the piece": all_to_all,
    }


def _all_reduce(x: torch.Tensor, group: Group) -> dict[str, Candidate]:
    n, rows = group.size, x.shape[0] // group.size
    sizes = [rows] * n

    def gloo_all_reduce() -> torch.Tensor:
        return ops.all_reduce.eager(x, "sum", group=group)

    def two_steps() -> torch.Tensor:
        mine = ops.reduce_scatter.eager(x, sizes, group=group)
        return ops.all_gather.eager(mine, sizes, group=group)

    return {
        "gloo's all_reduce (distgrad)": gloo_all_reduce,
        "all_to_all + sum + all_gather": two_steps,
    }


OPS: dict[str, Callable[[torch.Tensor, Group], dict[str, Candidate]]] = {
    "reduce-scatter": _reduce_scatter,
    "all_gather": _all_gather,
    "all_reduce": _all_reduce,
}


def _timed(fn: Candidate) -> float:
    dist.barrier()
    start = time.perf_counter()
    fn()
    taken = torch.tensor([time.perf_counter() - start])
    dist.all_reduce(taken, op=dist.ReduceOp.MAX)
    return float(taken[0])


def _bench(rank: int, world_size: int, rounds: int) -> dict[str, Any]:
    torch.set_num_threads(1)
    group = resolve(None)
    found: dict[str, Any] = {}
    for op, candidates_of in OPS.items():
        for size, rows in SIZES.items():
            shape = (rows, COLUMNS) if op == "all_gather" else (rows * world_size, COLUMNS)
            x = torch.randn(shape, generator=torch.Generator().manual_seed(rank))
            candidates = candidates_of(x, group)
            first = next(iter(candidates.values()))()
            for name, fn in candidates.items():  # the same result, and warm
                for _ in range(5):
                    got = fn()
                torch.testing.assert_close(got, first, msg=f"{op} {size}: {name} differs")
            times: dict[str, list[float]] = {name: [] for name in candidates}
            order = list(candidates)
            shuffle = random.Random(len(order))  # the same order on every rank
            for _ in range(rounds):
                shuffle.shuffle(order)
                for name in order:
                    times[name].append(_timed(candidates[name]))
            base = times[next(iter(candidates))]
            found[f"{op} {size}"] = {
                name: {
                    "median": statistics.median(t),
                    "ratio": statistics.median(a / b for a, b in zip(t, base, strict=True)),
                }
                for name, t in times.items()
            }
    return found


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world-sizes", default="2,4,8")
    parser.add_argument("--rounds", type=int, default=200)
    args = parser.parse_args()
    worlds = [int(w) for w in args.world_sizes.split(",")]
    started = time.monotonic()
    lines = [
        "# Which exchange on gloo: the raw candidates, paired (CPU, float32)",
        "",
        f"Measured {datetime.date.today()} on {platform.machine()} with {os.cpu_count()} cores, "
        f"torch {torch.__version__}, by `python benchmarks/exchanges.py --world-sizes "
        f"{args.world_sizes} --rounds {args.rounds}`. Each cell: the median time of one call "
        "(the slower rank's, from a barrier) and, in brackets, the median over rounds of its "
        "time over the first candidate's in the same round. Sizes are per rank (all_gather, "
        "all_reduce: per rank's slice of the reduction) or per slice (reduce-scatter). "
        "Candidates and why: the script's docstring.",
    ]
    for world in worlds:
        rounds = max(20, args.rounds * 2 // world)
        found = run_on_ranks(_bench, world, args=(rounds,), timeout=3000)[0]
        lines += ["", f"## {world} ranks ({rounds} rounds)", ""]
        for op, cells in found.items():
            row = "; ".join(
                f"{name} {cell['median'] * 1e6:.0f} us ({cell['ratio']:.2f}x)"
                for name, cell in cells.items()
            )
            lines.append(f"* {op}: {row}")
    lines += ["", f"({time.monotonic() - started:.0f} s in all.)"]
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
