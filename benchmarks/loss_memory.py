"""Peak memory of every ring loss's forward+backward on CPU, as B_local grows: bytes per row
plus a constant.

    python benchmarks/loss_memory.py                # B_local 4k..64k, blocks 1024 and 4096
    python benchmarks/loss_memory.py --quick        # a check that it runs (seconds)

On 2 ranks as well (``--world-rows``, default B_local 1024 to 3072, real tensors, the first
block size): what the ring adds, its travelling blocks and accumulators, is per row too.

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
import functools
import platform
import sys
import weakref
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
from torch import Tensor
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

import distgrad as dg
from distgrad.losses import _blockwise as ring_losses
from distgrad.testing import run_on_ranks

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


class Live(TorchDispatchMode):
    """Every tensor storage an operator creates while this mode is on, until it is freed (a
    weak reference to the storage, as MemTracker keeps): the running sum of their bytes, and
    its peak in each phase (``phase``: ``"ring"`` while a ring's forward or backward runs,
    ``"rest"`` otherwise)."""

    def __init__(self) -> None:
        super().__init__()
        self.live = 0
        self.phase = "rest"
        self.peak = {"ring": 0, "rest": 0}
        self._refs: dict[int, weakref.ref[torch.UntypedStorage]] = {}

    def _freed(self, key: int, nbytes: int, _: object) -> None:
        self._refs.pop(key, None)
        self.live -= nbytes

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        for t in tree_leaves(out):
            if isinstance(t, Tensor):
                st = t.untyped_storage()
                key = id(st)
                if key in self._refs and self._refs[key]() is st:
                    continue
                nbytes = st.nbytes()
                self._refs[key] = weakref.ref(st, functools.partial(self._freed, key, nbytes))
                self.live += nbytes
        self.peak[self.phase] = max(self.peak[self.phase], self.live)
        return out


@contextlib.contextmanager
def _phases(live: Live) -> Iterator[None]:
    """``live.phase`` is "ring" inside the ring losses' forward and backward."""
    saved = {name: getattr(ring_losses, name) for name in ("_forward", "_backward")}

    def wrap(fn: Callable[..., Any]) -> Callable[..., Any]:
        def inner(*args: Any) -> Any:
            live.phase = "ring"
            try:
                return fn(*args)
            finally:
                live.phase = "rest"

        return inner

    for name, fn in saved.items():
        setattr(ring_losses, name, wrap(fn))
    try:
        yield
    finally:
        for name, fn in saved.items():
            setattr(ring_losses, name, fn)


def _ranked_peak(rank: int, world: int, loss: str, rows: int, block: int) -> dict[str, int]:
    torch.set_num_threads(1)
    return peak(loss, rows, block, fake=False)


def ring_peaks(world: int, loss: str, rows: list[int], block: int) -> dict[int, dict[str, int]]:
    """The largest rank's peaks at each B_local, on ``world`` gloo ranks, real tensors."""
    out = {}
    for r in rows:
        per_rank = run_on_ranks(_ranked_peak, world, args=(loss, r, block), timeout=1800)
        out[r] = {ph: max(p[ph] for p in per_rank) for ph in ("ring", "rest", "step")}
    return out


def peak(loss: str, rows: int, block: int, fake: bool) -> dict[str, int]:
    """Peak bytes of storages created during one forward+backward (the inputs excluded): in
    the ring's forward and backward (``"ring"``), outside them (``"rest"``) and overall
    (``"step"``)."""
    mode: contextlib.AbstractContextManager[object] = (
        FakeTensorMode() if fake else contextlib.nullcontext()
    )
    with mode:
        torch.manual_seed(0)
        feats, scalars = _inputs(loss, rows)
        live = Live()
        with _phases(live), live:
            _step(loss, block)(feats, scalars).backward()
    return {**live.peak, "step": max(live.peak.values())}


def _fit(peaks: dict[int, int]) -> tuple[float, list[float]]:
    """(bytes per row a, from the smallest and largest B_local; peak - a B_local at each)."""
    lo, hi = min(peaks), max(peaks)
    a = (peaks[hi] - peaks[lo]) / (hi - lo)
    return a, [(peaks[r] - a * r) / 2**20 for r in sorted(peaks)]


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
    parser.add_argument(
        "--world-rows", type=int, nargs="*", default=[1024, 2048, 3072], help="B_local on 2 ranks"
    )
    parser.add_argument("--quick", action="store_true", help="tiny sizes: a check that it runs")
    parser.add_argument("--out", type=Path, default=None, help="write the tables here")
    args = parser.parse_args()
    if args.quick:
        args.rows, args.blocks, args.real, args.world_rows = [256, 512, 768], [64], 256, [128, 256]
    row_bytes = 4 * DIM

    def cells(peaks: dict[int, dict[str, int]]) -> str:
        out = []
        for phase in ("ring", "rest"):
            a, consts = _fit({r: p[phase] for r, p in peaks.items()})
            out.append(f"{a:.0f} ({a / row_bytes:.2f}) | " + ", ".join(f"{c:.2f}" for c in consts))
        steps = ", ".join(f"{p['step'] / 2**20:.1f}" for _, p in sorted(peaks.items()))
        return " | ".join(out) + f" | {steps}"

    head = (
        "| loss | block | ring: bytes per row (feature rows) | ring: peak - a B_local, MiB | "
        "rest: bytes per row (feature rows) | rest: peak - a B_local, MiB | step peak, MiB |"
    )
    lines = [
        f"torch {torch.__version__}, {platform.machine()}, dim {DIM}, float32, one thread. "
        "Peak bytes of the tensor storages created during one forward+backward (the features "
        "excluded, their gradients included), inside the ring's forward and backward ('ring') "
        "and outside them ('rest': normalising, the positives, autograd's gradients of the "
        "features); a fitted from the smallest and the largest B_local; a 'feature row' is "
        f"4 D = {row_bytes} bytes.",
        "",
        f"World size 1, B_local {args.rows}, fake tensors (every operator run for its "
        "output's storage, no arithmetic):",
        "",
        head,
        "|---|---|---|---|---|---|---|",
    ]
    checks = []
    with _threads(1):
        for loss in args.losses:
            for block in args.blocks:
                peaks = {rows: peak(loss, rows, block, fake=True) for rows in args.rows}
                row = f"| {loss} | {block} | {cells(peaks)} |"
                print(row, flush=True)
                lines.append(row)
                if args.real:
                    got = peak(loss, args.real, block, fake=False)
                    want = peak(loss, args.real, block, fake=True)
                    checks.append(
                        f"| {loss} | {block} | "
                        + " | ".join(
                            f"{got[ph] / 2**20:.2f} / {want[ph] / 2**20:.2f}"
                            for ph in ("ring", "rest")
                        )
                        + " |"
                    )
                    print(checks[-1], flush=True)
        if checks:
            lines += [
                "",
                f"The same at B_local {args.real} on real tensors against fake ones (MiB, "
                "real / fake):",
                "",
                "| loss | block | ring | rest |",
                "|---|---|---|---|",
                *checks,
            ]
        if args.world_rows:
            lines += [
                "",
                f"2 gloo ranks, real tensors, the largest rank's peaks, B_local {args.world_rows}: "
                "what the ring adds (its travelling key blocks and accumulators) is per row.",
                "",
                head,
                "|---|---|---|---|---|---|---|",
            ]
            for loss in args.losses:
                block = args.blocks[0]
                row = f"| {loss} | {block} | {cells(ring_peaks(2, loss, args.world_rows, block))} |"
                print(row, flush=True)
                lines.append(row)
    text = "\n".join(lines) + "\n"
    if args.out is not None:
        args.out.write_text(text)
    sys.stdout.write("\n" + text)


if __name__ == "__main__":
    main()
