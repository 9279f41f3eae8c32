"""What ``async_op=True`` buys: a training step of computation and communication, blocking
against async, on the same gloo ranks in paired rounds.

    python benchmarks/overlap.py               # 2 ranks, 2 scenarios x 3 sizes, 40 rounds (~15 min)
    python benchmarks/overlap.py --rounds 5    # a quick run

The step, per rank (float32, one thread per rank):

    c1 = compute(w1)                      # created before the exchange...
    y  = dg.all_gather(x, sizes=...)      # ...blocking, or async_op=True
    c2 = compute(w2)                      # ...and after it
    loss = (y * v).sum() + c1.sum() + c2.sum()
    loss.backward()

``compute`` is a chain of ``tanh(h @ w)`` on [256, 256] matrices; each of ``c1`` and ``c2`` is
as long as half the exchange's forward+backward alone (measured at the start of the run).
With ``async_op=True`` the forward's exchange runs under ``c2``; in the backward the engine
runs ``c2``'s nodes first (created last), then the all_gather's backward starts its
reduce-scatter and returns, and ``c1``'s backward runs under it until ``x``'s gradient is
accumulated (``AccumulateGrad`` waits). The blocking step waits both times. Two scenarios:

* **balanced**: every rank computes the same before and after the exchange;
* **skewed**: rank 0 does all of its computation before the exchange (``c1`` twice as long,
  no ``c2``) and the last rank all of it after, so every rank computes as much in all, but
  rank 0 reaches the forward's exchange late and the last rank the backward's (its ``c2``
  backward runs first), as ranks with uneven batches or a data loader's jitter do. A blocking
  rank waits for the late one; an async one computes meanwhile;
* **off-CPU**: balanced, but ``compute`` keeps the rank busy without its CPU: forward and
  backward each sleep as long as the matmul chain takes. That is how a GPU step looks to the
  host (kernels run on the device while the CPU waits), and it isolates what async buys from
  this machine's shortage of cores.

Variants, timed from a barrier to a barrier after the backward (the slower rank's time):
**blocking**, **async**, **compute only** (the same step without the exchange) and
**exchange only** (the all_gather forward+backward alone). Each round runs them in a shuffled
order (the same on every rank); a cell is the median over rounds. The ratio async / blocking
is paired per round. "Saved / exchange only" is what the async step saves over the blocking
one, as a share of the exchange's own time: (blocking - async) / exchange only (above 100%
when it also saves the wait for a late peer).

On this machine the ranks share 2 cores with gloo's threads, which do the copying and the
socket work of the exchange: overlap can only hide the time the exchange waits, not the CPU it
needs. On NCCL the exchange runs on the GPU's copy engines and NVLink, on a stream of its own,
and the same step overlaps as far as the GPU's kernels leave bandwidth (not measured here).
"""

from __future__ import annotations

import argparse
import random
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist
from torch import Tensor

import distgrad as dg
from distgrad.testing import run_on_ranks

SIZES_KB = (256, 1024, 4096)  # per rank, float32
VARIANTS = ("blocking", "async", "compute only", "exchange only")


def _timed(step: Callable[[], None]) -> float:
    dist.barrier()
    start = time.perf_counter()
    step()
    dist.barrier()
    return time.perf_counter() - start


class _OffCpu(torch.autograd.Function):
    """``w``, after ``seconds`` of sleep in the forward and again in the backward."""

    @staticmethod
    def forward(ctx, w: Tensor, seconds: float) -> Tensor:  # type: ignore[no-untyped-def]
        ctx.seconds = seconds
        time.sleep(seconds)
        return w.clone()

    @staticmethod
    def backward(ctx, grad: Tensor):  # type: ignore[no-untyped-def]
        time.sleep(ctx.seconds)
        return grad, None


def _rank(rank: int, n: int, size_kb: int, rounds: int, scenario: str) -> dict[str, object]:
    torch.set_num_threads(1)
    gen = torch.Generator().manual_seed(rank)
    rows = size_kb * 1024 // 4 // 256
    x = torch.randn(rows, 256, generator=gen, requires_grad=True)
    v = torch.randn(rows * n, 256, generator=gen)
    w1 = (torch.randn(256, 256, generator=gen) / 16).requires_grad_()
    w2 = (torch.randn(256, 256, generator=gen) / 16).requires_grad_()
    sizes = [rows] * n
    for _ in range(5):  # past the checked calls, warm
        dg.all_gather(x, sizes=sizes).sum().backward()

    def exchange_only() -> None:
        (dg.all_gather(x, sizes=sizes) * v).sum().backward()

    # Two computes, each as long as half the exchange's forward+backward alone.
    exchange_s = statistics.median(_timed(exchange_only) for _ in range(10))
    one = statistics.median(_timed(lambda: (w1 @ w1).sum().backward()) for _ in range(10))
    shared = torch.tensor([max(1, round(exchange_s / 2 / one)), exchange_s], dtype=torch.float64)
    dist.broadcast(shared, 0)  # the same on every rank: rank 0's
    links, exchange_s = int(shared[0]), float(shared[1])

    # Skewed: rank 0 computes everything before the exchange, the last rank everything after.
    before, after = links, links
    if scenario == "skewed" and rank in (0, n - 1):
        before, after = (2 * links, 0) if rank == 0 else (0, 2 * links)

    def compute(w: Tensor, length: int) -> Tensor:
        if scenario == "off-CPU":
            # Forward and backward of c1 and c2 together as long as the exchange alone.
            return _OffCpu.apply(w, exchange_s / 4 * length / links)
        h = w
        for _ in range(length):
            h = torch.tanh(h @ w)
        return h

    def step(async_op: bool | None) -> None:
        c1 = compute(w1, before)
        y = None if async_op is None else dg.all_gather(x, sizes=sizes, async_op=async_op)
        c2 = compute(w2, after)
        loss = c1.sum() + c2.sum()
        if y is not None:
            loss = loss + (y * v).sum()
        loss.backward()

    runs: dict[str, Callable[[], None]] = {
        "blocking": lambda: step(False),
        "async": lambda: step(True),
        "compute only": lambda: step(None),
        "exchange only": exchange_only,
    }
    for run in runs.values():
        run()
    order = random.Random(0)
    times: dict[str, list[float]] = {name: [] for name in runs}
    for _ in range(rounds):
        names = list(runs)
        order.shuffle(names)
        for name in names:
            times[name].append(_timed(runs[name]))
    return {"times": times, "links": links}


def _probe(rank: int, n: int, rounds: int) -> dict[float, tuple[float, float, float]]:
    """The wait at first use of a 4 MB async all_gather (and of its backward's gradient) after
    ``gap`` seconds of sleep, against the blocking forward and backward: medians in ms."""
    torch.set_num_threads(1)
    x = torch.randn(4096, 256, requires_grad=True)
    v = torch.randn(4096 * n, 256)
    sizes = [4096] * n
    for _ in range(5):
        dg.all_gather(x, sizes=sizes).sum().backward()
    found: dict[float, tuple[float, float, float]] = {}
    for gap in (0.0, 0.003, 0.006, 0.012):
        calls, forward, backward = [], [], []
        for _ in range(rounds):
            dist.barrier()
            start = time.perf_counter()
            y = dg.all_gather(x, sizes=sizes, async_op=True)
            calls.append(time.perf_counter() - start)
            time.sleep(gap)
            start = time.perf_counter()
            y = y.wait()
            forward.append(time.perf_counter() - start)
            (grad,) = torch.autograd.grad((y * v).sum(), x)
            time.sleep(gap)
            start = time.perf_counter()
            grad.wait()
            backward.append(time.perf_counter() - start)
        found[gap] = tuple(statistics.median(t) * 1e3 for t in (calls, forward, backward))  # type: ignore[assignment]
    blocking_forward, blocking_backward = [], []
    for _ in range(rounds):
        dist.barrier()
        start = time.perf_counter()
        y = dg.all_gather(x, sizes=sizes)
        middle = time.perf_counter()
        torch.autograd.grad((y * v).sum(), x)
        blocking_forward.append(middle - start)
        blocking_backward.append(time.perf_counter() - middle)
    found[-1.0] = (
        0.0,
        statistics.median(blocking_forward) * 1e3,
        statistics.median(blocking_backward) * 1e3,
    )
    return found


def _row(scenario: str, size_kb: int, found: dict[str, object]) -> str:
    times: dict[str, list[float]] = found["times"]  # type: ignore[assignment]
    med = {name: statistics.median(t) * 1e3 for name, t in times.items()}
    paired = statistics.median(
        a / b for a, b in zip(times["async"], times["blocking"], strict=True)
    )
    hidden = (med["blocking"] - med["async"]) / med["exchange only"]
    cells = [f"{med[name]:.2f}" for name in VARIANTS]
    return (
        f"| {scenario} | {size_kb} KB | {found['links']} | "
        + " | ".join(cells)
        + f" | {paired:.2f}x | {hidden:.0%} |"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=40)
    parser.add_argument("--scenarios", default="balanced,skewed,off-CPU")
    parser.add_argument(
        "--output", type=Path, default=Path(__file__).parent / "results" / "overlap.md"
    )
    args = parser.parse_args()
    lines = [
        "# Overlap: async_op=True against the blocking call",
        "",
        f"`python benchmarks/overlap.py --world-size {args.world_size} --rounds {args.rounds}`, "
        f"{time.strftime('%Y-%m-%d')}, torch {torch.__version__}, {args.world_size} gloo ranks "
        "on this machine (2 cores), float32, one thread per rank. Times in ms per step "
        "(median over rounds; the slower rank's); the method is in the script's docstring.",
        "",
        "| scenario | all_gather per rank | links per compute | blocking | async "
        "| compute only | exchange only | async / blocking (paired) | saved / exchange only |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for scenario in [s for s in args.scenarios.split(",") if s]:
        for size_kb in SIZES_KB:
            found = run_on_ranks(
                _rank,
                args.world_size,
                args=(size_kb, args.rounds, scenario),
                timeout=1800,
            )
            lines.append(_row(scenario, size_kb, found[0]))
            print(lines[-1], flush=True)
    lines += [
        "",
        "## The wait at first use",
        "",
        "A 4 MB (per rank) all_gather with `async_op=True`, then `gap` ms of sleep, then its "
        "first use; then `torch.autograd.grad`, whose gradient (the backward's exchange, "
        "started by the engine) is used after the same sleep. Medians over rounds, rank 0, ms. "
        "The blocking row is the blocking call's forward and backward.",
        "",
        "| gap | the async call returns after | wait at first use, forward "
        "| wait at first use, gradient |",
        "|---|---|---|---|",
    ]
    probed = run_on_ranks(_probe, args.world_size, args=(args.rounds,), timeout=1800)[0]
    for gap, (call, forward, backward) in probed.items():
        name = "blocking" if gap < 0 else f"{gap * 1e3:.0f} ms"
        lines.append(f"| {name} | {call:.2f} | {forward:.2f} | {backward:.2f} |")
        print(lines[-1], flush=True)
    args.output.write_text("\n".join(lines) + "\n")
    print(f"wrote {args.output}")


if __name__ == "__main__":
    main()
