"""Peak memory of every ring loss's forward+backward on CPU, as B_local grows: bytes per row
plus a constant.

    python benchmarks/loss_memory.py                # B_local 4k..64k, blocks 1024 and 4096
    python benchmarks/loss_memory.py --quick        # a check that it runs (seconds)

What is measured. One forward and backward of each ring loss (``block_size=b``) at world size
1, dim 512, float32: CLIP, SigLIP with a learnable scale and bias, InfoNCE with 2 hard
negatives per query, and NT-Xent. The features are made before the step and are not counted;
everything the step allocates is, their gradients included. The tool is torch's
``torch.distributed._tools.mem_tracker.MemTracker``: a dispatch mode that sees every tensor
storage an operator creates (forward and backward) and when it is freed, and keeps the peak
of their running sum per device. Buffers an operator allocates and frees inside its own
kernel are not seen (they are bounded by a tile here).

At 64k rows a step computes 4 matmuls of 64k x 512 x 64k: hours on 2 shared cores. So the
sweep runs the same Python program on fake tensors (``FakeTensorMode``: every operator runs
for its output's shape, dtype and storage, no arithmetic), which MemTracker follows as it
follows real ones; a row at B_local ``--real`` (default 4096) runs on real tensors too, and
the table shows both peaks, which must agree.

The fit: ``peak = a * B_local + c`` from the smallest and the largest B_local; the table gives
``a`` in bytes per row (and in rows of features, ``a / (4 D)``) and, for every B_local,
``peak - a * B_local``: constant when nothing grows but per-row buffers. The per-row buffers
are the features' gradients, the float32 normalised copies the loss makes of its inputs (and
their concatenations: NT-Xent's two views, InfoNCE's keys with their negatives) and a few
per-row statistics; everything else is ``[b, b]`` tiles (the constant).
Results: results/loss_memory.md.
"""

from __future__ import annotations

import argparse
import contextlib
import platform
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import torch
from torch import Tensor
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.distributed._tools.mem_tracker import MemTracker

import distgrad as dg

DIM = 512
NEGATIVES = 2


def _inputs(loss: str, rows: int) -> tuple[list[Tensor], list[Tensor]]:
    """(features [rows, DIM] each, and hard negatives, requiring grad; learnable scalars)."""
    count = {"clip": 2, "siglip": 2, "info_nce+hard": 2, "nt_xent": 2}[loss]
    feats = [torch.randn(rows, DIM, requires_grad=True) for _ in range(count)]
    if loss == "info_nce+hard":
        feats.append(torch.randn(rows, NEGATIVES, DIM, requires_grad=True))
    scalars = [torch.tensor(2.3, requires_grad=True), torch.tensor(-1.0, requires_grad=True)]
    return feats, scalars


def _step(loss: str, block: int) -> Callable[[list[Tensor], list[Tensor]], Tensor]:
    L = dg.losses

    def step(f: list[Tensor], s: list[Tensor]) -> Tensor:
        if loss == "clip":
            return L.clip_loss(f[0], f[1], s[0].exp(), block_size=block)
        if loss == "siglip":
            return L.siglip_loss(f[0], f[1], s[0].exp(), s[1], block_size=block)
        if loss == "info_nce+hard":
            return L.info_nce(f[0], f[1], negatives=f[2], temperature=0.05, block_size=block)
        return L.nt_xent(f[0], f[1], temperature=0.1, block_size=block)

    return step


LOSSES = ("clip", "siglip", "info_nce+hard", "nt_xent")


def peak(loss: str, rows: int, block: int, fake: bool) -> int:
    """Peak bytes of storages created during one forward+backward (the inputs excluded)."""
    mode: contextlib.AbstractContextManager[object] = (
        FakeTensorMode() if fake else contextlib.nullcontext()
    )
    with mode:
        torch.manual_seed(0)
        feats, scalars = _inputs(loss, rows)
        tracker = MemTracker()
        with tracker:
            _step(loss, block)(feats, scalars).backward()
        snapshot = tracker.get_tracker_snapshot("peak")
    return int(sum(v.get("Total", 0) for v in snapshot.values()))  # type: ignore[union-attr]


@contextlib.contextmanager
def _threads(n: int) -> Iterator[None]:
    before = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rows", type=int, nargs="+", default=[4096, 8192, 16384, 32768, 65536])
    parser.add_argument("--blocks", type=int, nargs="+", default=[1024, 4096])
    parser.add_argument("--real", type=int, default=4096, help="B_local also run on real tensors")
    parser.add_argument("--losses", nargs="+", default=list(LOSSES), choices=LOSSES)
    parser.add_argument("--quick", action="store_true", help="tiny sizes: a check that it runs")
    parser.add_argument("--out", type=Path, default=None, help="write the table here")
    args = parser.parse_args()
    if args.quick:
        args.rows, args.blocks, args.real = [256, 512], [64], 256
    feature_row = 4 * DIM
    lines = [
        f"torch {torch.__version__}, {platform.machine()}, world size 1, dim {DIM}, float32; "
        f"peak bytes of tensor storages created during one forward+backward (MemTracker), "
        f"the features excluded, their gradients included; B_local {args.rows}.",
        "",
        "| loss | block | per row: bytes (feature rows) | constant c = peak - a B_local, "
        "MiB, at each B_local | real / fake peak at B_local "
        f"{args.real} |",
        "|---|---|---|---|---|",
    ]
    with _threads(1):
        for loss in args.losses:
            for block in args.blocks:
                peaks = {rows: peak(loss, rows, block, fake=True) for rows in args.rows}
                lo, hi = min(args.rows), max(args.rows)
                a = (peaks[hi] - peaks[lo]) / (hi - lo)
                consts = [(peaks[r] - a * r) / 2**20 for r in args.rows]
                real = ""
                if args.real:
                    got = peak(loss, args.real, block, fake=False)
                    want = peak(loss, args.real, block, fake=True)
                    real = f"{got / 2**20:.2f} / {want / 2**20:.2f} MiB"
                row = (
                    f"| {loss} | {block} | {a:.0f} ({a / feature_row:.2f}) | "
                    + ", ".join(f"{c:.2f}" for c in consts)
                    + f" | {real} |"
                )
                print(row, flush=True)
                lines.append(row)
    text = "\n".join(lines) + "\n"
    if args.out is not None:
        args.out.write_text(text)
    sys.stdout.write("\n" + text)


if __name__ == "__main__":
    main()
