"""What a pipeline boundary costs: one microbatch's activation forward and its gradient back,
distgrad's point-to-point autograd against the leanest hand-written torch code.

Two gloo ranks on one machine are two stages of a pipeline; each step runs ``MICROBATCHES``
microbatches, each one forward (stage 0 sends its activation, stage 1 receives it) and one
backward (stage 1 sends the activation's gradient back, stage 0 receives it and runs its
graph from it). The stages compute almost nothing (an elementwise product with one weight), so
the time is the transfers' and the library's. Variants, interleaved in a shuffled order each
round in the same two processes:

* **torch by hand** (the baseline): what torch's ``PipelineStage`` does, written out:
  ``dist.isend`` of the activation, ``dist.recv`` into a buffer the receiver allocates,
  ``requires_grad_()``, the local backward, ``dist.isend`` of ``h.grad`` back, and on stage 0
  ``dist.recv`` of the gradient and ``out.backward(grad)``; every send waited for.
* **distgrad**: ``dg.pipeline.isend``/``recv`` in a context, ``dg.pipeline.backward`` per
  microbatch, shapes given (``recv(shape=, dtype=)``), past the first 8 checked transfers:
  the training-loop path, data only.

Each cell is the median over rounds of the paired ratio distgrad / torch (the slower rank's
time for the step, barrier to barrier), per microbatch per boundary; three runs give a range.

Run: ``python benchmarks/pipeline.py [--runs 3] [--quick]``; writes
``benchmarks/results/pipeline.md`` (or ``--output``).
"""

from __future__ import annotations

import argparse
import datetime
import functools
import os
import platform
import random
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist

import distgrad.pipeline as dgp
from distgrad.testing import run_on_ranks

SIZES = {"32 KB": (64, 128), "1 MB": (2048, 128)}  # float32 activations per microbatch
ROUNDS = {"32 KB": 200, "1 MB": 40}
MICROBATCHES = 4
RESULTS = Path(__file__).parent / "results" / "pipeline.md"
VARIANTS = ["torch by hand", "distgrad"]


def _torch_step(rank: int, x: torch.Tensor, w: torch.Tensor) -> None:
    shape = x.shape
    for _m in range(MICROBATCHES):
        if rank == 0:
            out = x * w
            dist.isend(out.detach(), 1).wait()
            grad = torch.empty(shape)
            dist.recv(grad, 1)
            out.backward(grad)
        else:
            h = torch.empty(shape)
            dist.recv(h, 0)
            h.requires_grad_()
            (h * w).sum().backward()
            assert h.grad is not None
            dist.isend(h.grad, 0).wait()


def _distgrad_step(rank: int, x: torch.Tensor, w: torch.Tensor, check: bool = False) -> None:
    with dgp.context(check=check) as cid:
        for m in range(MICROBATCHES):
            if rank == 0:
                dgp.isend(x * w, 1, microbatch=m)
                dgp.backward(cid, microbatch=m)
            else:
                h = dgp.recv(0, shape=x.shape, dtype=x.dtype, microbatch=m)
                dgp.backward(cid, [(h * w).sum()], microbatch=m)


STEPS: dict[str, Callable[[int, torch.Tensor, torch.Tensor], None]] = {
    "torch by hand": _torch_step,
    "distgrad": _distgrad_step,
}


def _timed(step: Callable[[], None]) -> float:
    dist.barrier()
    start = time.perf_counter()
    step()
    elapsed = torch.tensor([time.perf_counter() - start], dtype=torch.float64)
    dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)  # the slower rank's time
    return float(elapsed.item())


def _measure(rank: int, world: int, quick: bool) -> dict[str, list[float]]:
    torch.set_num_threads(1)
    ratios: dict[str, list[float]] = {}
    order = random.Random(1)  # the same shuffle on both ranks
    for size, shape in SIZES.items():
        x = torch.randn(shape)
        w = torch.randn((), requires_grad=True)
        _distgrad_step(rank, x, w, check=True)  # the new shape announced
        for name in VARIANTS:  # warm up, and past distgrad's checked transfers
            for _ in range(10):
                STEPS[name](rank, x, w)
        rounds = ROUNDS[size] // (5 if quick else 1)
        found = []
        for _ in range(rounds):
            names = VARIANTS[:]
            order.shuffle(names)
            times = {n: _timed(functools.partial(STEPS[n], rank, x, w)) for n in names}
            found.append(times["distgrad"] / times["torch by hand"])
        ratios[size] = found
    return ratios


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--quick", action="store_true", help="a fifth of the rounds")
    parser.add_argument("--output", type=Path, default=RESULTS)
    args = parser.parse_args()
    medians: dict[str, list[float]] = {size: [] for size in SIZES}
    for _ in range(args.runs):
        per_rank = run_on_ranks(_measure, 2, args=(args.quick,), timeout=900)
        for size in SIZES:
            medians[size].append(statistics.median(per_rank[0][size]))
    load = os.getloadavg()[0]
    lines = [
        "# Pipeline boundary: distgrad's point-to-point autograd against torch by hand",
        "",
        f"Written by `python benchmarks/pipeline.py` on {datetime.date.today()}: "
        f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores, torch "
        f"{torch.__version__}, 2 gloo ranks over loopback, float32, {MICROBATCHES} "
        f"microbatches a step, load average {load:.1f} at the end. Each cell: distgrad's time "
        "over torch by hand's (the module docstring says what each does), the median over "
        f"rounds of the paired ratio, for {args.runs} runs (the range over runs, then each "
        "run's median).",
        "",
        "| activation per microbatch | distgrad / torch by hand | runs |",
        "|---|---|---|",
    ]
    for size, found in medians.items():
        runs = ", ".join(f"{r:.2f}x" for r in found)
        lines.append(f"| {size} | {min(found):.2f}x-{max(found):.2f}x | {runs} |")
    args.output.write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
