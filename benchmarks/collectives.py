"""Forward+backward time of differentiable all_gather, all_reduce and reduce_scatter.

Every variant runs in the same two gloo processes, interleaved round-robin, so that they share
the machine's noise; each timing is the slower rank's, between two barriers. Variants:

* floor: the raw, non-differentiable communication that forward+backward needs, done the
  cheapest way we know: distgrad's own raw functions (``distgrad._comm``), which on gloo run
  all_gather and reduce-scatter as concurrent point-to-point pairs (the reduce-scatter summing
  locally), or below 256 KB per rank as gloo's all_gather and an all_reduce and a slice;
  all_reduce as torch's. Ratios are against this.
* floor (torch ops): the same communication with torch's raw collectives only
  (``all_gather_single``, ``reduce_scatter_single``).
* torch.distributed.nn: the deprecated differentiable collectives.
* funcol: ``torch.distributed._functional_collectives`` autograd variants.
* all_reduce+slice: a hand-written all_gather whose backward all_reduces the whole gradient and
  keeps its slice (a common hand-written fix).
* distgrad: this library past the calls it checks across ranks (the first 8 on a group), with
  the sizes given where an op takes them (``sizes=[n] * W``): its training-loop path, which
  sends nothing but the data.
* distgrad, sizes learned: all_gather without ``sizes=``, which exchanges them every call.
* distgrad, debug mode: every call checked across ranks (``dg.set_debug(True)``), backward too.
* distgrad compiled, funcol compiled: the op (forward and its backward) under
  ``torch.compile(fullgraph=True)``, inductor backend.

Shapes are each rank's input. Run: ``python benchmarks/collectives.py [--quick]``; writes
``benchmarks/results/collectives.md``.
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import random
import statistics
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
import torch.distributed.nn.functional as dist_nn

import distgrad as dg
from distgrad import _comm
from distgrad._group import resolve
from distgrad._meta import exchange
from distgrad.collectives._signature import CHECKED_CALLS
from distgrad.testing import run_on_ranks

SHAPES = [(256, 128), (4096, 512), (16384, 1024)]
ITERATIONS = {256: 200, 4096: 100, 16384: 30}  # rounds per shape (every variant once a round)
OPS = ["all_gather", "all_reduce", "reduce_scatter"]
RESULTS = Path(__file__).parent / "results" / "collectives.md"

Step = Callable[[torch.Tensor, torch.Tensor], tuple[torch.Tensor, ...]]


class _AllReduceThenSlice(torch.autograd.Function):
    """all_gather whose backward all_reduces the whole gradient and keeps this rank's rows."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        n = dist.get_world_size()
        out = x.new_empty((n * x.shape[0], *x.shape[1:]))
        dist.all_gather_into_tensor(out, x.contiguous())
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        grad = grad.contiguous().clone()
        dist.all_reduce(grad)
        rows = grad.shape[0] // dist.get_world_size()
        return grad[dist.get_rank() * rows : (dist.get_rank() + 1) * rows]


def _ideal_reduce_scatter(x: torch.Tensor) -> torch.Tensor:
    group = resolve(None)
    rows = x.shape[0] // group.size
    return _comm.reduce_scatter(x, [rows] * group.size, group)


def _ideal_all_gather(x: torch.Tensor) -> torch.Tensor:
    group = resolve(None)
    return _comm.all_gather(x, [x.shape[0]] * group.size, group)


def _torch_reduce_scatter(x: torch.Tensor) -> torch.Tensor:
    out = x.new_empty((x.shape[0] // dist.get_world_size(), *x.shape[1:]))
    dist.reduce_scatter_tensor(out, x.contiguous())
    return out


def _raw_all_gather(x: torch.Tensor) -> torch.Tensor:
    out = x.new_empty((dist.get_world_size() * x.shape[0], *x.shape[1:]))
    dist.all_gather_into_tensor(out, x)
    return out


def _raw_all_reduce(x: torch.Tensor) -> torch.Tensor:
    out = x.clone()
    dist.all_reduce(out)
    return out


def _variants(op: str) -> dict[str, Step]:
    """name -> step(x, cotangent): one forward and its backward."""
    world = dist.group.WORLD
    assert world is not None
    group = resolve(None)
    n = group.size

    # Each step reads the forward's output before the backward starts, as a loss would, so an
    # asynchronous forward (funcol's) cannot overlap its own backward, which no training step
    # allows; the cotangent v is then passed straight in, with no loss arithmetic to time.
    def autograd(fn: Callable[[torch.Tensor], torch.Tensor]) -> Step:
        def step(x: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, ...]:
            out = fn(x)
            float(out.reshape(-1)[0])
            out.backward(v)  # type: ignore[no-untyped-call]
            assert x.grad is not None
            return out, x.grad

        return step

    def raw(forward: Callable[[torch.Tensor], torch.Tensor], back: Callable[..., Any]) -> Step:
        def step(x: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, ...]:
            out = forward(x.detach())
            float(out.reshape(-1)[0])
            return out, back(v)

        return step

    def debug(fn: Callable[[torch.Tensor], torch.Tensor]) -> Step:
        def step(x: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, ...]:
            dg.set_debug(True)
            try:
                return autograd(fn)(x, v)
            finally:
                dg.set_debug(False)

        return step

    def compiled(fn: Callable[[torch.Tensor], torch.Tensor]) -> Step:
        return autograd(torch.compile(fn, fullgraph=True, dynamic=False))

    def even(x: torch.Tensor) -> list[int]:
        return [x.shape[0]] * n

    if op == "all_gather":
        return {
            "floor": raw(_ideal_all_gather, _ideal_reduce_scatter),
            "floor (torch ops)": raw(_raw_all_gather, _torch_reduce_scatter),
            "torch.distributed.nn": autograd(lambda x: torch.cat(dist_nn.all_gather(x))),  # type: ignore[no-untyped-call]
            "funcol": autograd(lambda x: funcol.all_gather_tensor_autograd(x, 0, world)),
            "all_reduce+slice": autograd(_AllReduceThenSlice.apply),
            "distgrad": autograd(lambda x: dg.all_gather(x, sizes=even(x))),
            "distgrad, sizes learned": autograd(dg.all_gather),
            "distgrad, debug mode": debug(lambda x: dg.all_gather(x, sizes=even(x))),
            "distgrad compiled": compiled(lambda x: dg.all_gather(x, sizes=even(x))),
            "funcol compiled": compiled(lambda x: funcol.all_gather_tensor_autograd(x, 0, world)),
        }
    if op == "all_reduce":
        return {
            "floor": raw(_raw_all_reduce, _raw_all_reduce),
            "torch.distributed.nn": autograd(dist_nn.all_reduce),
            "funcol": autograd(lambda x: funcol.all_reduce(x, "sum", world)),
            "distgrad": autograd(dg.all_reduce),
            "distgrad, debug mode": debug(dg.all_reduce),
            "distgrad compiled": compiled(dg.all_reduce),
            "funcol compiled": compiled(lambda x: funcol.all_reduce(x, "sum", world)),
        }
    return {
        "floor": raw(_ideal_reduce_scatter, _ideal_all_gather),
        "floor (torch ops)": raw(_torch_reduce_scatter, _raw_all_gather),
        "torch.distributed.nn": autograd(_nn_reduce_scatter),
        "funcol": autograd(lambda x: funcol.reduce_scatter_tensor_autograd(x, "sum", 0, world)),
        "distgrad": autograd(dg.reduce_scatter),
        "distgrad, debug mode": debug(dg.reduce_scatter),
        "distgrad compiled": compiled(dg.reduce_scatter),
        "funcol compiled": compiled(
            lambda x: funcol.reduce_scatter_tensor_autograd(x, "sum", 0, world)
        ),
    }


def _nn_reduce_scatter(x: torch.Tensor) -> torch.Tensor:
    n = dist.get_world_size()
    out = x.new_empty((x.shape[0] // n, *x.shape[1:]))
    result: torch.Tensor = dist_nn.reduce_scatter(out, list(x.chunk(n)))  # type: ignore[no-untyped-call]
    return result


def _cotangent(op: str, shape: tuple[int, int], n: int) -> torch.Tensor:
    rows = {"all_gather": shape[0] * n, "all_reduce": shape[0], "reduce_scatter": shape[0] // n}
    return torch.randn(rows[op], shape[1], generator=torch.Generator().manual_seed(1))


def _timed(step: Step, x: torch.Tensor, v: torch.Tensor) -> float:
    dist.barrier()
    start = time.perf_counter()
    for t in step(x, v):
        # Reading a value waits for an asynchronous collective (funcol returns before its
        # communication finishes), so every variant is timed to completion.
        float(t.reshape(-1)[0])
    elapsed = torch.tensor([time.perf_counter() - start], dtype=torch.float64)
    dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)  # the slower rank's time
    return float(elapsed.item())


def _handshake_time(x: torch.Tensor, iters: int) -> float:
    """The metadata exchange alone: what a checked call, or one that learns sizes, adds."""
    group = resolve(None)
    times = []
    for _ in range(iters):
        dist.barrier()
        start = time.perf_counter()
        exchange("all_reduce", "all_reduce", group, x, [0, 0, 1])
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def _bench(rank: int, world_size: int, quick: bool) -> dict[str, Any]:
    warnings.filterwarnings("ignore")  # torch.distributed.nn and old names warn on every call
    torch._inductor.config.compile_threads = 1  # two ranks on two cores
    for _ in range(CHECKED_CALLS):  # past the calls distgrad checks across ranks
        dg.all_reduce(torch.zeros(1))
    results: dict[str, Any] = {}
    for shape in SHAPES:
        iters = 3 if quick else ITERATIONS[shape[0]]
        x = torch.randn(shape, generator=torch.Generator().manual_seed(rank)).requires_grad_()
        for op in OPS:
            variants = _variants(op)
            v = _cotangent(op, shape, world_size)
            times: dict[str, list[float]] = {name: [] for name in variants}
            for step in variants.values():  # warm-up
                step(x, v)
            order = list(variants)
            shuffle = random.Random(len(order))  # the same order on every rank
            for _ in range(iters):
                shuffle.shuffle(order)  # no variant always runs right after the same one
                for name in order:
                    x.grad = None
                    times[name].append(_timed(variants[name], x, v))
            # Paired: each variant against the floor of the same round, so that a slow stretch
            # of the machine slows both sides of the ratio.
            results[f"{op} {shape}"] = {
                k: (
                    statistics.median(t),
                    statistics.median(a / b for a, b in zip(t, times["floor"], strict=True)),
                )
                for k, t in times.items()
            }
        results[f"handshake {shape}"] = _handshake_time(x, iters)
    return results


def _table_names() -> list[str]:
    return [
        "floor",
        "floor (torch ops)",
        "distgrad",
        "torch.distributed.nn",
        "funcol",
        "all_reduce+slice",
        "distgrad, sizes learned",
        "distgrad, debug mode",
        "distgrad compiled",
        "funcol compiled",
    ]


def _table(results: dict[str, Any]) -> list[str]:
    names = _table_names()
    lines = [
        "| op, shape per rank | " + " | ".join(names) + " |",
        "|---" * (len(names) + 1) + "|",
    ]
    for op in OPS:
        for shape in SHAPES:
            row = results[f"{op} {shape}"]
            cells = []
            for name in names:
                if name not in row:
                    cells.append("")
                    continue
                median, paired = row[name]
                cells.append(f"{median * 1e3:.2f} ms ({paired:.2f}x)")
            lines.append(f"| {op} {shape} | " + " | ".join(cells) + " |")
    return lines


def _handshake_lines(results: dict[str, Any]) -> list[str]:
    lines = [
        "| shape per rank | handshake | distgrad all_reduce fwd+bwd | share |",
        "|---|---|---|---|",
    ]
    for shape in SHAPES:
        hs = results[f"handshake {shape}"]
        total = results[f"all_reduce {shape}"]["distgrad"][0]
        lines.append(f"| {shape} | {hs * 1e6:.0f} us | {total * 1e3:.2f} ms | {hs / total:.1%} |")
    return lines


def _summary(runs: list[dict[str, Any]]) -> list[str]:
    """Each cell: the median over runs of the paired ratio, and its range over the runs."""
    names = [n for n in _table_names() if n != "floor"]
    lines = [
        "| op, shape per rank | " + " | ".join(names) + " |",
        "|---" * (len(names) + 1) + "|",
    ]
    for op in OPS:
        for shape in SHAPES:
            cells = []
            for name in names:
                ratios = [r[f"{op} {shape}"][name][1] for r in runs if name in r[f"{op} {shape}"]]
                if not ratios:
                    cells.append("")
                    continue
                span = f" ({min(ratios):.2f}-{max(ratios):.2f})" if len(ratios) > 1 else ""
                cells.append(f"{statistics.median(ratios):.2f}x{span}")
            lines.append(f"| {op} {shape} | " + " | ".join(cells) + " |")
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="3 iterations: a smoke test")
    parser.add_argument("--runs", type=int, default=3, help="independent runs (fresh processes)")
    args = parser.parse_args()
    runs = 1 if args.quick else args.runs
    sections: list[str] = []
    every: list[dict[str, Any]] = []
    started = time.perf_counter()
    for run in range(runs):
        load_before = os.getloadavg()[0]
        results = run_on_ranks(_bench, 2, args=(args.quick,), timeout=1800, collective_timeout=600)[
            0
        ]
        every.append(results)
        sections += [
            f"## Run {run + 1} (1-minute load average {load_before:.1f} before it, "
            f"{os.getloadavg()[0]:.1f} after)",
            "",
            *_table(results),
            "",
            "The metadata exchange alone (what a checked call, or one that learns its sizes, "
            "adds), next to a whole distgrad all_reduce forward+backward:",
            "",
            *_handshake_lines(results),
            "",
        ]
        print("\n".join(sections[-12:]), flush=True)
    took = time.perf_counter() - started
    body = [
        "# Collectives: forward+backward time (2 ranks, gloo, CPU, float32)",
        "",
        f"Measured {datetime.date.today()} on {platform.machine()} with {os.cpu_count()} cores, "
        f"torch {torch.__version__}, by `python benchmarks/collectives.py` "
        f"({'quick' if args.quick else 'full'}, {runs} independent run(s) in fresh processes, "
        f"{took:.0f} s). In each run every variant ran interleaved with the others in the same "
        "two processes, in a shuffled order each round, each timed until its results are "
        "readable (the slower rank's time). A run's cell is the median time and, in brackets, "
        "the median over rounds of the variant's time over the floor's time in the same round. "
        "Rounds per run: "
        + ", ".join(f"{n} at {s}" for s, n in zip(SHAPES, ITERATIONS.values(), strict=True))
        + ". distgrad runs past the first 8 calls on the group, which it checks across ranks; "
        "from then on a call with its sizes sends only its data (docs/semantics.md). The "
        "compiled variants were compiled before the rounds (not timed).",
        "",
        "## Summary: ratio to the floor, median over the runs (range over the runs)",
        "",
        "On 2 cores the two ranks and their gloo threads contend for the cores, and a single "
        "run's ratio moves by up to 0.1x from one run to the next; this table is the one to read.",
        "",
        *_summary(every),
        "",
        *sections,
    ]
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text("\n".join(body))
    print("\n".join(body[: 12 + len(OPS) * len(SHAPES)]))


if __name__ == "__main__":
    main()
