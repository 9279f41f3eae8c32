"""What one call costs the calling thread, with the communication taken away.

torch's fake process group (``torch.testing._internal.distributed.fake_pg``: every collective
completes at once and moves nothing) stands in for the other rank, in one process. What is
left of a forward+backward is each library's own per-call work: its Python, its dispatch, its
autograd, and its tensor allocations. The times do not wander with a peer's scheduling as the
2-rank wall times of ``benchmarks/collectives.py`` do, so a change of a microsecond shows; what
they do not show is how that work is amplified on a loaded machine (on 2 shared cores a
microsecond here is 2-3 there, measured: distgrad's checks 1.7 us here, 5.6 us between
barriers on 2 gloo ranks).

Rows: every distgrad op at 32 KB per rank ((64, 128) float32, 2 "ranks", past the checked calls),
against the hand-written torch ``autograd.Function`` of ``benchmarks/collectives.py`` and, where
torch has the op, funcol's autograd collective; compiled (``torch.compile(fullgraph=True)``,
inductor) distgrad against compiled funcol, with the dynamo guards' share (the same forward with
``skip_guard_eval_unsafe``, which skips them). Each cell is the best of 7 repeats of 2,000 calls.

Run: ``python benchmarks/call_cost.py [--no-compile]``; writes ``benchmarks/results/call_cost.md``.
"""

from __future__ import annotations

import argparse
import datetime
import platform
import sys
import timeit
import warnings
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist
from torch.testing._internal.distributed.fake_pg import FakeStore

import distgrad as dg
from distgrad.collectives._signature import CHECKED_CALLS

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # for benchmarks.collectives

from benchmarks import collectives as bench

RESULTS = Path(__file__).parent / "results" / "call_cost.md"
ROWS = 64  # 32 KB of float32 at 128 columns
WORLD = 2
CALLS, REPEATS = 2000, 7

Fn = Callable[[torch.Tensor], torch.Tensor]


def _best_us(fn: Callable[[], object]) -> float:
    for _ in range(50):  # warm: lazily made state is made, compilation done
        fn()
    return min(timeit.repeat(fn, number=CALLS, repeat=REPEATS)) / CALLS * 1e6


def _step(fn: Fn, x: torch.Tensor) -> Callable[[], object]:
    def step() -> None:
        x.grad = None
        out = fn(x)
        out.backward(torch.ones_like(out))  # type: ignore[no-untyped-call]

    return step


def _eager_rows() -> list[str]:
    rows = [
        "| op | torch Function | distgrad | distgrad - torch | funcol |",
        "|---|---|---|---|---|",
    ]
    for op in bench.OPS:
        x = bench._input(op, ROWS, 0)
        theirs = _best_us(_step(lambda t, op=op: bench._TorchCollective.apply(t, op), x))
        ours_fn = bench._distgrad(op, WORLD)
        assert ours_fn is not None
        ours = _best_us(_step(ours_fn, x))
        other = bench._funcol(op, WORLD)
        cell = f"{_best_us(_step(other, x)):.1f} us" if other is not None else ""
        rows.append(
            f"| {op} | {theirs:.1f} us | {ours:.1f} us | {ours - theirs:+.1f} us | {cell} |"
        )
        print(rows[-1], flush=True)
    return rows


def _compiled_rows() -> list[str]:
    rows = [
        "| op | distgrad compiled | funcol compiled | distgrad's guards | funcol's guards |",
        "|---|---|---|---|---|",
    ]
    for op in bench.OPS:
        other = bench._funcol(op, WORLD)
        if other is None:
            continue
        x = bench._input(op, ROWS, 0)
        cells = []
        guards = []
        for fn in (bench._distgrad(op, WORLD), other):
            assert fn is not None
            compiled = torch.compile(fn, fullgraph=True, dynamic=False)
            cells.append(_best_us(_step(compiled, x)))
            forward = _best_us(lambda compiled=compiled, x=x: compiled(x))
            with torch.compiler.set_stance("default", skip_guard_eval_unsafe=True):
                guards.append(forward - _best_us(lambda compiled=compiled, x=x: compiled(x)))
        rows.append(
            f"| {op} | {cells[0]:.1f} us | {cells[1]:.1f} us | {guards[0]:.1f} us | "
            f"{guards[1]:.1f} us |"
        )
        print(rows[-1], flush=True)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--no-compile", action="store_true", help="leave out compiled rows")
    parser.add_argument("--output", type=Path, default=RESULTS)
    args = parser.parse_args()
    warnings.filterwarnings("ignore")  # torch.distributed.nn and old names warn on every call
    torch.set_num_threads(1)
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=WORLD)
    try:
        for _ in range(CHECKED_CALLS):  # past the calls distgrad checks across ranks
            dg.all_reduce(torch.zeros(1))
        eager = _eager_rows()
        compiled = [] if args.no_compile else _compiled_rows()
    finally:
        dist.destroy_process_group()
    body = [
        "# What one call costs the calling thread, communication taken away",
        "",
        f"Measured {datetime.date.today()} on {platform.machine()}, torch {torch.__version__}, "
        f"by `python benchmarks/call_cost.py{' --no-compile' if args.no_compile else ''}`: "
        "torch's fake process group (every collective completes at once), 2 ranks, "
        f"(64, 128) float32, forward+backward, best of {REPEATS} x {CALLS} calls "
        "(the script's docstring says what this shows and what it does not).",
        "",
        "## Eager",
        "",
        *eager,
        "",
    ]
    if compiled:
        body += [
            "## Compiled (fullgraph, inductor)",
            "",
            "Guards: a forward's time less the same forward with `skip_guard_eval_unsafe`.",
            "",
            *compiled,
            "",
        ]
    args.output.write_text("\n".join(body))
    print(f"wrote {args.output}")


if __name__ == "__main__":
    main()
