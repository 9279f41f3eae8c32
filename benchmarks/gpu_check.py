"""One command that checks distgrad on the GPUs of this machine and writes what it found.

Run from the repository root: ``python benchmarks/gpu_check.py`` (at most about 10 minutes on
one GPU). It uses every visible GPU, one rank per GPU on NCCL; with a single GPU it runs NCCL
at world size 1 and gloo with CUDA tensors at world size 2 (gloo lacks CUDA support for some
exchanges: each op's row says what happened). Seven parts, each a table in the results file:

* ``gradients``: the gradient sweep of every op (tests/collectives/reference.py, the sweep the
  test suite runs on CPU) against single-process autograd, float64 and float32.
* ``losses``: every loss function and loss module, dense and ring paths, float32 and under
  bfloat16 autocast, against the float64 single-process loss of the same features, with the
  tolerances of docs/losses.md and tests/test_precision.py; then CLIP's forward+backward time
  and peak memory at world size 1, dense and ring against plain torch (one logits matrix).
* ``sync``: every op and loss past the checked calls, one by one, under
  ``torch.cuda.set_sync_debug_mode("warn")`` (each host synchronisation listed), then a
  training step under ``"error"``.
* ``guard``: the opt-in data guard's exchanges under ``set_sync_debug_mode("error")``, and a
  mismatched tag raised at the next guarded call (CUDA) or at once (CPU).
* ``compile``: the same calls in one step under ``torch.compile(fullgraph=True)`` (inductor):
  one graph, no break, eager's gradients.
* ``memory``: peak GPU memory of the dense and ring CLIP loss at global batch 16k and 32k.
* ``timing``: forward+backward time of every op at three sizes against torch's c10d
  collectives (the same exchanges, no autograd) and funcol's differentiable collectives, as
  paired ratios.

``--device cpu`` runs every part on gloo with CPU tensors at small sizes, to prove the
command's logic where no GPU is present (the test suite does that, tests/test_gpu_check.py);
it writes ``results/gpu_check_cpu.md``, which is labelled as a CPU run. ``results/gpu_check.md``
is reserved for GPU runs. A part that cannot run on the hardware present says so in a row
("not run: ..."); none is silently left out. ``--parts`` picks parts.
"""

from __future__ import annotations

import argparse
import datetime
import math
import platform
import random
import statistics
import sys
import time
import traceback
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn

import distgrad as dg
from distgrad._exchange import guard as _guard
from distgrad._exchange import ops
from distgrad._exchange.group import resolve
from distgrad.errors import CollectiveMismatchError, RankFailedError
from distgrad.testing import run_on_ranks

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # for tests.collectives.reference

from tests.collectives.reference import cases, check_case, edge_cases, replicated_cases, warm_up

RESULTS = Path(__file__).parent / "results"
PARTS = ("gradients", "losses", "sync", "guard", "compile", "memory", "timing")
OPS = (
    "all_gather",
    "reduce_scatter",
    "all_reduce",
    "all_to_all",
    "broadcast",
    "reduce",
    "gather",
    "scatter",
    "permute",
)


# ---------------------------------------------------------------------------------------------
# Where the ranks run, and the results file


@dataclass(frozen=True)
class Setup:
    """A process group to run on: its backend, its size and where its tensors live."""

    backend: str
    world_size: int
    device: str  # "cuda" or "cpu"

    @property
    def label(self) -> str:
        return f"{self.backend}, world size {self.world_size}, {self.device} tensors"


def setups(device: str, gpus: int) -> list[Setup]:
    """The groups a part runs on: one NCCL rank per GPU; with one GPU, NCCL at world size 1
    and gloo at world size 2 on the same GPU; on CPU, 2 gloo ranks."""
    if device == "cpu":
        return [Setup("gloo", 2, "cpu")]
    if gpus >= 2:
        return [Setup("nccl", gpus, "cuda")]
    return [Setup("nccl", 1, "cuda"), Setup("gloo", 2, "cuda")]


@dataclass
class Section:
    """One part's table. The last column of every row is its result: ``pass``, ``FAIL: ...``,
    ``not run: ...`` or a measurement."""

    part: str
    what: str
    header: tuple[str, ...]
    rows: list[tuple[str, ...]] = field(default_factory=list)

    def counts(self) -> dict[str, int]:
        found = {"pass": 0, "FAIL": 0, "not run": 0, "measured": 0}
        for row in self.rows:
            result = row[-1]
            key = next((k for k in ("pass", "FAIL", "not run") if result.startswith(k)), None)
            found[key or "measured"] += 1
        return found


def one_row(part: str, result: str) -> Section:
    """A part reduced to one row: why it did not run, or how it failed as a whole."""
    return Section(part, f"The {part} part.", ("setup", "result"), [("-", result)])


def render(sections: Sequence[Section], device: str, gpus: int, seconds: float) -> str:
    """The results file: what ran where, a summary per part, then each part's table."""
    names = [torch.cuda.get_device_name(i) for i in range(gpus)] if gpus else []
    title = "CPU (gloo): a check of the command, not GPU results" if device == "cpu" else "GPU"
    lines = [f"# distgrad on {title}", ""]
    if device == "cpu":
        lines += [
            "**CPU MODE.** Written by `python benchmarks/gpu_check.py --device cpu`: every part",
            "ran on gloo with CPU tensors at small sizes to prove the command's logic. Nothing",
            "here is a GPU result; `benchmarks/results/gpu_check.md` is what a GPU run writes.",
            "",
        ]
    when = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    lines += [
        f"* Run: {when}, {seconds:.0f} s; torch {torch.__version__}, Python "
        f"{platform.python_version()}, CUDA {torch.version.cuda or 'none'}",
        f"* Devices: {', '.join(names) if names else 'no CUDA device'}",
        "",
        "| part | pass | FAIL | not run | measured |",
        "| --- | --- | --- | --- | --- |",
    ]
    for s in sections:
        c = s.counts()
        lines.append(f"| {s.part} | {c['pass']} | {c['FAIL']} | {c['not run']} | {c['measured']} |")
    for s in sections:
        lines += ["", f"## {s.part}", "", s.what, "", _table(s.header, s.rows)]
    return "\n".join(lines) + "\n"


def _table(header: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    def cell(text: str) -> str:
        return text.replace("|", "\\|").replace("\n", " ")

    out = ["| " + " | ".join(header) + " |", "|" + " --- |" * len(header)]
    out += ["| " + " | ".join(cell(c) for c in row) + " |" for row in rows]
    return "\n".join(out)


def _bind(rank: int, device: str) -> torch.device:
    """This rank's device: its own GPU (ranks share GPUs when there are fewer), or the CPU."""
    if device == "cpu":
        return torch.device("cpu")
    index = rank % torch.cuda.device_count()
    torch.cuda.set_device(index)
    return torch.device("cuda", index)


# Where gloo's staging of a CUDA tensor through host memory copies (distgrad._exchange): a host
# synchronisation there is by design.
_STAGING_FILES = ("inflight.py", "pairs.py", "scatter.py")


def _in_staging(sync: str) -> bool:
    return any(f" at {name}:" in sync for name in _STAGING_FILES)


def _short(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}".splitlines()[0][:200]


def _failure(exc: BaseException | str, setup: Setup) -> str:
    """A row's result for an error: the rank's own error, not the launcher's wrapping; an
    error of gloo's with CUDA tensors is gloo's gap (``not run``), anything else a ``FAIL``."""
    text = exc if isinstance(exc, str) else str(exc)
    # The whole error, for the log; the row keeps its first line.
    print(f"--- {setup.label}:\n{text}", file=sys.stderr, flush=True)
    lines = [line.strip() for line in text.splitlines()]
    first = next((ln for ln in lines if "Error" in ln and "RankFailedError" not in ln), lines[0])
    if setup.backend == "gloo" and setup.device == "cuda" and "gloo" in text.lower():
        return f"not run: gloo does not take CUDA tensors here: {first[:200]}"
    return f"FAIL: {first[:200]}"


def _on_ranks(
    section: Section,
    setup: Setup,
    failed: tuple[str, ...],
    fn: Callable[..., Any],
    args: tuple[Any, ...],
    timeout: float,
    collective_timeout: float,
) -> list[Any] | None:
    """Every rank's ``fn(rank, n, *args)`` on ``setup``; or None, with a row saying how the
    ranks failed (``failed``: that row's cells between the setup and the result) added."""
    try:
        return run_on_ranks(
            fn, setup.world_size, args=args, backend=setup.backend, timeout=timeout,
            collective_timeout=collective_timeout,
        )  # fmt: skip
    except RankFailedError as exc:
        section.rows.append((setup.label, *failed, _failure(exc, setup)))
        return None


# ---------------------------------------------------------------------------------------------
# Part 1: the gradient sweep of every op


def _sweep(rank: int, n: int, device: str, op: str) -> list[tuple[str, int, str]]:
    """(dtype, cases passed, first failure) for every case of ``op`` in the reference sweep,
    past the checked calls, with and without the sizes given. An error that is not a wrong
    value (a backend that rejects the call) ends the op: its peers may be left mid-exchange."""
    _bind(rank, device)
    warm_up(device)
    chosen = [c for c in cases(n) + edge_cases(n) + replicated_cases(n) if c.op == op]
    found = []
    for dtype, async_op in ((torch.float64, False), (torch.float32, False), (torch.float64, True)):
        passed, first = 0, ""
        for case in chosen:
            for known in (False, True):
                try:
                    check_case(rank, n, case, dtype, device, known=known, async_op=async_op)
                    passed += 1
                except AssertionError as exc:
                    first = first or f"{case.kwargs} known={known}: {_short(exc)}"
                except Exception as exc:
                    traceback.print_exc()  # the whole error, for the log; the row has its head
                    found.append((str(dtype), passed, f"{case.kwargs}: {_short(exc)}"))
                    return found
        found.append((f"{dtype}{', async_op=True' if async_op else ''}", passed, first))
    return found


def part_gradients(device: str, gpus: int) -> Section:
    section = Section(
        "gradients",
        "Every case of the reference sweep (tests/collectives/reference.py: even and uneven "
        "sizes, several dims, every reduce op, prod with zeros, max/min with ties, the "
        "replicated objective), forward and input gradient against single-process autograd "
        "with a different random cotangent per rank, past the checked calls, with and without "
        "the sizes given; float64 once more with async_op=True (the result must still be in "
        "flight when the call returns). Tolerances: float64 rtol 1e-10, float32 rtol 1e-5.",
        ("setup", "op", "dtype", "cases", "result"),
    )
    for setup in setups(device, gpus):
        for op in OPS:
            count = 2 * sum(
                1
                for c in cases(setup.world_size)
                + edge_cases(setup.world_size)
                + replicated_cases(setup.world_size)
                if c.op == op
            )
            per_rank = _on_ranks(
                section,
                setup,
                (op, "-", f"-/{count}"),
                _sweep,
                (setup.device, op),
                timeout=120,
                collective_timeout=30,
            )
            if per_rank is None:
                continue
            for i, (dtype, _, _) in enumerate(per_rank[0]):
                worst = min(r[i][1] if i < len(r) else 0 for r in per_rank)
                firsts = [r[i][2] for r in per_rank if i < len(r) and r[i][2]]
                result = "pass" if worst == count and not firsts else _failure(firsts[0], setup)
                section.rows.append((setup.label, op, dtype, f"{worst}/{count}", result))
            if len(per_rank[0]) < 2:
                section.rows.append((setup.label, op, "torch.float32", "-", "not run: see above"))
    return section


# ---------------------------------------------------------------------------------------------
# Part 2: every loss and loss module against the float64 single-process loss


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
# tests/test_precision.py (bfloat16: the value to 1e-5 of the float64 loss of the same
# features, the gradients through the bfloat16 encoder to 2e-2 of the largest).
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
    where = _bind(rank, device)
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
    where = _bind(rank, device)
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
    per_rank = _on_ranks(
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


def part_losses(device: str, gpus: int) -> Section:
    section = Section(
        "losses",
        "Every loss function and loss module, dense and ring (`block_size=2`) paths, uneven "
        "rows (3 and 5 per rank, `sizes=` given), an `nn.Linear(6, 8)` encoder in float32, "
        "in float32 and under bfloat16 autocast. Reference: the float64 loss in one process "
        "on the whole batch, at the features the ranks computed, its gradient through a "
        "float64 copy of the encoder. Tolerances: float32 value and gradients 1e-5 relative "
        "(docs/losses.md); bfloat16 value 1e-5 relative (the loss computes in float32), "
        "gradients 2e-2 of the largest (tests/test_precision.py). Encoder gradients are "
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
        per_rank = _on_ranks(
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


# ---------------------------------------------------------------------------------------------
# The calls of a training step (parts 3 and 4): every op with its sizes given, every loss


Call = Callable[[Tensor], Tensor]


def step_calls(
    rank: int, n: int, where: torch.device, dtype: torch.dtype
) -> list[tuple[str, Call]]:
    """Every op and loss as a scalar function of this rank's ``x`` ([4, 8], on ``where``, of
    ``dtype``), each with every size given, so that past the checked calls none exchanges
    metadata."""
    ring = [(r + 1) % n for r in range(n)]
    gen = torch.Generator().manual_seed(7 + rank)
    weights = torch.randn(4 * n, 8, generator=gen, dtype=dtype).to(where)  # random cotangents

    def weighted(out: Tensor, x: Tensor) -> Tensor:
        return (out * weights[: out.shape[0], : out.shape[1]]).sum()

    L = dg.losses
    sizes = [4] * n
    ops: list[tuple[str, Call]] = [
        ("all_gather", lambda x: weighted(dg.all_gather(x, sizes=sizes), x)),
        ("reduce_scatter", lambda x: weighted(dg.reduce_scatter(x.repeat(n, 1)), x)),
        ("all_reduce sum", lambda x: weighted(dg.all_reduce(x), x)),
        ("all_reduce max", lambda x: weighted(dg.all_reduce(x, "max"), x)),
        ("all_reduce prod", lambda x: weighted(dg.all_reduce(x, "prod"), x)),
        ("all_to_all", lambda x: weighted(dg.all_to_all(x.repeat(n, 1)), x)),
        ("broadcast", lambda x: weighted(dg.broadcast(x, n - 1), x)),
        ("reduce", lambda x: weighted(dg.reduce(x, 0), x)),
        ("gather", lambda x: weighted(dg.gather(x, 0, sizes=sizes), x)),
        (
            "scatter",
            lambda x: weighted(dg.scatter(x.repeat(n, 1) if rank == 0 else x, 0, sizes=sizes), x),
        ),
        ("permute", lambda x: weighted(dg.permute(x, ring, recv_shape=(4, 8)), x)),
    ]
    clip = L.CLIPLoss(10.0).to(where, dtype)
    siglip = L.SigLIPLoss(block_size=3).to(where, dtype)

    def pair(x: Tensor) -> tuple[Tensor, Tensor]:
        return x, x.flip(0) + weights[:4]

    losses: list[tuple[str, Call]] = [
        ("info_nce", lambda x: L.info_nce(*pair(x), sizes=sizes)),
        ("info_nce ring", lambda x: L.info_nce(*pair(x), sizes=sizes, block_size=3)),
        ("nt_xent", lambda x: L.nt_xent(*pair(x), temperature=0.3, sizes=sizes)),
        ("nt_xent ring", lambda x: L.nt_xent(*pair(x), sizes=sizes, block_size=3)),
        ("clip_loss", lambda x: L.clip_loss(*pair(x), 10.0, sizes=sizes)),
        ("clip_loss ring", lambda x: L.clip_loss(*pair(x), sizes=sizes, block_size=2)),
        ("siglip_loss", lambda x: L.siglip_loss(*pair(x), sizes=sizes)),
        ("barlow_twins", lambda x: L.barlow_twins(*pair(x), sizes=sizes)),
        ("CLIPLoss", lambda x: clip(*pair(x), sizes=sizes)),
        ("SigLIPLoss ring", lambda x: siglip(*pair(x), sizes=sizes)),
    ]
    return ops + losses


def _leaf(rank: int, where: torch.device, dtype: torch.dtype, seed: int) -> Tensor:
    gen = torch.Generator().manual_seed(seed * 100 + rank)
    return torch.randn(4, 8, generator=gen, dtype=dtype).to(where).requires_grad_()


# ---------------------------------------------------------------------------------------------
# Part 3: no host synchronisation past the checked calls


def _watched(rank: int, n: int, device: str) -> list[tuple[str, str]]:
    """Each call's host synchronisations (``warn`` mode, so every one is listed and no rank is
    left alone in an exchange), then a training step under ``error`` mode."""
    where = _bind(rank, device)
    watch = where.type == "cuda"
    calls = step_calls(rank, n, where, torch.float32)
    warm_up(device)
    for _, call in calls:  # also warms the allocator and lazy initialisation
        call(_leaf(rank, where, torch.float32, 0)).backward()
    found = []
    for name, call in calls:
        x = _leaf(rank, where, torch.float32, 1)
        syncs: list[str] = []
        with warnings.catch_warnings():
            warnings.simplefilter("always")
            warnings.showwarning = _sync_recorder(syncs)
            if watch:
                torch.cuda.set_sync_debug_mode("warn")
            try:
                call(x).backward()
            finally:
                if watch:
                    torch.cuda.set_sync_debug_mode("default")
        found.append((name, "; ".join(syncs)))
    # On gloo every exchange of a CUDA tensor is staged through host memory
    # (distgrad._exchange.inflight), a synchronisation by design, so the step is run there
    # unwatched.
    staged = dist.get_backend() == "gloo"
    step = _training_step(rank, n, where, watch and not staged)
    found.append(("training step (error mode)", step))
    return found


def _sync_recorder(syncs: list[str]) -> Callable[..., None]:
    """A ``warnings.showwarning`` that lists each host synchronisation the CUDA sync debug mode
    reports, with the Python line that made it: the innermost frame of distgrad's own code,
    else of the caller (the warning's own text names only torch's C++ helper). The notice that
    the debug mode is a prototype is not a synchronisation and is left out."""

    def record(message: Warning | str, *_: Any, **__: Any) -> None:
        text = str(message)
        if "synchroniz" not in text or "prototype" in text:
            return
        frames = traceback.extract_stack()[:-1]
        ours = [f for f in frames if "distgrad" in f.filename and "gpu_check" not in f.filename]
        at = (ours or frames)[-1]
        where = f"{Path(at.filename).name}:{at.lineno} ({at.name}: {(at.line or '').strip()})"
        syncs.append(f"{text.splitlines()[0][:60]} at {where}")

    return record


def _training_step(rank: int, n: int, where: torch.device, watch: bool) -> str:
    """An encoder, a CLIP loss module (dense) and a ring InfoNCE, backward and an SGD step,
    under ``set_sync_debug_mode("error")``: '' or the error."""
    torch.manual_seed(0)
    encoder, clip = nn.Linear(8, 8).to(where), dg.losses.CLIPLoss(10.0).to(where)
    params = [*encoder.parameters(), *clip.parameters()]
    optimizer = torch.optim.SGD(params, lr=0.1)
    sizes = [4] * n
    for step in range(2):  # the first step warms the optimizer's lazy state
        a, b = _leaf(rank, where, torch.float32, 2 + step), _leaf(rank, where, torch.float32, 9)
        if watch and step == 1:
            torch.cuda.set_sync_debug_mode("error")
        try:
            za, zb = encoder(a), encoder(b)
            loss = clip(za, zb, sizes=sizes) + dg.losses.info_nce(za, zb, sizes=sizes, block_size=3)
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
        except RuntimeError as exc:
            frames = traceback.extract_tb(exc.__traceback__)
            ours = [f for f in frames if "distgrad" in f.filename and "gpu_check" not in f.filename]
            at = (ours or frames)[-1]
            return f"{_short(exc)[:80]} at {Path(at.filename).name}:{at.lineno} ({at.name})"
        finally:
            if watch:
                torch.cuda.set_sync_debug_mode("default")
    return ""


def part_sync(device: str, gpus: int) -> Section:
    watched = device == "cuda"
    section = Section(
        "sync",
        "Every op and loss of a training step, each past the checked calls with its sizes "
        'given, forward and backward, under `torch.cuda.set_sync_debug_mode("warn")`: each '
        "host synchronisation is listed. Then a training step (encoder, CLIPLoss, ring "
        'InfoNCE, backward, SGD step) under `"error"` after one warm-up step. On gloo, '
        "distgrad stages every exchange of a CUDA tensor through host memory (gloo's own CUDA "
        "paths copy too, and its point-to-point sends take none): those copies synchronise by "
        "design, and a row passes when every synchronisation it saw is one of them."
        + (
            ""
            if watched
            else " On CPU there is no synchronisation to detect: the calls ran unwatched, which"
            " proves the step's logic only."
        ),
        ("setup", "call", "result"),
    )
    for setup in setups(device, gpus):
        per_rank = _on_ranks(
            section,
            setup,
            ("every call",),
            _watched,
            (setup.device,),
            timeout=120,
            collective_timeout=30,
        )
        if per_rank is None:
            continue
        staged = setup.backend == "gloo"  # CUDA tensors cross gloo through host memory
        for i, (name, _) in enumerate(per_rank[0]):
            seen = sorted({r[i][1] for r in per_rank if r[i][1]})
            syncs = [one for found in seen for one in found.split("; ")]
            if not watched:
                result = "not run: no CUDA device (the call ran on CPU, unwatched)"
            elif staged and name.startswith("training step"):
                result = "pass (unwatched: gloo stages every exchange through host memory)"
            elif staged and syncs and all(_in_staging(one) for one in syncs):
                result = (
                    f"pass ({len(syncs)} host synchronisations, each a copy of gloo's staging "
                    "through host memory, by design)"
                )
            else:
                result = f"FAIL: host synchronisation: {' / '.join(seen)}" if seen else "pass"
            section.rows.append((setup.label, name, result))
    return section


# ---------------------------------------------------------------------------------------------
# Part 4: the compiled step


def _compiled(rank: int, n: int, device: str, backend: str) -> tuple[int, int, list[str], str]:
    """(graphs, breaks, break reasons, '' or the first mismatch) of every call in one step
    under ``torch.compile(fullgraph=True)``, against the eager step, float64."""
    where = _bind(rank, device)
    calls = step_calls(rank, n, where, torch.float64)
    warm_up(device)

    def step(x: Tensor) -> Tensor:
        return sum(
            (call(x) * (i + 1) for i, (_, call) in enumerate(calls)),
            torch.zeros((), device=x.device, dtype=x.dtype),
        )

    x = _leaf(rank, where, torch.float64, 3)
    explained = torch._dynamo.explain(step)(x)
    reasons = [str(r.reason)[:200] for r in explained.break_reasons]
    torch._dynamo.reset()
    compiled = torch.compile(step, fullgraph=True, backend=backend)
    for seed in (4, 5):
        x = _leaf(rank, where, torch.float64, seed)
        want = step(x)
        (want_grad,) = torch.autograd.grad(want, x)
        got = compiled(x)
        (got_grad,) = torch.autograd.grad(got, x)
        for g, w, what in ((got, want, "loss"), (got_grad, want_grad, "gradient")):
            try:  # the compiler fuses and reorders arithmetic: 1e-9 relative in float64
                torch.testing.assert_close(g, w, rtol=1e-9, atol=1e-9)
            except AssertionError as exc:
                return (
                    explained.graph_count,
                    explained.graph_break_count,
                    reasons,
                    f"{what}: {_short(exc)}",
                )
    return explained.graph_count, explained.graph_break_count, reasons, ""


def part_compile(device: str, gpus: int) -> Section:
    # inductor compiles C++ for a CPU graph (60-100 s per step on 2 cores, tests/compile);
    # aot_eager traces the same graph with AOT autograd and proves the logic in seconds.
    backend = "inductor" if device == "cuda" else "aot_eager"
    section = Section(
        "compile",
        f"Every op and loss of `sync`'s step summed in one function, `torch.compile("
        f'fullgraph=True, backend="{backend}")`, float64: `torch._dynamo.explain` must count '
        "one graph and no break, and two steps on fresh data must give eager's loss and "
        "gradient (1e-9 relative: the compiler reorders arithmetic)."
        + ("" if device == "cuda" else " CPU mode uses aot_eager, not inductor."),
        ("setup", "backend", "graphs", "breaks", "result"),
    )
    setup = setups(device, gpus)[0]
    per_rank = _on_ranks(
        section,
        setup,
        (backend, "-", "-"),
        _compiled,
        (setup.device, backend),
        timeout=400,
        collective_timeout=120,
    )
    if per_rank is None:
        return section
    graphs, breaks, reasons, _ = per_rank[0]
    if (graphs, breaks) != (1, 0):
        result = f"FAIL: {graphs} graphs, {breaks} breaks: {'; '.join(reasons)}"
    else:
        result = next((f"FAIL: rank {r}: {m[3]}" for r, m in enumerate(per_rank) if m[3]), "pass")
    section.rows.append((setup.label, backend, str(graphs), str(breaks), result))
    return section


# ---------------------------------------------------------------------------------------------
# Part 5: peak memory of the dense and ring contrastive loss


def _peak(
    rank: int, n: int, device: str, batches: list[int], dim: int
) -> list[tuple[int, str, float]]:
    """(global batch, path, peak MiB above the inputs) of CLIP's loss, forward and backward."""
    where = _bind(rank, device)
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


def _guard_rows(rank: int, n: int, device: str) -> list[tuple[str, str]]:
    """The data guard (distgrad._exchange.guard) on this device: guarded exchanges of every
    kind under the strictest sync debug mode, then a mismatched tag, which on CUDA must be
    raised at the next guarded call and not before (no host synchronisation), and on CPU at
    once."""
    where = _bind(rank, device)
    dg.set_guard(True)  # opt-in
    group = resolve(None, "gpu_check")
    x = _leaf(rank, where, torch.float32, 3).detach()
    watch = where.type == "cuda"
    rows = []
    strict = "error" if watch else "default"

    def exchanges() -> None:
        for op in ("sum", "max", "min"):
            ops.all_reduce.run(x, op, group)
        each = [x.shape[0]] * n
        ops.reduce.run(x, 0, group)
        ops.broadcast.run(x, 0, group)
        ops.all_gather.run(x, each, group)
        ops.all_to_all.run(x.repeat(n, 1), each, each, group)
        ops.gather.run(x, each, 0, group)
        whole = x.repeat(n, 1) if group.rank == 0 else None
        ops.scatter.run(whole, each, 0, x.shape[1:], x.dtype, x.device, group)
        ops.permute.run(x, [(r + 1) % n for r in range(n)], x.shape, group)

    exchanges()  # warm: the tag tensors are made (and copied to the device) once
    try:
        if watch:
            torch.cuda.set_sync_debug_mode(strict)
        exchanges()
        if watch:
            torch.cuda.synchronize()
        _guard.raise_pending(group)
        rows.append(("matching calls: no synchronisation, no false alarm", "pass"))
    except RuntimeError as exc:
        rows.append(("matching calls: no synchronisation, no false alarm", f"FAIL: {_short(exc)}"))
    finally:
        if watch:
            torch.cuda.set_sync_debug_mode("default")
    tag = _guard.reduced_tag(group, "all_reduce", x, "sum")
    assert tag is not None
    wrong = _guard.tag_tensor(tag, x.dtype, where) * (n + 1)  # no group of n sums to this
    name = "a mismatched tag: raised at the next guarded call (CUDA) or at once (CPU)"
    try:
        if watch:
            torch.cuda.set_sync_debug_mode(strict)
        _guard.check(wrong, tag, group, n)
        if not watch:
            rows.append((name, "FAIL: a CPU check returned on a mismatched tag"))
            return rows
        torch.cuda.set_sync_debug_mode("default")
        torch.cuda.synchronize()  # the verdict has landed; the next guarded call reads it
        ops.all_reduce.run(x, "sum", group)
        rows.append((name, "FAIL: the next guarded call did not raise"))
    except CollectiveMismatchError as exc:
        late = "earlier exchange" in str(exc)
        ok = late == watch
        rows.append((name, ("pass" if ok else "FAIL: raised at the wrong time") + f": {exc}"[:160]))
    except RuntimeError as exc:
        rows.append((name, f"FAIL: {_short(exc)}"))
    finally:
        if watch:
            torch.cuda.set_sync_debug_mode("default")
    return rows


def part_guard(device: str, gpus: int) -> Section:
    section = Section(
        "guard",
        'The data guard (docs/semantics.md, "The data guard"): guarded exchanges of every '
        "kind (distgrad._exchange.ops' all_reduce sum/max/min, reduce, broadcast, all_gather, "
        "all_to_all, gather, scatter, permute) under "
        '`torch.cuda.set_sync_debug_mode("error")`, with no false alarm; then a mismatched tag: '
        "on CUDA it must be queued without a host synchronisation and raised as the next "
        "guarded call on the group begins, on CPU at once. The first setup only (on one GPU, "
        "NCCL at world size 1: the tags are checked though nothing crosses a link).",
        ("setup", "check", "result"),
    )
    setup = setups(device, gpus)[0]
    per_rank = _on_ranks(
        section,
        setup,
        ("every check",),
        _guard_rows,
        (setup.device,),
        timeout=120,
        collective_timeout=30,
    )
    if per_rank is None:
        return section
    for name, result in per_rank[0]:
        section.rows.append((setup.label, name, result))
    return section


def part_memory(device: str, gpus: int) -> Section:
    batches, dim = ([16384, 32768], 512) if device == "cuda" else ([256, 512], 32)
    section = Section(
        "memory",
        f"Peak GPU memory per rank (`torch.cuda.max_memory_allocated` above the inputs) of "
        f"one forward+backward of `clip_loss`, dim {dim}, float32: the dense path and the "
        "ring path (`block_size=1024`).",
        ("setup", "global batch", "path", "peak MiB per rank"),
    )
    setup = setups(device, gpus)[0]
    per_rank = _on_ranks(
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


# ---------------------------------------------------------------------------------------------
# Part 6: forward+backward time against torch's collectives and funcol


# torch 2.13 renamed these (the old names warn); older releases have only the old names.
_ALL_GATHER = getattr(dist, "all_gather_single", dist.all_gather_into_tensor)
_REDUCE_SCATTER = getattr(dist, "reduce_scatter_single", dist.reduce_scatter_tensor)


def _c10d(op: str, x: Tensor, n: int, rank: int) -> None:
    """The exchanges of ``op``'s forward and backward with torch's c10d collectives, no
    autograd: the floor distgrad's ops are compared with."""
    nccl = dist.get_backend() == "nccl"

    def scatter_reduce(big: Tensor) -> Tensor:  # gloo has no reduce_scatter
        out = big.new_empty(big.shape[0] // n, *big.shape[1:])
        if nccl:
            _REDUCE_SCATTER(out, big)
            return out
        summed = big.clone()
        dist.all_reduce(summed)
        return summed[rank * out.shape[0] : (rank + 1) * out.shape[0]]

    def gather_all(small: Tensor) -> Tensor:
        out = small.new_empty(small.shape[0] * n, *small.shape[1:])
        _ALL_GATHER(out, small)
        return out

    if op in ("all_gather", "reduce_scatter"):
        y = gather_all(x) if op == "all_gather" else scatter_reduce(x)
        gather_all(y) if op == "reduce_scatter" else scatter_reduce(y)
    elif op == "all_reduce":
        for _ in range(2):
            dist.all_reduce(x.clone())
    elif op == "all_to_all":
        for _ in range(2):
            dist.all_to_all_single(torch.empty_like(x), x)
    elif op in ("broadcast", "reduce"):
        first, second = (
            (dist.broadcast, dist.reduce) if op == "broadcast" else (dist.reduce, dist.broadcast)
        )
        first(x.clone(), 0)
        second(x.clone(), 0)
    elif op in ("gather", "scatter"):  # a gather and a scatter of one rank's part, in order
        part = x[: x.shape[0] // n] if op == "scatter" else x
        parts = [torch.empty_like(part) for _ in range(n)] if rank == 0 else None
        pieces = list(part.repeat(n, 1).chunk(n)) if rank == 0 else None
        if op == "gather":
            dist.gather(part, parts, 0)
            dist.scatter(torch.empty_like(part), pieces, 0)
        else:
            dist.scatter(torch.empty_like(part), pieces, 0)
            dist.gather(part, parts, 0)
    elif op == "permute" and n > 1:
        for _ in range(2):
            got = torch.empty_like(x)
            ops = [
                dist.P2POp(dist.isend, x, (rank + 1) % n),
                dist.P2POp(dist.irecv, got, (rank - 1) % n),
            ]
            for work in dist.batch_isend_irecv(ops):
                work.wait()


def _distgrad(op: str, x: Tensor, n: int, rank: int) -> Tensor:
    sizes = [x.shape[0]] * n
    if op == "all_gather":
        return dg.all_gather(x, sizes=sizes)
    if op == "reduce_scatter":
        return dg.reduce_scatter(x)
    if op == "all_reduce":
        return dg.all_reduce(x)
    if op == "all_to_all":
        return dg.all_to_all(x)
    if op == "broadcast":
        return dg.broadcast(x, 0)
    if op == "reduce":
        return dg.reduce(x, 0)
    if op == "gather":
        return dg.gather(x, 0, sizes=sizes)
    if op == "scatter":
        part = x.shape[0] // n
        mine = x if rank == 0 else x[:part]
        return dg.scatter(mine, 0, sizes=[part] * n)
    return dg.permute(x, [(r + 1) % n for r in range(n)], recv_shape=tuple(x.shape))


def _funcol(op: str, x: Tensor, n: int) -> Tensor | None:
    """funcol's differentiable collective for ``op``, where it has one."""
    import torch.distributed._functional_collectives as funcol

    group = dist.group.WORLD
    assert group is not None
    # torch 2.13's names; the older ones (still there, warning) on earlier releases.
    if op == "all_gather":
        gather = getattr(funcol, "all_gather_single_autograd", None)
        return (gather or funcol.all_gather_tensor_autograd)(x, 0, group)
    if op == "reduce_scatter":
        scatter = getattr(funcol, "reduce_scatter_single_autograd", None)
        return (scatter or funcol.reduce_scatter_tensor_autograd)(x, "sum", 0, group)
    if op == "all_reduce":
        return funcol.all_reduce(x, "sum", group)  # differentiable for "sum" only
    if op == "all_to_all":
        return funcol.all_to_all_single_autograd(x, None, None, group)
    return None


FUNCOL_OPS = ("all_gather", "reduce_scatter", "all_reduce", "all_to_all")


def _timed(step: Callable[[], None], where: torch.device) -> float:
    if where.type == "cuda":
        torch.cuda.synchronize()
    start = time.perf_counter()
    step()
    if where.type == "cuda":
        torch.cuda.synchronize()
    return time.perf_counter() - start


def _times(
    rank: int, n: int, device: str, shapes: list[tuple[int, int]], rounds: list[int]
) -> list[tuple[str, str, str, float, float, float]]:
    """(op, shape, variant, median ms, paired ratio to c10d, its spread) per op, shape and
    variant; each round runs every variant once in a shuffled order, from a barrier; a
    variant's time in a round is the slower rank's."""
    where = _bind(rank, device)
    warm_up(device)
    order = random.Random(0)  # the same shuffle on every rank: they must call alike
    found = []
    for shape, count in zip(shapes, rounds, strict=True):
        for op in OPS:
            rows = shape[0] * (n if op in ("reduce_scatter", "all_to_all", "scatter") else 1)
            x = torch.randn(rows, shape[1], device=where)
            leaf = x.clone().requires_grad_()  # autograd's variants; c10d's gets no graph
            out_shape = tuple(_distgrad(op, leaf, n, rank).shape)
            variants: dict[str, Callable[[], None]] = {
                "c10d": lambda op=op, x=x: _c10d(op, x, n, rank),
                "distgrad": lambda op=op, x=leaf: _backward(_distgrad(op, x, n, rank)),
                "autograd floor": lambda x=leaf, s=out_shape: _backward(_Floor.apply(x, s)),
            }
            if op in FUNCOL_OPS:
                variants["funcol"] = lambda op=op, x=leaf: _backward(_funcol(op, x, n))
            names = list(variants)
            for name in names:  # warm-up
                variants[name]()
            times = torch.zeros(count, len(names), dtype=torch.float64)
            for i in range(count):
                picked = names[:]
                order.shuffle(picked)
                for name in picked:
                    dist.barrier()
                    times[i, names.index(name)] = _timed(variants[name], where)
            slowest = times.to(where)
            dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
            slowest = slowest.cpu()
            base = slowest[:, names.index("c10d")]
            for j, name in enumerate(names):
                ratios = (slowest[:, j] / base).tolist()
                q = statistics.quantiles(ratios, n=4) if len(ratios) > 1 else [ratios[0]] * 3
                found.append(
                    (
                        op,
                        f"{shape}",
                        name,
                        1e3 * float(slowest[:, j].median()),
                        statistics.median(ratios),
                        q[2] - q[0],
                    )
                )
    return found


class _Floor(torch.autograd.Function):
    """The autograd floor: a local Function with distgrad's output shape and no communication
    (forward and backward each allocate their result), through the same ``apply`` a user's
    Function pays. distgrad's time over this one is what its own code costs per call."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, shape: tuple[int, ...]) -> Tensor:
        ctx.like = (x.shape, x.dtype, x.device)
        return x.new_empty(shape)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None]:
        shape, dtype, device = ctx.like
        return torch.empty(shape, dtype=dtype, device=device), None


def _backward(out: Tensor | None) -> None:
    assert out is not None
    out = out.wait() if hasattr(out, "wait") else out  # funcol's output is asynchronous
    out.backward(torch.ones_like(out))


def part_timing(device: str, gpus: int) -> Section:
    if device == "cuda":
        shapes, rounds = [(256, 128), (4096, 512), (16384, 1024)], [50, 30, 15]
    else:
        shapes, rounds = [(16, 8), (64, 16), (256, 32)], [2, 2, 2]
    setup = setups(device, gpus)[0]
    one_gpu = ": one GPU, so no data moves between GPUs" if gpus == 1 else ""
    section = Section(
        "timing",
        f"Forward+backward time of every op ({setup.label}{one_gpu}), "
        f"float32 [rows, cols] per rank at {', '.join(map(str, shapes))}, against torch's c10d "
        "collectives doing the same forward and backward exchanges without autograd (on "
        "world size 1 most are copies), the autograd floor (a local autograd Function with the "
        "op's output shape and no communication: what any differentiable call costs; distgrad's "
        "target is this plus 10 us) and funcol's `*_autograd` collectives where funcol has "
        "one. Each round runs every variant once, shuffled, from a barrier; a time "
        f"is the slower rank's; {rounds} rounds. Ratio: the median over rounds of the "
        "variant's time over c10d's in the same round (paired), with its interquartile range."
        + ("" if device == "cuda" else " CPU mode: tiny sizes and 2 rounds, no meaning as speed."),
        ("setup", "op", "shape", "variant", "median ms", "ratio to c10d (IQR)"),
    )
    per_rank = _on_ranks(
        section,
        setup,
        ("every op", "-", "-", "-"),
        _times,
        (setup.device, shapes, rounds),
        timeout=400,
        collective_timeout=120,
    )
    if per_rank is None:
        return section
    for op, shape, name, ms, ratio, spread in per_rank[0]:
        section.rows.append(
            (setup.label, op, shape, name, f"{ms:.3f}", f"{ratio:.2f}x ({spread:.2f})")
        )
    return section


# ---------------------------------------------------------------------------------------------
# The command


RUNNERS: dict[str, Callable[[str, int], Section]] = {
    "gradients": part_gradients,
    "losses": part_losses,
    "sync": part_sync,
    "guard": part_guard,
    "compile": part_compile,
    "memory": part_memory,
    "timing": part_timing,
}


def run(
    device: str, parts: Sequence[str], on_part: Callable[[list[Section]], None] | None = None
) -> list[Section]:
    """Every chosen part; a part that cannot run here, or fails outright, is a row saying so.
    ``on_part`` sees the sections so far after each part: the results file is rewritten then, so
    a run cut off by a machine's time limit still leaves what it measured."""
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    sections: list[Section] = []
    for part in parts:
        started = time.monotonic()
        if device == "cuda" and gpus == 0:
            sections.append(one_row(part, "not run: no CUDA device (torch.cuda is not available)"))
            continue
        try:
            sections.append(RUNNERS[part](device, gpus))
        except Exception as exc:  # the other parts still run and the file is still written
            traceback.print_exc()
            sections.append(one_row(part, f"FAIL: the part itself failed: {_short(exc)}"))
        print(f"{part}: {time.monotonic() - started:.1f} s", flush=True)
        if on_part is not None:
            on_part(sections)
    return sections


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    parser.add_argument(
        "--parts", default=",".join(PARTS), help=f"comma-separated: {','.join(PARTS)}"
    )
    parser.add_argument(
        "--out",
        type=Path,
        default=None,
        help="results file (default: results/gpu_check.md, or gpu_check_cpu.md with --device cpu)",
    )
    args = parser.parse_args(argv)
    parts = [p for p in args.parts.split(",") if p]
    unknown = sorted(set(parts) - set(PARTS))
    if unknown:
        parser.error(f"unknown parts {unknown}; choose from {','.join(PARTS)}")
    out = args.out or RESULTS / ("gpu_check.md" if args.device == "cuda" else "gpu_check_cpu.md")
    started = time.monotonic()
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0

    def write(sections: list[Section]) -> None:
        out.write_text(render(sections, args.device, gpus, time.monotonic() - started))

    sections = run(args.device, parts, on_part=write)
    write(sections)
    print(f"wrote {out}")
    failed = sum(s.counts()["FAIL"] for s in sections)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
