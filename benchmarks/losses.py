"""CLIP and SigLIP losses on W gloo ranks against open_clip's own loss module: time of
forward+backward and bytes saved for backward, as paired ratios.

    python benchmarks/losses.py                          # W 2 and 4, B_local 1024 and 4096
    python benchmarks/losses.py --configs 2x1024 --rounds 2     # a quick run
    python benchmarks/losses.py --configs 2x8192         # global batch 16384 on 2 ranks

open_clip is an optional benchmark dependency (pyproject's ``bench`` extra names it), to be
installed with ``pip install --no-deps open_clip_torch``: its dependencies would pull
torchvision and replace a CPU torch with a CUDA one. Only its ``open_clip/loss.py`` is
loaded, by path, without importing the package, whose ``__init__`` imports torchvision; that
file imports nothing but torch.

Method. Every configuration (loss, W ranks, B_local rows per rank) runs in one set of W fresh
processes, one thread each (``torch.set_num_threads(1)``); 4 ranks on 2 cores are
oversubscribed two to one. Each rank makes float32 features [B_local, 512] that require grad
and a learnable log logit scale (and bias for SigLIP). Every variant runs once untimed (its
warm-up), inside ``torch.autograd.graph.saved_tensors_hooks``, which counts the bytes it saves
for backward: each saved tensor's storage once (views and tensors saved twice share it), the
features themselves included. Then ``--rounds`` rounds: in each, every variant once, in an
order shuffled per round (the same on every rank), a barrier before each, timed from the
barrier until this rank's backward returns; a variant's time in a round is the slower rank's.
Reported: the median time over rounds, and the median over rounds of the paired ratio (the
variant's time over the baseline's in the same round). Baselines: open_clip's exact variants,
``ClipLoss(local_loss=True, gather_with_grad=True)`` and ``SigLipLoss(dist_impl="bidir")``
(its default; every ``dist_impl`` is exact). The features reach every variant un-normalised
and each variant normalises them (open_clip's through ``F.normalize`` before the loss, as its
model does), so every variant does the same work.
"""

from __future__ import annotations

import argparse
import importlib.util
import math
import os
import platform
import random
import statistics
import sys
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from types import ModuleType

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor

import distgrad as dg
from distgrad.testing import run_on_ranks

DIM = 512
BLOCK = 1024
Loss = Callable[[Tensor, Tensor, Tensor, Tensor], Tensor]


def open_clip_loss_module() -> ModuleType:
    """open_clip's ``loss.py``, loaded by path (the package's ``__init__`` needs torchvision)."""
    spec = importlib.util.find_spec("open_clip")  # finds the package, does not import it
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit("open_clip is not installed: pip install --no-deps open_clip_torch")
    path = Path(next(iter(spec.submodule_search_locations))) / "loss.py"
    module_spec = importlib.util.spec_from_file_location("open_clip_loss", path)
    assert module_spec is not None and module_spec.loader is not None
    module = importlib.util.module_from_spec(module_spec)
    module_spec.loader.exec_module(module)
    return module


def variants(loss: str, rank: int, world_size: int) -> dict[str, Loss]:
    """The variants of ``loss``, the baseline (open_clip's exact one) first. Each takes the
    un-normalised features, the log logit scale and the bias."""
    oc = open_clip_loss_module()
    if loss == "clip":
        exact = oc.ClipLoss(
            local_loss=True, gather_with_grad=True, rank=rank, world_size=world_size
        )

        def open_clip(x: Tensor, y: Tensor, log_s: Tensor, b: Tensor) -> Tensor:
            return exact(F.normalize(x, dim=1), F.normalize(y, dim=1), log_s.exp())  # type: ignore[no-any-return]

        def dense(x: Tensor, y: Tensor, log_s: Tensor, b: Tensor) -> Tensor:
            return dg.losses.clip_loss(x, y, log_s.exp(), sizes=[len(x)] * world_size)

        def ring(x: Tensor, y: Tensor, log_s: Tensor, b: Tensor) -> Tensor:
            sizes = [len(x)] * world_size
            return dg.losses.clip_loss(x, y, log_s.exp(), sizes=sizes, block_size=BLOCK)

        return {
            "open_clip ClipLoss(local_loss, gather_with_grad)": open_clip,
            "distgrad dense": dense,
            f"distgrad ring (block {BLOCK})": ring,
        }
    bidir = oc.SigLipLoss(rank=rank, world_size=world_size, dist_impl="bidir")

    def open_clip_siglip(x: Tensor, y: Tensor, log_s: Tensor, b: Tensor) -> Tensor:
        return bidir(F.normalize(x, dim=1), F.normalize(y, dim=1), log_s.exp(), b)  # type: ignore[no-any-return]

    def siglip(block: int | str | None) -> Loss:
        def run(x: Tensor, y: Tensor, log_s: Tensor, b: Tensor) -> Tensor:
            sizes = [len(x)] * world_size
            return dg.losses.siglip_loss(x, y, log_s.exp(), b, sizes=sizes, block_size=block)  # type: ignore[arg-type]

        return run

    found = {
        'open_clip SigLipLoss(dist_impl="bidir")': open_clip_siglip,
        "distgrad dense": siglip(None),
        f"distgrad ring (block {BLOCK})": siglip(BLOCK),
    }
    if _has_auto():
        found['distgrad block_size="auto"'] = siglip("auto")
    return found


def _has_auto() -> bool:
    """Whether this distgrad takes ``block_size="auto"`` (a run on an earlier commit does not)."""
    return hasattr(dg.losses.contrastive, "choose_block")


def _saved_bytes(fn: Callable[[], Tensor]) -> tuple[Tensor, int]:
    """Run ``fn``; the bytes of every storage saved for its backward, each counted once."""
    storages: dict[int, int] = {}

    def pack(t: Tensor) -> Tensor:
        s = t.untyped_storage()
        storages[s.data_ptr()] = s.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn()
    return out, sum(storages.values())


def _slowest(seconds: float) -> float:
    t = torch.tensor([seconds], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t)


def _measure(
    rank: int, world_size: int, loss: str, rows: int, rounds: int
) -> dict[str, tuple[list[float], int]]:
    """Every variant's times (slower rank's, per round) and saved bytes on this rank."""
    torch.set_num_threads(1)
    # torch.distributed.nn is deprecated, yet it is what open_clip's gather_with_grad calls.
    warnings.filterwarnings("ignore", category=FutureWarning)
    found = variants(loss, rank, world_size)
    gen = torch.Generator().manual_seed(rank)
    x, y = (torch.randn(rows, DIM, generator=gen).requires_grad_() for _ in range(2))
    # CLIP's initial scale 1/0.07, SigLIP's 10 and bias -10
    log_s = torch.tensor(math.log(1 / 0.07 if loss == "clip" else 10.0), requires_grad=True)
    b = torch.tensor(-10.0, requires_grad=True)
    inputs = [x, y, log_s, b]

    def step(fn: Loss) -> Tensor:
        for t in inputs:
            t.grad = None
        return fn(*inputs)

    saved, times = {}, {name: [] for name in found}
    for name, fn in found.items():  # warm-up, and the bytes saved for backward
        dist.barrier()
        out, saved[name] = _saved_bytes(lambda fn=fn: step(fn))  # type: ignore[misc]
        out.backward()
    order = random.Random(0)  # the same shuffles on every rank
    for _ in range(rounds):
        names = list(found)
        order.shuffle(names)
        for name in names:
            dist.barrier()
            start = time.perf_counter()
            step(found[name]).backward()
            times[name].append(_slowest(time.perf_counter() - start))
    return {name: (times[name], saved[name]) for name in found}


def _row(
    loss: str, w: int, rows: int, per_rank: list[dict[str, tuple[list[float], int]]]
) -> list[str]:
    names = list(per_rank[0])
    base_times = per_rank[0][names[0]][0]
    base_saved = max(r[names[0]][1] for r in per_rank)
    lines = []
    for name in names:
        times = per_rank[0][name][0]  # every rank holds the slower rank's times
        saved = max(r[name][1] for r in per_rank)
        ratio = statistics.median(t / b for t, b in zip(times, base_times, strict=True))
        lines.append(
            f"| {loss} | {w} | {rows} | {w * rows} | {name} | {statistics.median(times) * 1e3:.0f} "
            f"| {ratio:.2f}x | {saved / 2**20:.0f} | {saved / base_saved:.2f}x |"
        )
    return lines


HEADER = (
    "| loss | W | B_local | B | variant | fwd+bwd ms (median) | time vs open_clip (paired) "
    "| saved for backward MiB | saved vs open_clip |\n|---|---:|---:|---:|---|---:|---:|---:|---:|"
)


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    parser.add_argument(
        "--configs",
        nargs="+",
        default=["2x1024", "4x1024", "2x4096", "4x4096"],
        help="WxB_local: ranks and rows per rank",
    )
    parser.add_argument("--losses", nargs="+", default=["clip", "siglip"])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--out", type=Path, default=None, help="also write the table here")
    args = parser.parse_args()
    open_clip_loss_module()  # fail early when open_clip is missing
    lines = []
    for loss in args.losses:
        for config in args.configs:
            w, rows = (int(v) for v in config.split("x"))
            started = time.monotonic()
            per_rank = run_on_ranks(
                _measure, w, args=(loss, rows, args.rounds), timeout=3000,
                collective_timeout=1800,
            )  # fmt: skip
            lines += _row(loss, w, rows, per_rank)
            print("\n".join(lines[-len(per_rank[0]) :]), flush=True)
            print(f"({time.monotonic() - started:.0f} s, load {os.getloadavg()})", flush=True)
    table = f"{HEADER}\n" + "\n".join(lines)
    print(table)
    if args.out is not None:
        stamp = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
        args.out.write_text(
            f"Written by `python {' '.join(sys.argv)}` on {stamp}, torch {torch.__version__}, "
            f"{platform.machine()}, {os.cpu_count()} cores.\n\n{table}\n"
        )


if __name__ == "__main__":
    main()
