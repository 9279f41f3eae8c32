"""Peak memory and time of the CLIP loss's forward+backward on 2 gloo ranks: distgrad's dense
path, distgrad's memory-efficient ring path, and an open_clip-style gather-everything loss.

    python benchmarks/losses.py                 # 4096, 16384, 32768 (about 15 min on 2 cores)
    python benchmarks/losses.py --sizes 4096    # a quick run

Method. Every (variant, global batch) runs in two fresh rank processes started by
``run_on_ranks``, so no allocation of an earlier case is counted. Each rank makes its
embeddings [B/2, 512] float32 and a learnable logit scale, records ``ru_maxrss`` (the resident
set's high-water mark, from ``resource.getrusage``), runs forward+backward once, and reports
the growth of that high-water mark: the peak extra memory the loss needed on that rank, inputs
excluded (CPU tensors have no allocator statistics in torch; RSS is what the machine must
have). Time is the wall-clock of forward+backward (until every rank's gradients are ready),
the median over ``--repeat`` timed iterations after the first; at the largest size, where one
iteration takes minutes on 2 cores, the first iteration is the only timed one. One thread
per rank (2 ranks share 2 cores).
"""

from __future__ import annotations

import argparse
import resource
import statistics
import time
import warnings
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.nn.functional as dist_nn
import torch.nn.functional as F
from torch import Tensor

import distgrad as dg
from distgrad.testing import run_on_ranks

DIM = 512
BLOCK = 1024


def gather_everything(image: Tensor, text: Tensor, scale: Tensor) -> Tensor:
    """open_clip's ClipLoss(local_loss=True, gather_with_grad=True), written out: gather every
    rank's features with gradients, [B_l, B] logits per direction, cross-entropy with the
    labels offset by the rank. Its value is this rank's mean; DDP averages it."""
    x, y = F.normalize(image, dim=1), F.normalize(text, dim=1)
    all_x = torch.cat(dist_nn.all_gather(x))
    all_y = torch.cat(dist_nn.all_gather(y))
    labels = torch.arange(len(x)) + dist.get_rank() * len(x)
    per_image = F.cross_entropy(scale * x @ all_y.T, labels)
    per_text = F.cross_entropy(scale * y @ all_x.T, labels)
    return (per_image + per_text) / 2


def dense(image: Tensor, text: Tensor, scale: Tensor) -> Tensor:
    return dg.losses.clip_loss(image, text, logit_scale=scale)


def ring(image: Tensor, text: Tensor, scale: Tensor) -> Tensor:
    return dg.losses.clip_loss(image, text, logit_scale=scale, block_size=BLOCK)


VARIANTS: dict[str, Callable[[Tensor, Tensor, Tensor], Tensor]] = {
    "gather-everything (open_clip style)": gather_everything,
    "distgrad dense": dense,
    f"distgrad memory-efficient (block {BLOCK})": ring,
}


def _maxrss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux: KiB


def _step(loss: Callable[[Tensor, Tensor, Tensor], Tensor], inputs: list[Tensor]) -> float:
    for t in inputs:
        t.grad = None
    dist.barrier()
    start = time.perf_counter()
    loss(*inputs).backward()
    dist.barrier()
    return time.perf_counter() - start


def _measure(rank: int, world_size: int, name: str, batch: int, repeat: int) -> tuple[float, float]:
    torch.set_num_threads(1)
    # torch.distributed.nn is deprecated, yet it is what open_clip's gather_with_grad calls.
    warnings.filterwarnings("ignore", category=FutureWarning)
    gen = torch.Generator().manual_seed(rank)
    rows = batch // world_size
    image, text = (torch.randn(rows, DIM, generator=gen).requires_grad_() for _ in range(2))
    scale = torch.tensor(1 / 0.07, requires_grad=True)
    dist.barrier()
    before = _maxrss_mib()
    times = [_step(VARIANTS[name], [image, text, scale])]
    peak = _maxrss_mib() - before
    times += [_step(VARIANTS[name], [image, text, scale]) for _ in range(repeat)]
    return peak, statistics.median(times[1:] if repeat else times)


def _table(rows: list[tuple[int, str, float, float]]) -> str:
    lines = [
        "| global batch | variant | peak extra memory per rank (MiB) | fwd+bwd time (s) | "
        "memory vs gather-everything | time vs gather-everything |",
        "|---:|---|---:|---:|---:|---:|",
    ]
    base = {b: (m, t) for b, v, m, t in rows if v.startswith("gather")}
    for batch, variant, mem, sec in rows:
        ref_mem, ref_sec = base.get(batch, (float("nan"), float("nan")))
        lines.append(
            f"| {batch} | {variant} | {mem:.0f} | {sec:.2f} | "
            f"{ref_mem / max(mem, 1e-9):.1f}x smaller | {sec / ref_sec:.2f}x |"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=[4096, 16384, 32768])
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results/losses.md")
    parser.add_argument(
        "--reverse", action="store_true", help="run the variants in reverse order (a re-run)"
    )
    args = parser.parse_args()
    names = list(VARIANTS)[::-1] if args.reverse else list(VARIANTS)
    rows = []
    for batch in args.sizes:
        repeat = 2 if batch <= 4096 else 1 if batch <= 16384 else 0
        for name in names:
            results = run_on_ranks(
                _measure, 2, args=(name, batch, repeat), timeout=1500, collective_timeout=1200
            )
            mem = max(r[0] for r in results)
            sec = max(r[1] for r in results)
            rows.append((batch, name, mem, sec))
            print(f"{batch:6d}  {name:40s} {mem:8.0f} MiB  {sec:8.2f} s", flush=True)
    table = _table(rows)
    print(table)
    stamp = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    method = (__doc__ or "").split("Method. ")[1].strip()
    args.out.write_text(
        f"# CLIP loss: memory and time on 2 gloo ranks (CPU, float32, dim {DIM})\n\n"
        f"Written by `python benchmarks/losses.py` on {stamp}.\n\n{table}\n\n"
        f"## Method\n\n{method}\n"
    )


if __name__ == "__main__":
    main()
