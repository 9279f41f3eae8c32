"""Where a compiled step's CPU goes: distgrad eager, distgrad compiled and funcol compiled.

One forward+backward of a 32 KB all_gather (or, with ``--op all_to_all``, all_to_all) per rank
(float32, (64, 128)) on 2 gloo ranks, past
distgrad's checked calls. For each variant: the calling thread's CPU time per step over
``--steps`` steps, then the same steps under ``cProfile`` on the thread's CPU clock, each
function's own time put in one bucket by its file (dynamo, AOTAutograd, inductor's code, custom
op dispatch, distgrad's exchange, c10d, the autograd engine, tensor operations, other). The
profile's shares are of the profiled time (the profiler slows small calls more than large
ones: read them as proportions, not microseconds).

Run: ``python benchmarks/compile_breakdown.py [--steps 300] [--op all_to_all]``; writes
``benchmarks/results/compile_breakdown.md`` (all_gather) or ``compile_breakdown_<op>.md``.
"""

from __future__ import annotations

import argparse
import collections
import cProfile
import datetime
import pstats
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol

import distgrad as dg
from distgrad.collectives._signature import CHECKED_CALLS
from distgrad.testing import run_on_ranks

RESULTS = Path(__file__).parent / "results" / "compile_breakdown.md"
ROWS, COLUMNS = 64, 128

# Buckets by the profiled function's file (or a builtin's name); the first match wins.
BUCKETS = [
    ("dynamo frame and guards", ("_dynamo/",)),
    ("AOTAutograd runtime wrappers", ("_aot_autograd", "_functorch")),
    ("inductor's compiled code", ("_inductor", "torchinductor_")),
    ("op dispatch", ("torch/_ops.py", "torch/_library")),
    ("distgrad's exchange (_exchange)", ("distgrad/_exchange",)),
    ("c10d calls", ("distributed_c10d", "_distributed_c10d", "ProcessGroup")),
    ("autograd engine and backward()", ("torch/autograd/", "run_backward")),
    ("tensor operations", ("TensorBase", "_VariableFunctions", "built-in method torch.")),
]


def _bucket(where: str) -> str:
    for name, keys in BUCKETS:
        if any(key in where for key in keys):
            return name
    return "other"


def _measure(rank: int, world_size: int, steps: int, op: str) -> dict[str, Any]:
    warnings.filterwarnings("ignore")
    torch._inductor.config.compile_threads = 1
    for _ in range(CHECKED_CALLS):
        dg.all_reduce(torch.zeros(1))
    world = dist.group.WORLD
    assert world is not None
    x = torch.randn(ROWS, COLUMNS, requires_grad=True)
    sizes = [ROWS] * world_size
    split = [ROWS // world_size] * world_size
    v = torch.randn(ROWS * world_size if op == "all_gather" else ROWS, COLUMNS)

    def ours(x: torch.Tensor) -> torch.Tensor:
        if op == "all_to_all":
            return dg.all_to_all(x, input_sizes=split, output_sizes=split)
        return dg.all_gather(x, sizes=sizes)

    def theirs(x: torch.Tensor) -> torch.Tensor:
        if op == "all_to_all":
            return funcol.all_to_all_single_autograd(x, None, None, world)
        return funcol.all_gather_tensor_autograd(x, 0, world)

    variants: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
        "distgrad eager": ours,
        "distgrad compiled": torch.compile(ours, fullgraph=True, dynamic=False),
        "funcol compiled": torch.compile(theirs, fullgraph=True, dynamic=False),
    }

    def step(fn: Callable[[torch.Tensor], torch.Tensor]) -> None:
        out = fn(x)
        float(out[0, 0])  # funcol's result waits for its data when read
        out.backward(v)  # type: ignore[no-untyped-call]
        x.grad = None

    found: dict[str, Any] = {}
    for name, fn in variants.items():
        for _ in range(10):  # warm-up and compilation
            step(fn)
        dist.barrier()
        start = time.thread_time()
        for _ in range(steps):
            step(fn)
        cpu = (time.thread_time() - start) / steps
        profile = cProfile.Profile(time.thread_time)
        profile.enable()
        for _ in range(steps):
            step(fn)
        profile.disable()
        own: collections.Counter[str] = collections.Counter()
        for (file, _, function), row in pstats.Stats(profile).stats.items():  # type: ignore[attr-defined]
            own[_bucket(f"{file}:{function}")] += row[2]
        total = sum(own.values())
        found[name] = {"cpu": cpu, "shares": {k: t / total for k, t in own.items()}}
    return found


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--op", choices=("all_gather", "all_to_all"), default="all_gather")
    args = parser.parse_args()
    results = run_on_ranks(_measure, 2, args=(args.steps, args.op), timeout=900)[0]
    out = (
        RESULTS if args.op == "all_gather" else RESULTS.with_name(f"compile_breakdown_{args.op}.md")
    )
    names = list(results)
    buckets = [name for name, _ in BUCKETS] + ["other"]
    lines = [
        f"# Where a compiled step's CPU goes (2 gloo ranks, 32 KB {args.op}, forward+backward)",
        "",
        f"Measured {datetime.date.today()} with torch {torch.__version__} by "
        f"`python benchmarks/compile_breakdown.py --steps {args.steps} --op {args.op}` (rank 0's "
        "calling "
        "thread). CPU per step is measured without the profiler; the shares come from a second "
        "pass under cProfile on the thread's CPU clock (see the script's docstring).",
        "",
        "| | " + " | ".join(names) + " |",
        "|---" * (len(names) + 1) + "|",
        "| CPU per step | " + " | ".join(f"{results[n]['cpu'] * 1e6:.0f} us" for n in names) + " |",
    ]
    for bucket in buckets:
        shares = [results[n]["shares"].get(bucket, 0.0) for n in names]
        lines.append(f"| {bucket} | " + " | ".join(f"{s:.0%}" for s in shares) + " |")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
