"""Part ``losses``: every loss and loss module against the float64 single-process loss, then
CLIP's time and peak memory at world size 1 against plain torch."""

from __future__ import annotations

import math
import random
import statistics
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import Tensor, nn

import distgrad as dg

from .ranks import Setup, bind, on_ranks, setups
from .report import Section


class _Function(nn.Module):
    """A functional loss as a module, its scalars fixed."""

    def __init__(self, name: str, block: int | None) -> None:
        super().__init__()
        self.name, self.block = name, block

    def forward(self, a: Tensor, b: Tensor, sizes: Sequence[int] | None = None) -> Tensor:
        L = dg.losses
        block = self.block
        if self.name == "info_nce":
            return L.info_nce(a, b, temperature=0.3, sizes=sizes, block_size=block)
        if self.name == "nt_xent":
            return L.nt_xent(a, b, temperature=0.3, sizes=sizes, block_size=block)
        if self.name == "clip_loss":
            return L.clip_loss(a, b, 10.0, sizes=sizes, block_size=block)
        if self.name == "siglip_loss":
            return L.siglip_loss(a, b, 10.0, -5.0, sizes=sizes, block_size=block)
        return L.barlow_twins(a, b, lambda_offdiag=0.1, sizes=sizes)


def _criterion(name: str, block: int | None) -> nn.Module:
    L = dg.losses
    modules: dict[str, Callable[[], nn.Module]] = {
        "CLIPLoss": lambda: L.CLIPLoss(10.0, block_size=block),
        "SigLIPLoss": lambda: L.SigLIPLoss(10.0, -5.0, block_size=block),
        "NTXentLoss": lambda: L.NTXentLoss(0.3, learnable=True, block_size=block),
        "InfoNCELoss": lambda: L.InfoNCELoss(0.3, learnable=True, block_size=block),
        "BarlowTwinsLoss": lambda: L.BarlowTwinsLoss(0.1),
    }
    return modules[name]() if name in modules else _Function(name, block)


LOSSES = [
    (name, block)
    for name in (
        *("info_nce", "nt_xent", "clip_loss", "siglip_loss", "barlow_twins"),
        *("CLIPLoss", "SigLIPLoss", "NTXentLoss", "InfoNCELoss", "BarlowTwinsLoss"),
    )
    for block in ((None,) if "arlow" in name else (None, 2))
]
PRECISIONS = ("float32", "bfloat16 autocast")
# docs/losses.md and tests/losses/test_modules.py (float32: rtol 1e-5, atol 1e-6);
# tests/losses/test_precision.py (bfloat16: the value to 1e-5 of the float64 loss of the
# same features, the gradients through the bfloat16 encoder to 2e-2 of the largest).
LOSS_TOL = {"float32": (1e-5, 1e-5), "bfloat16 autocast": (1e-5, 2e-2)}


def _loss_rows(n: int) -> list[int]:
    """Every rank's rows: uneven (3 and 5 alternately), so sizes= matters."""
    return [3 + 2 * (r % 2) for r in range(n)]


def _loss_batch(total: int) -> tuple[Tensor, Tensor]:
    gen = torch.Generator().manual_seed(1)
    base = torch.randn(total, 6, generator=gen)
    return base, base + 0.3 * torch.randn(total, 6, generator=gen)


def _models(name: str, block: int | None) -> tuple[nn.Linear, nn.Module]:
    torch.manual_seed(0)
    return nn.Linear(6, 8), _criterion(name, block)


def _losses_on_rank(rank: int, n: int, device: str) -> list[Any]:
    """Every loss and precision on this rank's rows: (value, features, encoder grads,
    criterion grads), all on the CPU."""
    where = bind(rank, device)
    sizes = _loss_rows(n)
    mine = slice(sum(sizes[:rank]), sum(sizes[: rank + 1]))
    a, b = (t[mine].to(where) for t in _loss_batch(sum(sizes)))
    found = []
    for name, block in LOSSES:
        for precision in PRECISIONS:
            encoder, criterion = (m.to(where) for m in _models(name, block))
            bf16 = precision != "float32"
            with torch.autocast(where.type, dtype=torch.bfloat16, enabled=bf16):
                za, zb = encoder(a), encoder(b)
                loss = criterion(za, zb, sizes=sizes)
            loss.backward()
            grads = [p.grad.cpu() for p in encoder.parameters() if p.grad is not None]
            own = [p.grad.cpu() for p in criterion.parameters() if p.grad is not None]
            found.append((float(loss.detach()), za.detach().cpu(), zb.detach().cpu(), grads, own))
    return found


def _reference(
    name: str, block: int | None, za: Tensor, zb: Tensor
) -> tuple[float, list[Tensor], list[Tensor]]:
    """The float64 single-process loss at the ranks' own features (the float64 encoder's
    output shifted onto them), and its parameter gradients."""
    encoder, criterion = _models(name, block)
    encoder, criterion = encoder.double(), criterion.double()
    a, b = (t.double() for t in _loss_batch(len(za)))
    fa, fb = encoder(a), encoder(b)
    fa = fa + (za.double() - fa).detach()  # value at the ranks' features; gradient through
    fb = fb + (zb.double() - fb).detach()  # the float64 encoder
    loss = criterion(fa, fb)
    loss.backward()
    grads = [p.grad for p in encoder.parameters() if p.grad is not None]
    own = [p.grad for p in criterion.parameters() if p.grad is not None]
    return float(loss.detach()), grads, own


def _compare_loss(
    per_rank: list[list[Any]], i: int, name: str, block: int | None, precision: str
) -> str:
    za = torch.cat([r[i][1] for r in per_rank])
    zb = torch.cat([r[i][2] for r in per_rank])
    value, grads, own = _reference(name, block, za, zb)
    value_tol, grad_tol = LOSS_TOL[precision]
    worst_value = max(abs(r[i][0] - value) / max(abs(value), 1e-12) for r in per_rank)
    if worst_value > value_tol:
        return f"FAIL: value off by {worst_value:.1e} relative (tolerance {value_tol:g})"
    n = len(per_rank)
    got = [sum(r[i][3][k] for r in per_rank) / n for k in range(len(grads))]  # DDP's average
    scale = max(float(g.abs().max()) for g in grads)
    worst = 0.0
    for g, want in zip(got, grads, strict=True):
        worst = max(worst, float((g.double() - want).abs().max()) / scale)
    for r in per_rank:  # a module's scalars: the single-process gradient on every rank
        for g, want in zip(r[i][4], own, strict=True):
            worst = max(
                worst, float((g.double() - want).abs().max()) / max(float(want.abs().max()), 1e-12)
            )
    if worst > grad_tol:
        return f"FAIL: gradient off by {worst:.1e} of the largest (tolerance {grad_tol:g})"
    return f"pass (value {worst_value:.0e}, gradient {worst:.0e})"


# Time of CLIP's loss on one device at world size 1, against plain torch: (global batches
# timed against plain torch, the batch the ring alone runs at, dim, ring block).
LOSS_TIMING = {"cuda": ((16384, 32768), 131072, 512, 4096), "cpu": ((256, 512), 1024, 32, 128)}


def _plain_clip(x: Tensor, y: Tensor, s: Tensor) -> Tensor:
    """CLIP as a careful user writes it for one device: one logits matrix, a cross-entropy
    over its rows and one over its columns."""
    x, y = nn.functional.normalize(x, dim=1), nn.functional.normalize(y, dim=1)
    logits = (s * x) @ y.T
    labels = torch.arange(len(x), device=x.device)
    ce = nn.functional.cross_entropy
    return (ce(logits, labels) + ce(logits.T, labels)) / 2


def _clip_variants(block: int) -> dict[str, Callable[[Tensor, Tensor, Tensor], Tensor]]:
    return {
        "plain torch": _plain_clip,
        "dense": lambda x, y, s: dg.losses.clip_loss(x, y, s, sizes=[len(x)]),
        f"ring {block}": lambda x, y, s: dg.losses.clip_loss(
            x, y, s, sizes=[len(x)], block_size=block
        ),
    }


def _timed_clip(
    fn: Callable[[Tensor, Tensor, Tensor], Tensor], inputs: list[Tensor], cuda: bool
) -> float:
    """One forward+backward of ``fn`` in ms, the device synchronised before and after."""
    x, y, log_s = inputs
    for t in inputs:
        t.grad = None
    if cuda:
        torch.cuda.synchronize()
    start = time.perf_counter()
    fn(x, y, log_s.exp()).backward()
    if cuda:
        torch.cuda.synchronize()
    return (time.perf_counter() - start) * 1e3


def _clip_times(
    rank: int, n: int, device: str, rounds: int
) -> list[tuple[int, str, list[float], float]]:
    """(global batch, variant, times per round in ms, peak MiB above the inputs) of CLIP's
    forward+backward at world size 1: every variant once per round, in a shuffled order, the
    device synchronised before and after each; the peak from an untimed first call."""
    where = bind(rank, device)
    batches, ring_only, dim, block = LOSS_TIMING[where.type]
    cuda = where.type == "cuda"
    order, found = random.Random(0), []
    for batch in (*batches, ring_only):
        gen = torch.Generator().manual_seed(0)
        x, y = (torch.randn(batch, dim, generator=gen).to(where).requires_grad_() for _ in "xy")
        log_s = torch.tensor(math.log(1 / 0.07), device=where, requires_grad=True)
        inputs = [x, y, log_s]
        variants = _clip_variants(block)
        if batch == ring_only:
            variants = {k: v for k, v in variants.items() if k.startswith("ring")}

        peaks, times = {}, {name: [] for name in variants}
        for name, fn in variants.items():
            if cuda:
                torch.cuda.reset_peak_memory_stats()
                base = torch.cuda.memory_allocated()
            _timed_clip(fn, inputs, cuda)  # warm-up (and the peak)
            peaks[name] = (torch.cuda.max_memory_allocated() - base) / 2**20 if cuda else math.nan
        for _ in range(rounds):
            names = list(variants)
            order.shuffle(names)
            for name in names:
                times[name].append(_timed_clip(variants[name], inputs, cuda))
        found += [(batch, name, times[name], peaks[name]) for name in variants]
        del x, y, inputs
    return found


def _timing_rows(section: Section, device: str, rounds: int = 5) -> None:
    """CLIP's time at world size 1 (one process, the first setup's backend) against plain
    torch: a row per batch and variant, the median time and the median paired ratio."""
    setup = setups(device, 1)[0]
    alone = Setup(setup.backend, 1, setup.device)
    per_rank = on_ranks(
        section, alone, ("clip_loss time", "-", "float32"), _clip_times, (device, rounds),
        timeout=420, collective_timeout=300,
    )  # fmt: skip
    if per_rank is None:
        return
    dim = LOSS_TIMING[device][2]
    found = per_rank[0]
    plain = {batch: times for batch, name, times, _ in found if name == "plain torch"}
    for batch, name, times, peak in found:
        shown = f"{statistics.median(times):.1f} ms"
        if batch in plain and name != "plain torch":
            ratio = statistics.median(t / p for t, p in zip(times, plain[batch], strict=True))
            shown += f", {ratio:.2f}x plain torch"
        shown += f", peak {peak:.0f} MiB" if not math.isnan(peak) else ", peak: CPU, not measured"
        what = f"clip_loss time, global batch {batch}, dim {dim}"
        section.rows.append((alone.label, what, name, "float32", shown))


def part(device: str, gpus: int) -> Section:
    section = Section(
        "losses",
        "Every loss function and loss module, dense and ring (`block_size=2`) paths, uneven "
        "rows (3 and 5 per rank, `sizes=` given), an `nn.Linear(6, 8)` encoder in float32, "
        "in float32 and under bfloat16 autocast. Reference: the float64 loss in one process "
        "on the whole batch, at the features the ranks computed, its gradient through a "
        "float64 copy of the encoder. Tolerances: float32 value and gradients 1e-5 relative "
        "(docs/losses.md); bfloat16 value 1e-5 relative (the loss computes in float32), "
        "gradients 2e-2 of the largest (tests/losses/test_precision.py). Encoder gradients are "
        "averaged over ranks (DDP); a module's scalars must have the single-process gradient "
        "on every rank. The result shows the worst relative errors seen. Then the time of "
        "`clip_loss`'s forward+backward at world size 1 (one process), float32, against plain "
        "torch (one logits matrix, a cross-entropy over its rows and one over its columns): "
        "dense and ring (`block_size=4096`) at global batch 16384 and 32768, dim 512, and the "
        "ring alone at 131072 (CPU mode: 256 and 512, the ring at 1024, dim 32, block 128); "
        "5 rounds, each variant once per round in a shuffled order, the median time and the "
        "median of the paired ratios; the peak is `max_memory_allocated` above the inputs in "
        "an untimed first call.",
        ("setup", "loss", "path", "precision", "result"),
    )
    for setup in setups(device, gpus):
        per_rank = on_ranks(
            section,
            setup,
            ("every loss", "-", "-"),
            _losses_on_rank,
            (setup.device,),
            timeout=180,
            collective_timeout=60,
        )
        if per_rank is None:
            continue
        i = 0
        for name, block in LOSSES:
            for precision in PRECISIONS:
                path = "dense" if block is None else f"ring {block}"
                result = _compare_loss(per_rank, i, name, block, precision)
                section.rows.append((setup.label, name, path, precision, result))
                i += 1
    _timing_rows(section, device)
    return section
