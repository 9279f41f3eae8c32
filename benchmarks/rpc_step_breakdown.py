"""Where one training step of a distributed backward spends its time: distgrad FAST against
torch.distributed.autograd, segment by segment.

The workload is ``benchmarks/rpc_autograd.py``'s round trip (2 workers: the root calls
``add`` on worker1 with two tensors requiring grad, loss ``sum``), at 3x3 and 1000x1000.
distgrad's step is compared with torch's engine driving the same call as a Python function,
the comparison issue 13's speed target uses.

Method: both workers wrap a few of distgrad's internal functions (and the function torch's
variant calls) so that they record ``time.perf_counter()`` when they start and end. On Linux
that clock is CLOCK_MONOTONIC, shared by every process on the machine, so the two workers'
timestamps line up. The variants run in the same processes, interleaved in a shuffled order;
each cell is the median over rounds of a segment's duration. The wrappers add a few
microseconds per mark, so the totals here run a little above ``rpc_autograd.py``'s.

Segments of a distgrad FAST step (worker1's in italics in the table):

1. root, until the request is handed to TensorPipe: the context, the send record, pickling;
2. the request in flight: TensorPipe, a thread of worker1's RPC pool, unpickling;
3. worker1 serves the call: the recv node, the function, the send record of its result;
4. the answer in flight and opened: pickling, TensorPipe, unpickling, the root's recv node;
5. root, until the gradient message is handed to TensorPipe: the loss, the argument checks,
   the engine up to the recv node, pickling the message;
6. the gradient message in flight;
7. worker1's part of the backward: its engine, its recv node, the reply;
8. the answer in flight, until the root's engine starts again;
9. the root's reply phase: its engine for the sent leaves, storing their gradients;
10. leaving the context.

torch's step has no marks inside its C++ backward: segments 1-2 are one, and 5-9 are one.

Run: ``python benchmarks/rpc_step_breakdown.py [--rounds N] [--runs N]``; writes
``benchmarks/results/rpc_step_breakdown.md`` (one table per run and shape: at 1000x1000 a run
can land in a regime where glibc's malloc hands freed memory back to the system every step,
and the step then page-faults; see benchmarks/README.md).
"""

from __future__ import annotations

import argparse
import datetime
import functools
import os
import platform
import random
import statistics
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed.autograd as torch_autograd
from torch.distributed import rpc as torch_rpc

import distgrad.rpc as dgrpc
from distgrad.rpc import _local, _transport, calls, fast
from distgrad.testing import run_on_ranks

RESULTS = Path(__file__).resolve().parent / "results" / "rpc_step_breakdown.md"

_events: list[tuple[str, float]] = []  # (mark, time.perf_counter()) on this worker


def _mark(name: str) -> None:
    _events.append((name, time.perf_counter()))


def _probe(module: Any, name: str, tag: str, main_thread_only: bool = False) -> None:
    """Replace ``module.name`` with a wrapper that marks ``tag<`` and ``tag>`` around it."""
    original = getattr(module, name)
    main = threading.main_thread()

    @functools.wraps(original)  # keeps the name, so that RPC pickles it by reference
    def probed(*args: Any, **kwargs: Any) -> Any:
        if main_thread_only and threading.current_thread() is not main:
            return original(*args, **kwargs)
        _mark(tag + "<")
        try:
            return original(*args, **kwargs)
        finally:
            _mark(tag + ">")

    setattr(module, name, probed)


def _install_probes() -> None:
    _probe(calls, "_serve_call", "serve")
    _probe(fast, "receive", "receive")
    _probe(_local, "run", "engine", main_thread_only=True)
    # The C++ call that hands a message to TensorPipe (the request, then the gradient message).
    _probe(_transport, "_invoke_rpc_python_udf", "send", main_thread_only=True)


def _python_add(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    _mark("udf<")
    try:
        return torch.add(a, b)
    finally:
        _mark("udf>")


def _step_dg(a: torch.Tensor, b: torch.Tensor) -> None:
    _mark("step<")
    with dgrpc.context() as cid:
        result = dgrpc.rpc_sync("worker1", torch.add, args=(a, b))
        _mark("forward>")
        dgrpc.backward(cid, [result.sum()])
        _mark("backward>")
        dgrpc.get_gradients(cid)
    _mark("step>")


def _step_torch(a: torch.Tensor, b: torch.Tensor) -> None:
    _mark("step<")
    with torch_autograd.context() as cid:
        result = torch_rpc.rpc_sync("worker1", _python_add, args=(a, b))
        _mark("forward>")
        torch_autograd.backward(cid, [result.sum()])
        _mark("backward>")
        torch_autograd.get_gradients(cid)
    _mark("step>")


def _worker_events() -> list[tuple[str, float]]:
    return list(_events)


# (segment, first mark, last mark); "@1" marks are worker1's, "#k" the k-th of a mark in a step
DG_SEGMENTS = [
    ("1. root, until the request is sent", "step<", "send<#0"),
    ("2. request in flight", "send<#0", "serve<@1"),
    ("3. *worker1 serves the call*", "serve<@1", "serve>@1"),
    ("4. answer in flight and opened", "serve>@1", "forward>"),
    ("5. root, until the gradient message is sent", "forward>", "send<#1"),
    ("6. gradient message in flight", "send<#1", "receive<@1"),
    ("7. *worker1's part of the backward*", "receive<@1", "receive>@1"),
    ("8. answer in flight", "receive>@1", "engine<#1"),
    ("9. root's reply phase", "engine<#1", "backward>"),
    ("10. leaving the context", "backward>", "step>"),
    ("forward (1-4)", "step<", "forward>"),
    ("backward (5-9)", "forward>", "backward>"),
    ("step", "step<", "step>"),
]
TORCH_SEGMENTS = {
    "1. root, until the request is sent": None,
    "2. request in flight": ("step<", "udf<@1"),
    "3. *worker1 serves the call*": ("udf<@1", "udf>@1"),
    "4. answer in flight and opened": ("udf>@1", "forward>"),
    "10. leaving the context": ("backward>", "step>"),
    "forward (1-4)": ("step<", "forward>"),
    "backward (5-9)": ("forward>", "backward>"),
    "step": ("step<", "step>"),
}


def _keyed(events: list[tuple[str, float]]) -> dict[str, float]:
    """A step's events by mark, the k-th occurrence of a repeated mark as ``mark#k``."""
    seen: dict[str, int] = {}
    out: dict[str, float] = {}
    for name, t in events:
        k = seen.get(name, 0)
        seen[name] = k + 1
        out[f"{name}#{k}"] = t
        out.setdefault(name, t)
    return out


def _bench(rank: int, world_size: int, n: int, rounds: int) -> dict[str, Any] | None:
    _install_probes()
    if rank != 0:
        return None
    g = torch.Generator().manual_seed(0)
    a = torch.rand(n, n, generator=g, requires_grad=True)
    b = torch.rand(n, n, generator=g, requires_grad=True)
    variants: dict[str, Callable[[], None]] = {
        "dg": lambda: _step_dg(a, b),
        "torch": lambda: _step_torch(a, b),
    }
    for fn in variants.values():  # warm up
        for _ in range(5):
            fn()
    _events.clear()
    spans: list[tuple[str, int, int]] = []  # (variant, first event, end) in _events
    order = list(variants)
    for _ in range(rounds):
        random.shuffle(order)
        for name in order:
            first = len(_events)
            variants[name]()
            spans.append((name, first, len(_events)))
    remote = torch_rpc.rpc_sync("worker1", _worker_events)
    durations: dict[str, dict[str, list[float]]] = {"dg": {}, "torch": {}}
    for name, first, end in spans:
        mine = _events[first:end]
        start, stop = mine[0][1], mine[-1][1]
        theirs = [(f"{m}@1", t) for m, t in remote if start <= t <= stop]
        marks = _keyed(sorted(mine + theirs, key=lambda e: e[1]))
        if name == "dg":
            cells = {seg: (first_m, last_m) for seg, first_m, last_m in DG_SEGMENTS}
        else:
            cells = {seg: span for seg, span in TORCH_SEGMENTS.items() if span is not None}
        for seg, (m0, m1) in cells.items():
            if m0 in marks and m1 in marks:
                durations[name].setdefault(seg, []).append(marks[m1] - marks[m0])
    return {
        variant: {seg: (statistics.median(v) * 1e3, len(v)) for seg, v in segs.items()}
        for variant, segs in durations.items()
    }


def _table(n: int, medians: dict[str, Any], rounds: int) -> str:
    lines = [
        f"### {n}x{n} ({rounds} rounds)",
        "",
        "| segment | distgrad FAST, ms | torch, Python function, ms |",
        "|---|---:|---:|",
    ]
    for seg, _, _ in DG_SEGMENTS:
        dg = medians["dg"].get(seg)
        tv = medians["torch"].get(seg)
        dg_cell = f"{dg[0]:.3f}" if dg else ""
        if seg in TORCH_SEGMENTS and TORCH_SEGMENTS[seg] is None:
            torch_cell = "(in 2)"
        elif tv:
            torch_cell = f"{tv[0]:.3f}"
        else:
            torch_cell = "(in backward)"
        lines.append(f"| {seg} | {dg_cell} | {torch_cell} |")
    return "\n".join(lines)


def _malloc_note() -> str:
    tuned = {k: v for k, v in os.environ.items() if k.startswith("MALLOC_")}
    if not tuned:
        return ""
    return ", with " + ", ".join(f"`{k}={v}`" for k, v in sorted(tuned.items()))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=400, help="rounds at 3x3 (1000x1000: 2/5)")
    parser.add_argument("--runs", type=int, default=3, help="independent runs (fresh workers)")
    args = parser.parse_args()
    sections = []
    for run in range(args.runs):
        sections.append(f"## Run {run + 1} (1-minute load average {os.getloadavg()[0]:.1f})")
        for n, rounds in ((3, args.rounds), (1000, max(1, args.rounds * 2 // 5))):
            medians = run_on_ranks(_bench, 2, args=(n, rounds), init="rpc", timeout=900)[0]
            table = _table(n, medians, rounds)
            print(table, flush=True)
            sections.append(table)
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    header = (
        "# One distributed backward step, segment by segment: distgrad FAST vs torch\n\n"
        f"Measured {datetime.date.today()} on {platform.machine()}, {os.cpu_count()} CPU cores, "
        f"torch {torch.__version__}, TensorPipe over loopback TCP, 2 workers; "
        f"`python benchmarks/rpc_step_breakdown.py --rounds {args.rounds} --runs {args.runs}`"
        f"{_malloc_note()}. Medians over rounds of each segment (the script's docstring "
        "says what each one covers); segments do not add up to the totals exactly, as each "
        "row is its own median.\n\n"
    )
    RESULTS.write_text(header + "\n\n".join(sections) + "\n")


if __name__ == "__main__":
    main()
