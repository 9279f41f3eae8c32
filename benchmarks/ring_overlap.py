"""Every ring loop of distgrad against hand-written loops of the same compute and shifts:
does the one ring driver (``distgrad._exchange.ring``) overlap its shifts with compute?

    python benchmarks/ring_overlap.py                 # 2 and 4 ranks, 1 MB and 4 MB shifts
    python benchmarks/ring_overlap.py --quick         # a check that it runs (seconds)

The six loops: the ring losses' forward and backward (``kind="lse"``: InfoNCE, NT-Xent; the
softplus ring of SigLIP is the same loop), CLIP's ring forward and backward (an accumulator
travels in both), and ring attention's forward and backward. For each, on W gloo ranks of
this machine (one thread each), one loop is timed in four forms, in the same processes:

* **distgrad**: the loop as the library runs it now (the driver);
* **before**: the same loop as it was before the driver (the losses' bidirectional ring and
  ring attention's shift-then-compute), read from git at ``--before`` (default: the commit
  the driver was built on) and loaded by path; "not run" where git cannot give it;
* **overlapped**: a hand-written loop with the same compute (the library's own block
  functions) and raw ``torch.distributed.batch_isend_irecv``, each block's shift started
  before the compute it overlaps, and each accumulator's started after its compute and waited
  for after the next (torch context parallel's order): the target;
* **serial**: the same hand-written loop with each shift waited for before computing (the
  block and its accumulator in one message after the compute).

Sizes: ``--mb`` the bytes of one block on the wire (a loss's keys [M, 512] float32: 1 MB is
M = 512 rows, and as many anchors; attention's keys and values [1, 4, S, 64 + 64]: 1 MB is
S = 512). Method: a warm-up of each form, then ``--rounds`` rounds, each running every form
once in an order shuffled per round (the same on every rank), a barrier before each, timed
until this rank's loop returns; a form's time in a round is the slowest rank's. Reported:
the median over rounds, and the median over rounds of each form's time over the overlapped
hand-written loop's in the same round. Timing: run it on a quiet machine (results in
results/ring_overlap.md).
"""

from __future__ import annotations

import argparse
import importlib.util
import math
import platform
import random
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from types import ModuleType
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from distgrad._exchange.group import resolve
from distgrad.losses import _blockwise as ring_losses
from distgrad.parallel import _ring_attention as ring_attn
from distgrad.testing import run_on_ranks

ROOT = Path(__file__).resolve().parents[1]
BEFORE = "a9f115f"  # the commit the driver was built on
DIM, HEADS, HEAD_DIM = 512, 4, 64
LOOPS = ("loss fwd", "loss bwd", "clip fwd", "clip bwd", "attention fwd", "attention bwd")
FORMS = ("distgrad", "before", "overlapped", "serial")
Loop = Callable[[], object]


def _load_before(rev: str, path: str, name: str) -> ModuleType | None:
    """The module at ``path`` as it was at ``rev``, loaded by path (None if git cannot)."""
    try:
        text = subprocess.run(
            ["git", "-C", str(ROOT), "show", f"{rev}:{path}"],
            capture_output=True,
            check=True,
            text=True,
        ).stdout
    except (OSError, subprocess.CalledProcessError):
        return None
    file = Path(tempfile.mkdtemp()) / f"{name}.py"
    file.write_text(text)
    spec = importlib.util.spec_from_file_location(name, file)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


# -- raw torch shifts ---------------------------------------------------------------------------


def _p2p(send: Tensor, recv: Tensor) -> list[Any]:
    """Send ``send`` to rank + 1 and receive ``recv`` from rank - 1, started."""
    rank, n = dist.get_rank(), dist.get_world_size()
    ops = [
        dist.P2POp(dist.isend, send.contiguous(), (rank + 1) % n),
        dist.P2POp(dist.irecv, recv, (rank - 1) % n),
    ]
    return dist.batch_isend_irecv(ops)


def _wait(works: list[Any]) -> None:
    for w in works:
        w.wait()


def _hand(
    own: Tensor,
    compute: Callable[[int, int, Tensor], Tensor | None],
    acc_like: Tensor | None,
    combine: Callable[[Tensor, Tensor], Tensor],
    overlapped: bool,
) -> Tensor | None:
    """A hand-written ring over equal blocks (``own``'s shape, accumulators ``acc_like``'s):
    overlapped (blocks ahead, accumulators behind) or serial (shift, wait, compute)."""
    rank, n = dist.get_rank(), dist.get_world_size()
    held, acc, pending = own, None, None
    for step in range(n):
        source = (rank - step) % n
        ahead = None
        if overlapped and step < n - 1:
            incoming = torch.empty_like(held)
            ahead = (_p2p(held, incoming), incoming)
        part = compute(step, source, held)
        if acc_like is not None:
            arrived: Tensor | None = acc  # serial: the accumulator that came with this block
            if pending is not None:
                _wait(pending[0])
                arrived = pending[1]
            if arrived is not None:
                acc = arrived if part is None else combine(arrived, part)
            else:
                acc = part if part is not None else torch.zeros_like(acc_like)
        if overlapped:
            if acc is not None:
                got = torch.empty_like(acc)
                pending = (_p2p(acc, got), got)
            if ahead is not None:
                _wait(ahead[0])
                held = ahead[1]
        elif step < n - 1 or acc is not None:  # serial: block and accumulator in one message
            msg = (
                held.reshape(-1) if acc is None else torch.cat([held.reshape(-1), acc.reshape(-1)])
            )
            got = torch.empty_like(msg)
            _wait(_p2p(msg, got))
            if acc is not None:
                acc = got[held.numel() :].view_as(acc)
            held = got[: held.numel()].view_as(held)
            pending = None
    if overlapped and pending is not None:
        _wait(pending[0])
        return pending[1]
    return acc


# -- the six loops --------------------------------------------------------------------------------


def _loss_loops(rows: int, clip: bool, before: ModuleType | None) -> dict[str, dict[str, Loop]]:
    g, n = resolve(None), dist.get_world_size()
    gen = torch.Generator().manual_seed(dist.get_rank())
    a, k = (torch.randn(rows, DIM, generator=gen) / DIM**0.5 for _ in range(2))
    s, b = torch.tensor(3.0), torch.tensor(0.0)
    sizes = (rows,) * n
    spec = ring_losses._Spec("lse", clip, False, rows)
    plan = ring_losses._Plan(g, sizes, spec)
    out, cols = ring_losses._forward(a, k, s, b, plan)
    g_out, g_cols = torch.randn(rows, generator=gen), torch.randn(rows, generator=gen)
    sums = (torch.zeros_like(a), torch.zeros_like(s), torch.zeros_like(b))

    def f_compute(step: int, source: int, held: Tensor) -> Tensor | None:
        o = a.new_full((rows,), -math.inf)
        return ring_losses._block_forward(a, held, s, b, plan, step == 0, o)

    blocks = torch.cat([k, cols[:, None], g_cols[:, None]], 1) if clip else k

    def b_compute(step: int, source: int, held: Tensor) -> Tensor:
        stats = (held[:, DIM], held[:, DIM + 1]) if clip else None
        keys = held[:, :DIM]
        return ring_losses._block_backward(
            a, keys, s, b, plan, step == 0, (out, g_out), stats, sums
        )

    name = "clip" if clip else "loss"
    fwd: dict[str, Loop] = {
        "distgrad": lambda: ring_losses._forward(a, k, s, b, plan),
        "overlapped": lambda: _hand(k, f_compute, cols if clip else None, torch.logaddexp, True),
        "serial": lambda: _hand(k, f_compute, cols if clip else None, torch.logaddexp, False),
    }
    bwd: dict[str, Loop] = {
        "distgrad": lambda: ring_losses._backward(a, k, s, b, out, cols, g_out, g_cols, plan),
        "overlapped": lambda: _hand(blocks, b_compute, k, torch.add, True),
        "serial": lambda: _hand(blocks, b_compute, k, torch.add, False),
    }
    if before is not None:
        old = before._Plan(g, sizes, rows, "lse", False)
        if clip:
            fwd["before"] = lambda: before._clip_forward(a, k, s, old)
            bwd["before"] = lambda: before._clip_backward(a, k, s, out, cols, g_out, g_cols, old)
        else:
            fwd["before"] = lambda: before._reduce_forward(a, k, s, b, old)
            bwd["before"] = lambda: before._reduce_backward(a, k, s, b, out, g_out, old)
    return {f"{name} fwd": fwd, f"{name} bwd": bwd}


def _attention_loops(seq: int, before: ModuleType | None) -> dict[str, dict[str, Loop]]:
    g, n = resolve(None), dist.get_world_size()
    gen = torch.Generator().manual_seed(dist.get_rank())
    q, k, v, dout = (torch.randn(1, HEADS, seq, HEAD_DIM, generator=gen) for _ in range(4))
    scale = HEAD_DIM**-0.5
    plan = ring_attn._Plan(g, (seq,) * n, False, scale)
    out, lse = ring_attn._forward(q, k, v, plan)
    kv = torch.cat([k, v], -1)

    def f_compute(step: int, source: int, held: Tensor) -> None:
        part, part_lse = ring_attn._block_forward(
            q, held[..., :HEAD_DIM], held[..., HEAD_DIM:], plan, source
        )
        new = torch.logaddexp(lse, part_lse)
        (out * torch.exp(lse - new)[..., None] + part * torch.exp(part_lse - new)[..., None])

    def b_compute(step: int, source: int, held: Tensor) -> Tensor:
        kb, vb = held[..., :HEAD_DIM], held[..., HEAD_DIM:]
        _, dkb, dvb = ring_attn._block_backward(q, kb, vb, out, lse, dout, plan, source)
        return torch.cat([dkb, dvb], -1)

    fwd: dict[str, Loop] = {
        "distgrad": lambda: ring_attn._forward(q, k, v, plan),
        "overlapped": lambda: _hand(kv, f_compute, None, torch.add, True),
        "serial": lambda: _hand(kv, f_compute, None, torch.add, False),
    }
    bwd: dict[str, Loop] = {
        "distgrad": lambda: ring_attn._backward(q, k, v, out, lse, dout, plan),
        "overlapped": lambda: _hand(kv, b_compute, kv, torch.add, True),
        "serial": lambda: _hand(kv, b_compute, kv, torch.add, False),
    }
    if before is not None:
        old = before._Plan(g, (seq,) * n, False, scale)
        fwd["before"] = lambda: before._forward(q, k, v, old)
        bwd["before"] = lambda: before._backward(q, k, v, out, lse, dout, old)
    return {"attention fwd": fwd, "attention bwd": bwd}


def _check(loops: dict[str, dict[str, Loop]]) -> None:
    """The hand-written loops compute what distgrad's do: the accumulators that come home
    (CLIP's column logsumexps, the keys' gradients) agree."""
    picks: dict[str, Callable[[Any], Tensor]] = {
        "loss bwd": lambda r: r[1],
        "clip fwd": lambda r: r[1],
        "clip bwd": lambda r: r[1],
        "attention bwd": lambda r: torch.cat([r[1], r[2]], -1),
    }
    for name, pick in picks.items():
        want = pick(loops[name]["distgrad"]())
        for form in ("overlapped", "serial"):
            got = loops[name][form]()
            assert isinstance(got, Tensor)
            torch.testing.assert_close(got, want, msg=f"{name}, {form}")


def _worker(rank: int, n: int, mb: float, rounds: int, rev: str) -> dict[str, dict[str, Any]]:
    torch.set_num_threads(1)
    old_losses = _load_before(rev, "src/distgrad/losses/_blockwise.py", "_before_blockwise")
    old_attn = _load_before(
        rev, "src/distgrad/parallel/_ring_attention.py", "_before_ring_attention"
    )
    rows = max(1, int(mb * 2**20 / (4 * DIM)))
    seq = max(1, int(mb * 2**20 / (4 * HEADS * 2 * HEAD_DIM)))
    loops = {
        **_loss_loops(rows, False, old_losses),
        **_loss_loops(rows, True, old_losses),
        **_attention_loops(seq, old_attn),
    }
    _check(loops)
    order = random.Random(7)
    times: dict[str, dict[str, list[float]]] = {name: {} for name in loops}
    every = [(name, form) for name in LOOPS for form in loops[name]]
    for r in range(rounds + 1):  # round 0: the warm-up
        order.shuffle(every)
        for name, form in every:
            dist.barrier()
            t0 = time.perf_counter()
            loops[name][form]()
            took = torch.tensor([time.perf_counter() - t0], dtype=torch.float64)
            dist.all_reduce(took, op=dist.ReduceOp.MAX)
            if r > 0:
                times[name].setdefault(form, []).append(float(took))
    summary: dict[str, dict[str, Any]] = {}
    for name in LOOPS:
        base = times[name]["overlapped"]
        summary[name] = {
            form: (
                statistics.median(times[name][form]),
                statistics.median(t / b for t, b in zip(times[name][form], base, strict=True)),
            )
            for form in times[name]
        }
    return summary


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--ranks", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--mb", type=float, nargs="+", default=[1.0, 4.0])
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--before", default=BEFORE, help="git revision of the loops before")
    parser.add_argument("--quick", action="store_true", help="2 ranks, tiny blocks, 2 rounds")
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks/results/ring_overlap.md")
    args = parser.parse_args()
    if args.quick:
        args.ranks, args.mb, args.rounds = [2], [0.02], 2
    lines = [
        f"torch {torch.__version__}, {platform.machine()}, gloo on 127.0.0.1, one thread per "
        f"rank, {args.rounds} rounds; before = {args.before}. Each cell: median ms of one loop "
        "(the slowest rank's), and in brackets the median paired ratio to the overlapped "
        "hand-written loop.",
        "",
        "| loop | ranks | block MB | " + " | ".join(FORMS) + " |",
        "|---|---|---|" + "---|" * len(FORMS),
    ]
    for n in args.ranks:
        for mb in args.mb:
            result = run_on_ranks(_worker, n, args=(mb, args.rounds, args.before), timeout=1800)[0]
            for name in LOOPS:
                cells = []
                for form in FORMS:
                    got = result[name].get(form)
                    cells.append(
                        "not run" if got is None else f"{got[0] * 1e3:.1f} ({got[1]:.2f}x)"
                    )
                row = f"| {name} | {n} | {mb:g} | " + " | ".join(cells) + " |"
                print(row, flush=True)
                lines.append(row)
    if not args.quick:
        args.out.write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
