"""What the compiler does with distgrad's exchanges now that they are torch's functional
collectives: bucketing, guards, and what a compiled ring saves for its backward.

Three measurements, each against torch's own functional collectives (funcol) in the same
processes and moment, on 2 gloo ranks (CPU):

* **Bucketed step.** 16 small all_reduces (64 float32 each) in one step, compiled with inductor
  and ``torch._inductor.config.bucket_all_reduces_fx = "all"``, written with ``dg.all_reduce``
  and with ``funcol.all_reduce``: the c10d all_reduce calls one step makes (counted from the
  profiler's events of a run) and the step's wall time, as the median over paired rounds of
  distgrad's time over funcol's, and each variant's median time; then the same with dynamo's
  guards skipped, which leaves the guards' share of each step.
* **Guards.** The guard lines dynamo checks before every run of a compiled forward (the
  lines of its guard tree; the backward compiled with it has none), per op where funcol has
  it, distgrad over funcol.
* **A compiled ring's saved tensors.** The bytes saved for the backward (every tensor packed
  by ``torch.autograd.graph.saved_tensors_hooks``, each storage once) by ``clip_loss`` and
  ``siglip_loss`` with ``block_size=``, eager and compiled (``aot_eager``): compiled, the ring
  is a traced loop of compute and functional shifts, and must save no more than eager, which
  is what the opaque custom op of earlier versions saved.

Run: ``python benchmarks/compiled_step.py [--rounds 200]``; writes
``benchmarks/results/compiled_step.md``.
"""

from __future__ import annotations

import argparse
import datetime
import platform
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
from torch import Tensor

import distgrad as dg
from distgrad.collectives._signature import CHECKED_CALLS
from distgrad.testing import run_on_ranks

RESULTS = Path(__file__).parent / "results" / "compiled_step.md"
SMALL, COUNT = 64, 16


def _step_of(reduce: Callable[[Tensor], Tensor]) -> Callable[..., list[Tensor]]:
    def step(*xs: Tensor) -> list[Tensor]:
        return [reduce(x * 2) for x in xs]

    return step


def _c10d_all_reduces(fn: Callable[..., Any], xs: list[Tensor]) -> int:
    """The c10d all_reduce calls one run of ``fn`` makes, from the profiler's events."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        fn(*xs)
    names = [e.name for e in prof.events()]
    return sum(1 for n in names if n in ("c10d::allreduce_", "gloo:all_reduce"))


def _bucketed(rank: int, n: int, rounds: int) -> dict[str, Any]:
    config = torch._inductor.config
    config.compile_threads = 1
    config.bucket_all_reduces_fx = "all"
    world = dist.group.WORLD
    xs = [torch.full((SMALL,), float(i + rank)) for i in range(COUNT)]
    variants = {
        "distgrad": torch.compile(_step_of(dg.all_reduce), fullgraph=True),
        "funcol": torch.compile(
            _step_of(lambda x: funcol.all_reduce(x, "sum", world)), fullgraph=True
        ),
    }
    calls = {}
    for name, fn in variants.items():
        for _ in range(3):  # compiled and warm
            out = fn(*xs)
        assert [float(o[0]) for o in out] == [
            sum(2.0 * (i + r) for r in range(n)) for i in range(16)
        ]
        calls[name] = _c10d_all_reduces(fn, xs)
    times: dict[str, list[float]] = {}
    for i in range(rounds):
        order = list(variants) if i % 2 == 0 else list(reversed(variants))
        for skip in (False, True):
            # With dynamo's guards skipped (unsafe outside a measurement): what is left is the
            # compiled code and its runtime wrappers, so the difference is the guards' time.
            with torch.compiler.set_stance("default", skip_guard_eval_unsafe=skip):
                for name in order:
                    dist.barrier()
                    start = time.perf_counter()
                    out = variants[name](*xs)
                    float(out[-1][0])
                    key = f"{name}, guards skipped" if skip else name
                    times.setdefault(key, []).append(time.perf_counter() - start)
    return {"calls": calls, "times": times}


def _guard_lines(fn: Callable[[Tensor], Tensor], x: Tensor) -> int:
    """The lines of the guard tree dynamo checks before each run of ``fn``'s compiled forward
    (its backward, compiled with it, runs unguarded)."""
    from torch._dynamo.eval_frame import _debug_get_cache_entry_list

    def step(x: Tensor) -> Tensor:
        return fn(x)

    torch._dynamo.reset()
    torch.compile(step, backend="aot_eager", fullgraph=True)(x).sum().backward()
    (entry,) = _debug_get_cache_entry_list(step.__code__)
    return sum(1 for line in str(entry.guard_manager).splitlines() if line.strip())


def _guards(rank: int, n: int) -> dict[str, tuple[int, int]]:
    world = dist.group.WORLD
    x = torch.randn(64, 128, requires_grad=True)
    rows = [64] * n
    pairs: dict[str, tuple[Callable[[Tensor], Tensor], Callable[[Tensor], Tensor]]] = {
        "all_gather": (
            lambda x: dg.all_gather(x, sizes=rows),
            lambda x: funcol.all_gather_tensor_autograd(x, 0, world),
        ),
        "reduce_scatter": (
            lambda x: dg.reduce_scatter(x, sizes=[64 // n] * n),
            lambda x: funcol.reduce_scatter_tensor_autograd(x, "sum", 0, world),
        ),
        "all_reduce": (dg.all_reduce, lambda x: funcol.all_reduce(x, "sum", world)),
        "all_to_all": (
            lambda x: dg.all_to_all(x, input_sizes=[64 // n] * n, output_sizes=[64 // n] * n),
            lambda x: funcol.all_to_all_single_autograd(x, None, None, world),
        ),
    }
    return {
        op: (_guard_lines(ours, x), _guard_lines(theirs, x)) for op, (ours, theirs) in pairs.items()
    }


def _saved_bytes(fn: Callable[[Tensor, Tensor], Tensor], a: Tensor, b: Tensor) -> int:
    seen: dict[tuple[int, int], int] = {}

    def pack(t: Tensor) -> Tensor:
        if t.numel():
            seen[(t.untyped_storage().data_ptr(), t.untyped_storage().nbytes())] = (
                t.untyped_storage().nbytes()
            )
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = fn(a, b)
    loss.backward()
    return sum(seen.values())


def _ring_saved(rank: int, n: int) -> dict[str, tuple[int, int]]:
    gen = torch.Generator().manual_seed(rank)
    a = torch.randn(256, 64, generator=gen, requires_grad=True)
    b = torch.randn(256, 64, generator=gen, requires_grad=True)
    losses: dict[str, Callable[[Tensor, Tensor], Tensor]] = {
        "clip_loss, block_size=64": lambda a, b: dg.losses.clip_loss(a, b, block_size=64),
        "siglip_loss, block_size=64": lambda a, b: dg.losses.siglip_loss(a, b, block_size=64),
    }
    found = {}
    for name, fn in losses.items():
        torch._dynamo.reset()
        compiled = torch.compile(fn, backend="aot_eager", fullgraph=True)
        compiled(a, b).backward()  # compiled before measuring
        found[name] = (_saved_bytes(fn, a, b), _saved_bytes(compiled, a, b))
    return found


def _all(rank: int, n: int, rounds: int) -> dict[str, Any]:
    for _ in range(CHECKED_CALLS):
        dg.all_reduce(torch.zeros(1))
    return {
        "bucketed": _bucketed(rank, n, rounds),
        "guards": _guards(rank, n),
        "ring": _ring_saved(rank, n),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=200)
    parser.add_argument("--output", type=Path, default=RESULTS)
    args = parser.parse_args()
    results = run_on_ranks(_all, 2, args=(args.rounds,), timeout=1800)
    bucketed = [r["bucketed"] for r in results]
    # Each round's time is the slower rank's.
    slow = {
        name: [max(ts) for ts in zip(*(b["times"][name] for b in bucketed), strict=True)]
        for name in bucketed[0]["times"]
    }
    ratios = [d / f for d, f in zip(slow["distgrad"], slow["funcol"], strict=True)]
    calls = bucketed[0]["calls"]
    lines = [
        "# Compiled steps: bucketing, guards, a ring's saved tensors",
        "",
        f"Measured {datetime.date.today()} on {platform.machine()}, torch {torch.__version__}, "
        f"by `python benchmarks/compiled_step.py --rounds {args.rounds}`: 2 gloo ranks on this "
        "machine's CPUs (the script's docstring says how).",
        "",
        f'## {COUNT} small all_reduces, inductor, `bucket_all_reduces_fx="all"`',
        "",
        "| | c10d all_reduce calls a step | median step | distgrad / funcol (paired) |",
        "|---|---|---|---|",
        f"| distgrad | {calls['distgrad']} | {statistics.median(slow['distgrad']) * 1e3:.3f} ms | "
        f"{statistics.median(ratios):.2f} (quartiles "
        f"{statistics.quantiles(ratios, n=4)[0]:.2f}-{statistics.quantiles(ratios, n=4)[2]:.2f}) |",
        f"| funcol | {calls['funcol']} | {statistics.median(slow['funcol']) * 1e3:.3f} ms | 1 |",
        "",
        "The same steps with dynamo's guards skipped (`skip_guard_eval_unsafe`), in the same "
        "rounds: what remains is the compiled code and its runtime wrappers.",
        "",
        "| | median step, guards skipped | guards' share of the step |",
        "|---|---|---|",
    ]
    for name in ("distgrad", "funcol"):
        full = statistics.median(slow[name])
        bare = statistics.median(slow[f"{name}, guards skipped"])
        lines.append(f"| {name} | {bare * 1e3:.3f} ms | {(full - bare) * 1e6:.0f} us |")
    lines += [
        "",
        "## Guard lines of a compiled forward, (64, 128) float32",
        "",
        "| op | distgrad | funcol | distgrad / funcol |",
        "|---|---|---|---|",
    ]
    for op, (ours, theirs) in results[0]["guards"].items():
        lines.append(f"| {op} | {ours} | {theirs} | {ours / theirs:.2f} |")
    lines += [
        "",
        "## Bytes saved for the backward, (256, 64) float32 per rank",
        "",
        "| loss | eager | compiled | compiled / eager |",
        "|---|---|---|---|",
    ]
    for name, (eager, compiled) in results[0]["ring"].items():
        lines.append(f"| {name} | {eager} | {compiled} | {compiled / eager:.2f} |")
    text = "\n".join(lines) + "\n"
    args.output.write_text(text)
    print(text)


if __name__ == "__main__":
    main()
