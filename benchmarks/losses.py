"""CLIP and SigLIP losses on W gloo ranks against open_clip's own loss module, and InfoNCE with
hard negatives against sentence-transformers' MultipleNegativesRankingLoss: time of
forward+backward and bytes saved for backward, as paired ratios; and the peak memory of each
rank during a step, as the number of ranks grows.

    python benchmarks/losses.py                          # W 2 and 4, B_local 1024 and 4096
    python benchmarks/losses.py --configs 2x1024 --rounds 2     # a quick run
    python benchmarks/losses.py --configs 2x8192         # global batch 16384 on 2 ranks
    python benchmarks/losses.py --losses retrieval --configs 2x1024 4x1024 --negatives 1 3
    python benchmarks/losses.py --peak 2 4 8 --configs 1024    # peak memory per rank

Retrieval (``--losses retrieval``): queries, keys [B_local, 512] and m hard negatives per
query [B_local, m, 512], scale 20 (temperature 0.05), one direction (``query_to_doc``).
Baseline: sentence-transformers 6.2's ``MultipleNegativesRankingLoss(gather_across_devices=
True)``, its own file loaded by path as the tests load it (``tests/losses/mnrl.py``; install
with ``pip install --no-deps sentence-transformers==6.2.0``), fed the queries, the keys and
one [B_local, 512] tensor per negative column.

Peak memory (``--peak W...``): for each loss and path, W fresh processes make one warm-up
step, then one step under torch's memory profiler (``torch.profiler`` with
``profile_memory=True``); its timeline gives every tensor storage created and destroyed
during the step, and the peak of their running sum is the step's peak memory on that rank
above what existed before it (the inputs). Reported: the largest rank's.

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

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # for tests.losses.mnrl
from tests.losses import mnrl

DIM = 512
BLOCK = 1024
Loss = Callable[..., Tensor]
SCALE = 20.0  # sentence-transformers' default scale (temperature 0.05)


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


def retrieval_variants(world_size: int) -> dict[str, Loss]:
    """InfoNCE with hard negatives: sentence-transformers' gather version first. Each takes the
    queries, the keys and the negatives [B_local, m, D], un-normalised."""

    def st(q: Tensor, k: Tensor, n: Tensor) -> Tensor:
        return mnrl.multiple_negatives_ranking_loss(
            [q, k, *n.unbind(1)],
            scale=SCALE,
            directions=("query_to_doc",),
            partition_mode="joint",
        )

    def distgrad(block: int | None) -> Loss:
        def run(q: Tensor, k: Tensor, n: Tensor) -> Tensor:
            sizes = [len(q)] * world_size
            return dg.losses.info_nce(
                q, k, negatives=n, temperature=1 / SCALE, sizes=sizes, block_size=block
            )

        return run

    return {
        "sentence-transformers MNRL(gather_across_devices)": st,
        "distgrad dense": distgrad(None),
        f"distgrad ring (block {BLOCK})": distgrad(BLOCK),
    }


def variants(loss: str, rank: int, world_size: int) -> dict[str, Loss]:
    """The variants of ``loss``, the baseline (open_clip's exact one) first. Each takes the
    un-normalised features, the log logit scale and the bias."""
    if loss == "retrieval":
        return retrieval_variants(world_size)
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


def _inputs(loss: str, rank: int, rows: int, m: int) -> list[Tensor]:
    """Leaves of one step: features [rows, DIM] (and m negatives per row for retrieval), the
    log logit scale and the bias for CLIP and SigLIP."""
    gen = torch.Generator().manual_seed(rank)
    x, y = (torch.randn(rows, DIM, generator=gen).requires_grad_() for _ in range(2))
    if loss == "retrieval":
        return [x, y, torch.randn(rows, m, DIM, generator=gen).requires_grad_()]
    # CLIP's initial scale 1/0.07, SigLIP's 10 and bias -10
    log_s = torch.tensor(math.log(1 / 0.07 if loss == "clip" else 10.0), requires_grad=True)
    return [x, y, log_s, torch.tensor(-10.0, requires_grad=True)]


def _measure(
    rank: int, world_size: int, loss: str, rows: int, rounds: int, m: int = 0
) -> dict[str, tuple[list[float], int]]:
    """Every variant's times (slower rank's, per round) and saved bytes on this rank."""
    torch.set_num_threads(1)
    # torch.distributed.nn is deprecated, yet it is what open_clip's gather_with_grad calls.
    warnings.filterwarnings("ignore", category=FutureWarning)
    found = variants(loss, rank, world_size)
    inputs = _inputs(loss, rank, rows, m)

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


def _step_peak(fn: Callable[[], None]) -> int:
    """Bytes: the peak, during ``fn``, of the storages created in it and not yet destroyed."""
    from torch.profiler import ProfilerActivity, profile
    from torch.profiler._memory_profiler import Action

    with profile(
        activities=[ProfilerActivity.CPU], profile_memory=True, record_shapes=True, with_stack=True
    ) as prof:
        fn()
    live = peak = 0
    for _, action, _, size in prof._memory_profile().timeline:
        if action == Action.CREATE:
            live += size
        elif action == Action.DESTROY:
            live -= size
        peak = max(peak, live)
    return peak


def _peak(rank: int, world_size: int, loss: str, rows: int, name: str) -> int:
    """One variant's peak bytes on this rank during one step, after a warm-up step."""
    torch.set_num_threads(1)
    warnings.filterwarnings("ignore", category=FutureWarning)
    fn = PEAK_VARIANTS[name](loss, world_size)
    inputs = _inputs(loss, rank, rows, 0)

    def step() -> None:
        for t in inputs:
            t.grad = None
        fn(*inputs).backward()

    step()
    dist.barrier()
    return _step_peak(step)


def _dg(loss: str, world_size: int, block: int | None) -> Loss:
    def run(x: Tensor, y: Tensor, log_s: Tensor, b: Tensor) -> Tensor:
        sizes = [len(x)] * world_size
        if loss == "clip":
            return dg.losses.clip_loss(x, y, log_s.exp(), sizes=sizes, block_size=block)
        return dg.losses.siglip_loss(x, y, log_s.exp(), b, sizes=sizes, block_size=block)

    return run


PEAK_VARIANTS: dict[str, Callable[[str, int], Loss]] = {
    "dense": lambda loss, w: _dg(loss, w, None),
    f"ring (block {BLOCK})": lambda loss, w: _dg(loss, w, BLOCK),
}


def peak_table(worlds: list[int], rows: int, losses: list[str]) -> str:
    """Peak MiB per rank of each loss and path at each W, and the largest W's over the
    smallest's."""
    head = " | ".join(f"W={w} (B={w * rows})" for w in worlds)
    lines = [
        f"| loss | path | {head} | W={worlds[-1]} vs W={worlds[0]} |",
        "|---|---|" + "---:|" * (len(worlds) + 1),
    ]
    for loss in losses:
        for name in PEAK_VARIANTS:
            peaks = []
            for w in worlds:
                per_rank = run_on_ranks(
                    _peak, w, args=(loss, rows, name), timeout=3000, collective_timeout=1800
                )
                peaks.append(max(per_rank))
            cells = " | ".join(f"{p / 2**20:.1f}" for p in peaks)
            lines.append(f"| {loss} | {name} | {cells} | {peaks[-1] / peaks[0]:.2f}x |")
            print(lines[-1], f"(load {os.getloadavg()})", flush=True)
    return "\n".join(lines)


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
    "| loss | W | B_local | B | variant | fwd+bwd ms (median) | time vs baseline (paired) "
    "| saved for backward MiB | saved vs baseline |\n|---|---:|---:|---:|---|---:|---:|---:|---:|"
)


def _timings(args: argparse.Namespace) -> str:
    if {"clip", "siglip"} & set(args.losses):
        open_clip_loss_module()  # fail early when open_clip is missing
    if "retrieval" in args.losses and mnrl.loss_module_path() is None:
        raise SystemExit("pip install --no-deps sentence-transformers==6.2.0")
    lines = []
    for loss in args.losses:
        for config in args.configs:
            w, rows = (int(v) for v in config.split("x"))
            for m in args.negatives if loss == "retrieval" else [0]:
                started = time.monotonic()
                per_rank = run_on_ranks(
                    _measure, w, args=(loss, rows, args.rounds, m), timeout=3000,
                    collective_timeout=1800,
                )  # fmt: skip
                label = f"retrieval m={m}" if loss == "retrieval" else loss
                lines += _row(label, w, rows, per_rank)
                print("\n".join(lines[-len(per_rank[0]) :]), flush=True)
                print(f"({time.monotonic() - started:.0f} s, load {os.getloadavg()})", flush=True)
    return f"{HEADER}\n" + "\n".join(lines)


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
    parser.add_argument(
        "--negatives", nargs="+", type=int, default=[1, 3], help="m, for --losses retrieval"
    )
    parser.add_argument(
        "--peak", nargs="+", type=int, default=None, help="W...: peak memory per rank instead"
    )
    parser.add_argument("--out", type=Path, default=None, help="also write the table here")
    args = parser.parse_args()
    if args.peak:
        table = peak_table(args.peak, int(args.configs[0]), args.losses)
    else:
        table = _timings(args)
    print(table)
    if args.out is not None:
        stamp = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
        args.out.write_text(
            f"Written by `python {' '.join(sys.argv)}` on {stamp}, torch {torch.__version__}, "
            f"{platform.machine()}, {os.cpu_count()} cores.\n\n{table}\n"
        )


if __name__ == "__main__":
    main()
