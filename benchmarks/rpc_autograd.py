"""Distributed autograd over RPC: distgrad (FAST, SMART) against torch.distributed.autograd.

All variants run in the same RPC group, interleaved round-robin in shuffled order, so they
share the machine's noise. One iteration is what a user pays per training step: open a
context, make the RPCs, compute a loss, run the distributed backward, leave the context
(which releases it on every worker it touched).

Workloads:

* add, 2 workers: ``rpc_sync`` of ``torch.add`` on two tensors requiring grad (3x3, 1000x1000),
  loss ``sum``. Issue 13's targets compare with torch's engine driving the same round trip with
  a Python function (the next variant): FAST within 1.10x, SMART within 1.4x.
* chain, 4 workers: worker0 -> worker1 -> worker2 -> worker3, each hop one op, 3x3.
* add, torch with a Python function: torch's engine on the same round trip, with the remote
  call a Python function instead of the builtin ``torch.add`` (every distgrad call is a Python
  function on the callee): the honest comparison for an engine in Python, since users' remote
  calls are Python functions too.
* fan-out, 4 workers: worker0 calls each of the 3 others twice and uses only one result of
  each pair (half the RPC outputs unused), 3x3. torch's FAST engine waits forever for the
  unused sends' gradients, so it is not run there.

"messages / backward" counts every RPC distgrad's backward sends, summed over workers
(gradient messages plus SMART's lineage queries), not the context release; gradients that ride
back inside the answer to a gradient message (FAST) are not messages of their own. It is
counted in separate iterations, so that the counting RPCs stay out of the timed ones.

Run: ``python benchmarks/rpc_autograd.py [--quick] [--runs N]``; writes
``benchmarks/results/rpc_autograd.md`` (each run, then the median over runs of each paired
ratio, with its range).
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
import torch.distributed.autograd as torch_autograd
from torch.distributed import rpc as torch_rpc

import distgrad.rpc as dgrpc
from distgrad.testing import run_on_ranks

RESULTS = Path(__file__).resolve().parent / "results" / "rpc_autograd.md"
_COUNTED = 10  # iterations per distgrad variant in which messages are counted


def _torch_chain(x: torch.Tensor, hops: list[str]) -> torch.Tensor:
    if not hops:
        return x * 2.0
    return torch_rpc.rpc_sync(hops[0], _torch_chain, args=(torch.sin(x), hops[1:]))  # type: ignore[no-any-return]


def _dg_chain(x: torch.Tensor, hops: list[str]) -> torch.Tensor:
    if not hops:
        return x * 2.0
    return dgrpc.rpc_sync(hops[0], _dg_chain, args=(torch.sin(x), hops[1:]))


def _messages() -> int:
    state = dgrpc.debug_state()
    return state.get("gradient_messages_sent", 0) + state.get("lineage_messages_sent", 0)


def _total_messages(world_size: int) -> int:
    return sum(torch_rpc.rpc_sync(f"worker{w}", _messages) for w in range(world_size))


def _python_add(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return torch.add(a, b)


def _step_torch(workload: str, a: torch.Tensor, b: torch.Tensor, add: Any = torch.add) -> None:
    with torch_autograd.context() as cid:
        if workload == "add":
            loss = torch_rpc.rpc_sync("worker1", add, args=(a, b)).sum()
        elif workload == "chain":
            loss = _torch_chain(a, ["worker1", "worker2", "worker3"]).sum()
        else:
            raise AssertionError(workload)
        torch_autograd.backward(cid, [loss])
        torch_autograd.get_gradients(cid)


def _step_dg(mode: str, workload: str, a: torch.Tensor, b: torch.Tensor) -> None:
    with dgrpc.context() as cid:
        if workload == "add":
            loss = dgrpc.rpc_sync("worker1", torch.add, args=(a, b)).sum()
        elif workload == "chain":
            loss = _dg_chain(a, ["worker1", "worker2", "worker3"]).sum()
        else:  # fan-out: of each pair of calls to a worker, only the first result is used
            used = []
            for w in ("worker1", "worker2", "worker3"):
                used.append(dgrpc.rpc_sync(w, torch.mul, args=(a, b)))
                dgrpc.rpc_sync(w, torch.add, args=(a, b))
            loss = sum(u.sum() for u in used)  # type: ignore[assignment]
        dgrpc.backward(cid, [loss], mode=mode)
        dgrpc.get_gradients(cid)


def _bench(rank: int, world_size: int, cases: list[tuple[str, int, int]]) -> list[dict[str, Any]]:
    if rank != 0:
        return []
    rows = []
    for workload, n, iters in cases:
        g = torch.Generator().manual_seed(0)
        a = torch.rand(n, n, generator=g, requires_grad=True)
        b = torch.rand(n, n, generator=g, requires_grad=True)
        variants: dict[str, Callable[[], None]] = {
            "distgrad FAST": lambda w=workload, a=a, b=b: _step_dg("fast", w, a, b),
            "distgrad SMART": lambda w=workload, a=a, b=b: _step_dg("smart", w, a, b),
        }
        if workload != "fanout":
            variants["torch.distributed.autograd"] = lambda w=workload, a=a, b=b: _step_torch(
                w, a, b
            )
        if workload == "add":
            # torch's C++ engine, but the remote call is a Python function (as every distgrad
            # call is) instead of the builtin torch.add: what the Python call alone costs.
            variants["torch.distributed.autograd, Python function"] = lambda w=workload, a=a, b=b: (
                _step_torch(w, a, b, _python_add)
            )
        times: dict[str, list[float]] = {name: [] for name in variants}
        for fn in variants.values():  # warm up
            for _ in range(3):
                fn()
        order = list(variants)
        for _ in range(iters):
            random.shuffle(order)
            for name in order:
                start = time.perf_counter()
                variants[name]()
                times[name].append(time.perf_counter() - start)
        # Messages are counted in iterations of their own: the counting RPCs stay out of the
        # timed ones.
        messages: dict[str, float] = {}
        for name in variants:
            if name.startswith("distgrad"):
                before = _total_messages(world_size)
                for _ in range(_COUNTED):
                    variants[name]()
                messages[name] = (_total_messages(world_size) - before) / _COUNTED
        for name in variants:
            rows.append(
                {
                    "workload": workload,
                    "shape": f"{n}x{n}",
                    "workers": world_size,
                    "variant": name,
                    "median_ms": statistics.median(times[name]) * 1e3,
                    "ratio": _paired(times, name, "torch.distributed.autograd"),
                    "ratio_py": _paired(times, name, TORCH_PY),
                    "messages": messages.get(name),
                    "iters": iters,
                }
            )
    return rows


TORCH_PY = "torch.distributed.autograd, Python function"


def _paired(times: dict[str, list[float]], name: str, base: str) -> float:
    """Median over rounds of the variant's time over ``base``'s time in the same round, so
    that a slow stretch of the machine slows both sides of the ratio (NaN without ``base``)."""
    if base not in times:
        return float("nan")
    return statistics.median(t / b for t, b in zip(times[name], times[base], strict=True))


def _ratio(value: float) -> str:
    return "" if value != value else f"{value:.2f}x"


def _table(rows: list[dict[str, Any]]) -> str:
    lines = [
        "| workload | shape | workers | variant | median ms / iteration | "
        "ratio to torch (paired median) | ratio to torch, Python function | messages / backward |",
        "|---|---|---|---|---:|---:|---:|---:|",
    ]
    for r in rows:
        ratio = "n/a (torch hangs)" if r["ratio"] != r["ratio"] else f"{r['ratio']:.2f}x"
        msgs = "" if r["messages"] is None else f"{r['messages']:.1f}"
        lines.append(
            f"| {r['workload']} | {r['shape']} | {r['workers']} | {r['variant']} | "
            f"{r['median_ms']:.2f} | {ratio} | {_ratio(r['ratio_py'])} | {msgs} |"
        )
    return "\n".join(lines)


def _summary(runs: list[list[dict[str, Any]]]) -> str:
    """Per row: the median over runs of each paired ratio, and its range over the runs."""
    lines = [
        "| workload | shape | variant | ratio to torch: median (range) | "
        "ratio to torch, Python function: median (range) |",
        "|---|---|---|---:|---:|",
    ]
    for i, first in enumerate(runs[0]):
        if first["variant"].startswith("torch"):
            continue
        cells = []
        for key in ("ratio", "ratio_py"):
            values = [run[i][key] for run in runs]
            if any(v != v for v in values):
                cells.append("n/a")
            else:
                cells.append(
                    f"{statistics.median(values):.2f}x ({min(values):.2f}-{max(values):.2f})"
                )
        lines.append(
            f"| {first['workload']} | {first['shape']} | {first['variant']} | "
            f"{cells[0]} | {cells[1]} |"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="few iterations, no results file")
    parser.add_argument("--runs", type=int, default=3, help="independent runs (fresh workers)")
    args = parser.parse_args()
    scale = 0.1 if args.quick else 1.0
    two = [("add", 3, int(500 * scale)), ("add", 1000, int(200 * scale))]
    four = [("chain", 3, int(200 * scale)), ("fanout", 3, int(200 * scale))]
    sections = []
    runs = []
    for run in range(1 if args.quick else args.runs):
        load = os.getloadavg()[0]
        rows = run_on_ranks(_bench, 2, args=(two,), init="rpc", timeout=600)[0]
        rows += run_on_ranks(_bench, 4, args=(four,), init="rpc", timeout=600)[0]
        runs.append(rows)
        table = _table(rows)
        print(table, flush=True)
        sections.append(
            f"## Run {run + 1} (1-minute load average {load:.1f} before it)\n\n{table}\n"
        )
    if args.quick:
        return
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    header = (
        f"# Distributed autograd over RPC: distgrad vs torch.distributed.autograd\n\n"
        f"Measured {datetime.date.today()} on {platform.machine()}, {os.cpu_count()} CPU cores, "
        f"torch {torch.__version__}, TensorPipe over loopback TCP; one process per worker, "
        f"one intra-op thread each; {args.runs} independent runs of "
        f"`python benchmarks/rpc_autograd.py`. In each run every variant runs once per round, "
        f"in a shuffled order, for the rounds given in the script; the ratio is the median over "
        f"rounds of the variant's time over torch's time in the same round.\n\n"
    )
    summary = f"## Summary over the {args.runs} runs\n\n{_summary(runs)}\n\n"
    print(summary, flush=True)
    RESULTS.write_text(header + summary + "\n".join(sections))


if __name__ == "__main__":
    main()
