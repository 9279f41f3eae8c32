"""Forward+backward time of every differentiable collective, at three sizes and several world
sizes, against torch's own collectives and the raw-communication floor.

For each world size, the ranks are started once (``distgrad.testing.run_on_ranks``, gloo, CPU,
float32) and every variant of an op runs interleaved with the others in the same processes, in
a shuffled order each round, so that they share the machine's noise; each timing is the slower
rank's, from a barrier until its outputs are readable. Variants:

* torch Function: torch's own raw collectives wrapped in an autograd Function, forward the op
  and backward its adjoint (all_gather / reduce_scatter, broadcast / reduce, gather / scatter,
  all_to_all / all_to_all, and a send/recv pair for permute), through torch 2.13's current
  names (``all_gather_single``, ``reduce_scatter_single``: the old names warn on every call):
  the leanest code a torch user writes by hand. **Every ratio is against it**, in the same
  round.
* floor: the raw, non-differentiable communication that forward+backward needs, done the
  cheapest way we know: distgrad's own raw functions (``distgrad._exchange.ops``), which on gloo run
  all_gather, reduce-scatter and all_to_all as concurrent point-to-point pairs above 256 KB
  per rank, and gloo's collectives below.
* distgrad: this library past the calls it checks across ranks (the first 8 on a group), with
  its sizes given where an op takes them: its training-loop path, which sends nothing but data.
* distgrad + guard: the same with the data guard on (``dg.set_guard(True)``, off by default):
  what the guard costs is the ratio of the two columns (its own table, paired per round).
* torch.distributed.nn: the deprecated differentiable collectives, where one exists.
* funcol: ``torch.distributed._functional_collectives``'s autograd variants, where one exists.
* distgrad compiled, funcol compiled: the op (forward and its backward) under
  ``torch.compile(fullgraph=True)``, inductor backend, compiled before the rounds.

Every cell is a paired ratio: the median over rounds of the variant's time over the torch
Function's time in the same round. (Results before 2026-11-27 divided by the faster of torch and
the floor instead, and their torch variant called the deprecated ``all_gather_into_tensor``
and ``reduce_scatter_tensor``, whose warning machinery ran on every call: that baseline was
neither torch's leanest nor always torch, which is why it read 0.88x-1.16x where a hand-written
Function measured distgrad's small all_gather at 1.42x-1.49x.) The calling thread's CPU time per
forward+backward (the slower rank's) is kept for distgrad and torch.

Run: ``python benchmarks/collectives.py [--world-sizes 2,4,8] [--runs 3] [--quick] [--ops a,b]``;
writes ``benchmarks/results/collectives.md`` (or ``--output``).
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
from distgrad._exchange import ops
from distgrad._exchange.group import resolve
from distgrad.collectives._signature import CHECKED_CALLS
from distgrad.testing import run_on_ranks

# Each rank's input, float32, 128 columns: 32 KB, 1 MB and 4 MB.
SIZES = {"32 KB": 64, "1 MB": 2048, "4 MB": 8192}
COLUMNS = 128
ROUNDS = {"32 KB": 150, "1 MB": 30, "4 MB": 8}  # rounds per run (every variant once a round)
OPS = [
    "all_gather",
    "reduce_scatter",
    "all_reduce",
    "all_to_all",
    "broadcast",
    "reduce",
    "gather",
    "scatter",
    "permute",
]
VARIANTS = [
    "torch Function",
    "floor",
    "distgrad",
    "distgrad + guard",
    "torch.distributed.nn",
    "funcol",
    "distgrad compiled",
    "funcol compiled",
]
RESULTS = Path(__file__).parent / "results" / "collectives.md"
ROOT = 0  # src / dst of the rooted ops

Step = Callable[[torch.Tensor, torch.Tensor], tuple[torch.Tensor, ...]]
Raw = Callable[[torch.Tensor], torch.Tensor]


# ---------------------------------------------------------------------------------------------
# torch's raw collectives, one direction each (non-root ranks return an empty placeholder)


def _world() -> tuple[int, int]:
    return dist.get_rank(), dist.get_world_size()


# torch 2.13's names; older torch has only the old ones (which 2.13 warns about on each call).
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def _t_all_gather(x: torch.Tensor) -> torch.Tensor:
    out = x.new_empty((dist.get_world_size() * x.shape[0], *x.shape[1:]))
    _all_gather_single(out, x.contiguous())
    return out


def _t_reduce_scatter(x: torch.Tensor) -> torch.Tensor:
    out = x.new_empty((x.shape[0] // dist.get_world_size(), *x.shape[1:]))
    _reduce_scatter_single(out, x.contiguous())
    return out


def _t_all_reduce(x: torch.Tensor) -> torch.Tensor:
    out = x.clone()
    dist.all_reduce(out)
    return out


def _t_all_to_all(x: torch.Tensor) -> torch.Tensor:
    out = torch.empty_like(x)
    dist.all_to_all_single(out, x.contiguous())
    return out


def _t_broadcast(x: torch.Tensor) -> torch.Tensor:
    out = x.clone() if dist.get_rank() == ROOT else torch.empty_like(x)
    dist.broadcast(out, ROOT)
    return out


def _t_reduce(x: torch.Tensor) -> torch.Tensor:
    out = x.clone()
    dist.reduce(out, ROOT)
    return out if dist.get_rank() == ROOT else torch.zeros_like(x)


def _t_gather(x: torch.Tensor) -> torch.Tensor:
    rank, world = _world()
    parts = [torch.empty_like(x) for _ in range(world)] if rank == ROOT else None
    dist.gather(x.contiguous(), parts, dst=ROOT)
    return torch.cat(parts) if parts is not None else x.new_zeros((world * x.shape[0], x.shape[1]))


def _t_scatter(x: torch.Tensor) -> torch.Tensor:
    rank, world = _world()
    out = x.new_empty((x.shape[0] // world, *x.shape[1:]))
    dist.scatter(out, list(x.contiguous().chunk(world)) if rank == ROOT else None, src=ROOT)
    return out


def _t_shift(x: torch.Tensor, by: int) -> torch.Tensor:
    rank, world = _world()
    out = torch.empty_like(x)
    ops = [
        dist.P2POp(dist.isend, x.contiguous(), (rank + by) % world),
        dist.P2POp(dist.irecv, out, (rank - by) % world),
    ]
    for work in dist.batch_isend_irecv(ops):
        work.wait()
    return out


# The adjoint pairs: (forward, backward) with torch's raw collectives.
_TORCH_PAIRS: dict[str, tuple[Raw, Raw]] = {
    "all_gather": (_t_all_gather, _t_reduce_scatter),
    "reduce_scatter": (_t_reduce_scatter, _t_all_gather),
    "all_reduce": (_t_all_reduce, _t_all_reduce),
    "all_to_all": (_t_all_to_all, _t_all_to_all),
    "broadcast": (_t_broadcast, _t_reduce),
    "reduce": (_t_reduce, _t_broadcast),
    "gather": (_t_gather, _t_scatter),
    "scatter": (_t_scatter, _t_gather),
    "permute": (lambda x: _t_shift(x, 1), lambda x: _t_shift(x, -1)),
}


class _TorchCollective(torch.autograd.Function):
    """A hand-written differentiable collective on torch's raw collectives."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, op: str) -> torch.Tensor:
        ctx.op = op
        return _TORCH_PAIRS[op][0](x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return _TORCH_PAIRS[ctx.op][1](grad), None


# ---------------------------------------------------------------------------------------------
# The floor: distgrad's raw functions where they beat torch's, torch's raw collectives elsewhere


def _floor_pair(op: str) -> tuple[Raw, Raw]:
    group = resolve(None)
    n = group.size

    def gather_all(x: torch.Tensor) -> torch.Tensor:
        return ops.all_gather.eager(x, [x.shape[0]] * n, group=group)

    def scatter_sum(x: torch.Tensor) -> torch.Tensor:
        return ops.reduce_scatter.eager(x, [x.shape[0] // n] * n, group=group)

    def exchange(x: torch.Tensor) -> torch.Tensor:
        rows = [x.shape[0] // n] * n
        return ops.all_to_all.eager(x, rows, rows, group=group)

    ours = {
        "all_gather": (gather_all, scatter_sum),
        "reduce_scatter": (scatter_sum, gather_all),
        "all_to_all": (exchange, exchange),
    }
    return ours.get(op, _TORCH_PAIRS[op])


# ---------------------------------------------------------------------------------------------
# Variants


def _distgrad(op: str, n: int) -> Raw | None:
    perm = [(r + 1) % n for r in range(n)]
    parts: dict[tuple[int, ...], torch.Tensor] = {}

    def part_like(x: torch.Tensor) -> torch.Tensor:
        """A scatter receiver's tensor shaped like its part, made once (as torch's scatter
        takes an output tensor): a slice of x made at every call would add a view and its
        backward that the torch Function's receiver does not have."""
        shape = (x.shape[0] // n, *x.shape[1:])
        if shape not in parts:
            parts[shape] = x.new_empty(shape).requires_grad_()
        return parts[shape]

    ops: dict[str, Raw] = {
        "all_gather": lambda x: dg.all_gather(x, sizes=[x.shape[0]] * n),
        "reduce_scatter": lambda x: dg.reduce_scatter(x, sizes=[x.shape[0] // n] * n),
        "all_reduce": lambda x: dg.all_reduce(x),
        "all_to_all": lambda x: dg.all_to_all(
            x, input_sizes=[x.shape[0] // n] * n, output_sizes=[x.shape[0] // n] * n
        ),
        "broadcast": lambda x: dg.broadcast(x, ROOT),
        "reduce": lambda x: dg.reduce(x, ROOT),
        "gather": lambda x: dg.gather(x, ROOT, sizes=[x.shape[0]] * n),
        # Other ranks pass a tensor shaped like the part they receive (docs of dg.scatter).
        "scatter": lambda x: dg.scatter(
            x if dist.get_rank() == ROOT else part_like(x),
            ROOT,
            sizes=[x.shape[0] // n] * n,
        ),
        "permute": lambda x: dg.permute(x, perm, recv_shape=x.shape),
    }
    return ops.get(op)


def _dist_nn(op: str, n: int) -> Raw | None:
    def reduce_scatter(x: torch.Tensor) -> torch.Tensor:
        out = x.new_empty((x.shape[0] // n, *x.shape[1:]))
        result: torch.Tensor = dist_nn.reduce_scatter(out, list(x.chunk(n)))  # type: ignore[no-untyped-call]
        return result

    def scatter(x: torch.Tensor) -> torch.Tensor:
        result: torch.Tensor = dist_nn.scatter(list(x.chunk(n)), src=ROOT)  # type: ignore[no-untyped-call]
        return result

    ops: dict[str, Raw] = {
        "all_gather": lambda x: torch.cat(dist_nn.all_gather(x)),  # type: ignore[no-untyped-call]
        "reduce_scatter": reduce_scatter,
        "all_reduce": dist_nn.all_reduce,
        "all_to_all": lambda x: dist_nn.all_to_all_single(torch.empty_like(x), x),  # type: ignore[no-untyped-call]
        "broadcast": lambda x: dist_nn.broadcast(x, ROOT),  # type: ignore[no-untyped-call]
        "reduce": lambda x: dist_nn.reduce(x, ROOT),  # type: ignore[no-untyped-call]
        "gather": lambda x: torch.cat(dist_nn.gather(x, dst=ROOT)),  # type: ignore[no-untyped-call]
        "scatter": scatter,
    }
    return ops.get(op)


def _funcol(op: str, n: int) -> Raw | None:
    world = dist.group.WORLD
    assert world is not None
    ops: dict[str, Raw] = {
        "all_gather": lambda x: funcol.all_gather_tensor_autograd(x, 0, world),
        "reduce_scatter": lambda x: funcol.reduce_scatter_tensor_autograd(x, "sum", 0, world),
        "all_reduce": lambda x: funcol.all_reduce(x, "sum", world),
        "all_to_all": lambda x: funcol.all_to_all_single_autograd(x, None, None, world),
    }
    return ops.get(op)


def _variants(op: str, n: int, compiled: bool) -> dict[str, Step]:
    """name -> step(x, cotangent): one forward and its backward."""

    # Each step reads the forward's output before the backward starts, as a loss would, so an
    # asynchronous forward (funcol's) cannot overlap its own backward, which no training step
    # allows; the cotangent v is then passed straight in, with no loss arithmetic to time.
    def autograd(fn: Raw) -> Step:
        def step(x: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, ...]:
            out = fn(x)
            _read(out)
            # A rooted op's result off the root may be empty (distgrad's gather): its
            # cotangent is then empty too.
            out.backward(v if out.shape == v.shape else torch.zeros_like(out))  # type: ignore[no-untyped-call]
            return out, x.grad if x.grad is not None else x

        return step

    def raw(forward: Raw, back: Raw) -> Step:
        def step(x: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, ...]:
            out = forward(x.detach())
            _read(out)
            return out, back(v)

        return step

    steps: dict[str, Step] = {
        "torch Function": autograd(lambda x: _TorchCollective.apply(x, op)),
        "floor": raw(*_floor_pair(op)),
    }
    found = {
        "distgrad": _distgrad(op, n),
        "torch.distributed.nn": _dist_nn(op, n),
        "funcol": _funcol(op, n),
    }
    for name, fn in found.items():
        if fn is not None:
            steps[name] = autograd(fn)
    plain = found["distgrad"]
    if plain is not None:
        steps["distgrad + guard"] = _with_guard(autograd(plain))
    if compiled and found["funcol"] is not None:  # compared where funcol has the op
        for name in ("distgrad", "funcol"):
            fn = found[name]
            if fn is not None:
                # One graph per size: sizes derived from x.shape stay constants (a gather with
                # symbolic sizes does not trace off its destination; docs/semantics.md).
                compiled_fn = torch.compile(fn, fullgraph=True, dynamic=False)
                steps[f"{name} compiled"] = autograd(compiled_fn)
    return steps


def _with_guard(step: Step) -> Step:
    """``step`` with distgrad's data guard on (forward and backward), off again after."""

    def guarded(x: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, ...]:
        dg.set_guard(True)
        try:
            return step(x, v)
        finally:
            dg.set_guard(False)

    return guarded


def _read(t: torch.Tensor) -> None:
    """Read a value: this waits for an asynchronous collective (funcol returns before its
    communication finishes), so that every variant is timed to completion."""
    if t.numel():
        float(t.reshape(-1)[0])


def _input(op: str, rows: int, rank: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(rank)
    return torch.randn(rows, COLUMNS, generator=gen).requires_grad_()


def _cotangent(op: str, rows: int, n: int) -> torch.Tensor:
    out_rows = {"all_gather": rows * n, "gather": rows * n, "reduce_scatter": rows // n}
    out_rows["scatter"] = rows // n
    gen = torch.Generator().manual_seed(1)
    return torch.randn(out_rows.get(op, rows), COLUMNS, generator=gen)


def _timed(step: Step, x: torch.Tensor, v: torch.Tensor) -> tuple[float, float]:
    """(wall, calling thread's CPU) seconds of one step, the slower rank's each."""
    dist.barrier()
    start, cpu = time.perf_counter(), time.thread_time()
    for t in step(x, v):
        _read(t)
    taken = torch.tensor([time.perf_counter() - start, time.thread_time() - cpu])
    dist.all_reduce(taken, op=dist.ReduceOp.MAX)
    return float(taken[0]), float(taken[1])


def _bench(
    rank: int, world_size: int, quick: bool, compiled: bool, ops: list[str]
) -> dict[str, Any]:
    warnings.filterwarnings("ignore")  # torch.distributed.nn and old names warn on every call
    torch._inductor.config.compile_threads = 1  # many ranks on few cores
    for _ in range(CHECKED_CALLS):  # past the calls distgrad checks across ranks
        dg.all_reduce(torch.zeros(1))
    results: dict[str, Any] = {}
    for size, rows in SIZES.items():
        rounds = 3 if quick else ROUNDS[size]
        for op in ops:
            x = _input(op, rows, rank)
            v = _cotangent(op, rows, world_size)
            variants = _variants(op, world_size, compiled)
            for step in variants.values():  # warm-up (and compilation)
                x.grad = None
                step(x, v)
            wall: dict[str, list[float]] = {name: [] for name in variants}
            cpu: dict[str, list[float]] = {name: [] for name in variants}
            order = list(variants)
            shuffle = random.Random(len(order))  # the same order on every rank
            for _ in range(rounds):
                shuffle.shuffle(order)  # no variant always runs right after the same one
                for name in order:
                    x.grad = None
                    w, c = _timed(variants[name], x, v)
                    wall[name].append(w)
                    cpu[name].append(c)
            # Paired: each variant against the torch Function in the same round, so that a slow
            # stretch of the machine slows both sides of the ratio.
            best = wall["torch Function"]
            results[f"{op} {size}"] = {
                name: {
                    "median": statistics.median(times),
                    "ratio": statistics.median(t / b for t, b in zip(times, best, strict=True)),
                    "cpu": statistics.median(cpu[name]),
                }
                for name, times in wall.items()
            }
            # The guard's cost, paired directly: distgrad with it over distgrad, per round.
            guarded, bare = wall["distgrad + guard"], wall["distgrad"]
            results[f"{op} {size}"]["guard"] = {
                "ratio": statistics.median(g / b for g, b in zip(guarded, bare, strict=True)),
                "cpu": statistics.median(
                    g / b for g, b in zip(cpu["distgrad + guard"], cpu["distgrad"], strict=True)
                ),
            }
    return results


# ---------------------------------------------------------------------------------------------
# Report


def _ops_in(results: dict[str, Any]) -> list[str]:
    return [op for op in OPS if any(key.startswith(f"{op} ") for key in results)]


def _run_table(results: dict[str, Any]) -> list[str]:
    names = VARIANTS
    lines = [
        "| op, size per rank | " + " | ".join(names) + " | CPU: distgrad / torch Function |",
        "|---" * (len(names) + 2) + "|",
    ]
    for op in _ops_in(results):
        for size in SIZES:
            row = results[f"{op} {size}"]
            cells = [
                f"{row[name]['median'] * 1e3:.2f} ms ({row[name]['ratio']:.2f}x)"
                if name in row
                else ""
                for name in names
            ]
            cpu = (
                f"{row['distgrad']['cpu'] * 1e3:.3f} / {row['torch Function']['cpu'] * 1e3:.3f} ms"
            )
            lines.append(f"| {op} {size} | " + " | ".join(cells) + f" | {cpu} |")
    return lines


def _summary(runs: list[dict[str, Any]]) -> list[str]:
    """Each cell: the median over runs of the paired ratio, and its range over the runs."""
    names = VARIANTS
    lines = [
        "| op, size per rank | " + " | ".join(names) + " |",
        "|---" * (len(names) + 1) + "|",
    ]
    for op in _ops_in(runs[0]):
        for size in SIZES:
            cells = []
            for name in names:
                ratios = [
                    r[f"{op} {size}"][name]["ratio"] for r in runs if name in r[f"{op} {size}"]
                ]
                if not ratios:
                    cells.append("")
                    continue
                span = f" ({min(ratios):.2f}-{max(ratios):.2f})" if len(ratios) > 1 else ""
                cells.append(f"{statistics.median(ratios):.2f}x{span}")
            lines.append(f"| {op} {size} | " + " | ".join(cells) + " |")
    return lines


def _guard_table(by_world: dict[int, list[dict[str, Any]]]) -> list[str]:
    worlds = sorted(by_world)
    lines = [
        "| op, size per rank | " + " | ".join(f"{w} ranks: wall, CPU" for w in worlds) + " |",
        "|---" * (len(worlds) + 1) + "|",
    ]

    def cell(w: int, key: str) -> str:
        walls = [r[key]["guard"]["ratio"] for r in by_world[w]]
        cpus = [r[key]["guard"]["cpu"] for r in by_world[w]]
        span = f" ({min(walls):.2f}-{max(walls):.2f})" if len(walls) > 1 else ""
        return f"{statistics.median(walls):.3f}x{span}, {statistics.median(cpus):.3f}x"

    for op in _ops_in(by_world[worlds[0]][0]):
        for size in SIZES:
            key = f"{op} {size}"
            lines.append(f"| {key} | " + " | ".join(cell(w, key) for w in worlds) + " |")
    return lines


def _growth(by_world: dict[int, list[dict[str, Any]]]) -> list[str]:
    """distgrad's and torch's median time per op and size at each world size."""
    worlds = sorted(by_world)
    head = " | ".join(f"{w} ranks" for w in worlds)
    lines = [
        f"| op, size per rank | {head} | CPU per call at {worlds[0]} / {worlds[-1]} ranks |",
        "|---" * (len(worlds) + 2) + "|",
    ]

    def median(w: int, key: str, name: str, field: str) -> float:
        return statistics.median(r[key][name][field] for r in by_world[w])

    for op in _ops_in(by_world[worlds[0]][0]):
        for size in SIZES:
            key = f"{op} {size}"
            cells = [
                f"{median(w, key, 'distgrad', 'median') * 1e3:.2f} ms"
                f" (torch Function {median(w, key, 'torch Function', 'median') * 1e3:.2f})"
                for w in worlds
            ]
            first, last = (median(w, key, "distgrad", "cpu") * 1e3 for w in (worlds[0], worlds[-1]))
            lines.append(f"| {key} | " + " | ".join(cells) + f" | {first:.2f} / {last:.2f} ms |")
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world-sizes", default="2,4,8", help="comma-separated (default 2,4,8)")
    parser.add_argument("--runs", type=int, default=3, help="independent runs (fresh processes)")
    parser.add_argument("--quick", action="store_true", help="3 rounds, 1 run: a smoke test")
    parser.add_argument("--no-compile", action="store_true", help="leave out compiled variants")
    parser.add_argument("--ops", default=",".join(OPS), help="comma-separated (default: all 9)")
    parser.add_argument("--output", type=Path, default=RESULTS)
    args = parser.parse_args()
    ops = [op for op in OPS if op in args.ops.split(",")]
    worlds = [int(w) for w in args.world_sizes.split(",")]
    for world in worlds:
        if min(SIZES.values()) % world:
            parser.error(f"every world size must divide {min(SIZES.values())} (the rows at 32 KB)")
    runs = 1 if args.quick else args.runs
    by_world: dict[int, list[dict[str, Any]]] = {w: [] for w in worlds}
    sections: list[str] = []
    started = time.perf_counter()
    for run in range(runs):
        for world in worlds:
            load_before = os.getloadavg()[0]
            took = time.perf_counter()
            results = run_on_ranks(
                _bench,
                world,
                args=(args.quick, not args.no_compile, ops),
                timeout=3600,
                collective_timeout=900,
            )[0]
            by_world[world].append(results)
            sections += [
                f"### {world} ranks, run {run + 1} ({time.perf_counter() - took:.0f} s; "
                f"1-minute load average {load_before:.1f} before it, "
                f"{os.getloadavg()[0]:.1f} after)",
                "",
                *_run_table(results),
                "",
            ]
            print("\n".join(sections[-len(ops) * len(SIZES) - 5 :]), flush=True)
    took = time.perf_counter() - started
    cores = os.cpu_count()
    body = [
        "# Collectives: forward+backward time at every world size (gloo, CPU, float32)",
        "",
        f"Measured {datetime.date.today()} on {platform.machine()} with {cores} cores, "
        f"torch {torch.__version__}, by `python benchmarks/collectives.py --world-sizes "
        f"{args.world_sizes}{' --quick' if args.quick else ''}"
        f"{' --no-compile' if args.no_compile else ''}"
        f"{'' if ops == OPS else ' --ops ' + ','.join(ops)}` ({runs} independent run(s) per world "
        f"size in fresh processes, {took:.0f} s). Rounds per run: "
        + ", ".join(f"{ROUNDS[s] if not args.quick else 3} at {s}" for s in SIZES)
        + ". Each cell is the median time and, in brackets, the median over rounds of the "
        "variant's time over the torch Function's in the same round. distgrad "
        "runs past the first 8 calls on the group, which it checks across ranks. With more "
        f"ranks than the machine's {cores} cores, the ranks and their threads share the cores: "
        "times grow with the ranks for that reason too; the ratios, paired in the same "
        "processes and moment, are what carry over.",
        "",
    ]
    for world in worlds:
        body += [
            f"## {world} ranks: ratio to the torch Function, median over the runs (range)",
            "",
            *_summary(by_world[world]),
            "",
        ]
    body += [
        "## The data guard's cost: distgrad's time with the guard over its time without",
        "",
        "Paired per round (the two run in the same round), median over rounds, then the median"
        " (range) over the runs; wall time, then the calling thread's CPU time.",
        "",
        *_guard_table(by_world),
        "",
        "## Growth with the ranks: distgrad's median time (torch's), and CPU per call",
        "",
        *_growth(by_world),
        "",
        "## Every run",
        "",
        *sections,
    ]
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text("\n".join(body))
    print(f"wrote {args.output}")


if __name__ == "__main__":
    main()
