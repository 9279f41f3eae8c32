"""Part ``memory``: peak GPU memory of the dense and ring contrastive loss."""

from __future__ import annotations

import math

import torch

import distgrad as dg

from .ranks import bind, on_ranks, setups
from .report import Section


def _peak(
    rank: int, n: int, device: str, batches: list[int], dim: int
) -> list[tuple[int, str, float]]:
    """(global batch, path, peak MiB above the inputs) of CLIP's loss, forward and backward."""
    where = bind(rank, device)
    found = []
    for batch in batches:
        for block in (None, 1024):
            rows = batch // n
            gen = torch.Generator().manual_seed(rank)
            a, b = (torch.randn(rows, dim, generator=gen).to(where).requires_grad_() for _ in "ab")
            sizes = [rows] * n
            if where.type == "cuda":
                torch.cuda.synchronize()
                torch.cuda.reset_peak_memory_stats()
                start = torch.cuda.memory_allocated()
            dg.losses.clip_loss(a, b, sizes=sizes, block_size=block).backward()
            peak = float("nan")
            if where.type == "cuda":
                peak = (torch.cuda.max_memory_allocated() - start) / 2**20
            found.append((batch, "dense" if block is None else f"ring {block}", peak))
            del a, b
    return found


def part(device: str, gpus: int) -> Section:
    batches, dim = ([16384, 32768], 512) if device == "cuda" else ([256, 512], 32)
    section = Section(
        "memory",
        f"Peak GPU memory per rank (`torch.cuda.max_memory_allocated` above the inputs) of "
        f"one forward+backward of `clip_loss`, dim {dim}, float32: the dense path and the "
        "ring path (`block_size=1024`).",
        ("setup", "global batch", "path", "peak MiB per rank"),
    )
    setup = setups(device, gpus)[0]
    per_rank = on_ranks(
        section,
        setup,
        ("-", "-"),
        _peak,
        (setup.device, batches, dim),
        timeout=300,
        collective_timeout=120,
    )
    if per_rank is None:
        return section
    for i, (batch, path, _) in enumerate(per_rank[0]):
        peak = max(r[i][2] for r in per_rank)
        shown = (
            f"{peak:.0f}"
            if not math.isnan(peak)
            else f"not run: no CUDA device (ran at global batch {batch} to prove the code path)"
        )
        section.rows.append((setup.label, str(batch), path, shown))
    return section
