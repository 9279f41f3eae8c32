"""Part ``sync``: no host synchronisation past the checked calls."""

from __future__ import annotations

import os
import traceback
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from tests.collectives.reference import warm_up
from torch import nn

import distgrad as dg

from .ranks import bind, on_ranks, setups, short
from .report import Section
from .step import leaf, step_calls

# Where gloo's staging of a CUDA tensor through host memory copies (distgrad._exchange): a host
# synchronisation there is by design.
_STAGING_FILES = ("inflight.py", "pairs.py", "scatter.py")


def _in_staging(sync: str) -> bool:
    return any(f" at {name}:" in sync for name in _STAGING_FILES)


# benchmarks/, where this check's own code lives: in a checkout named "distgrad" its paths hold
# that word too, and a synchronisation is never reported at one of its lines.
_BENCHMARKS = os.path.dirname(os.path.dirname(os.path.realpath(__file__)))


def _distgrad_s(frames: list[traceback.FrameSummary]) -> list[traceback.FrameSummary]:
    """The frames of distgrad's own code, not of this check."""
    return [
        f
        for f in frames
        if "distgrad" in f.filename
        and not os.path.realpath(f.filename).startswith(_BENCHMARKS + os.sep)
    ]


def _watched(rank: int, n: int, device: str) -> list[tuple[str, str]]:
    """Each call's host synchronisations (``warn`` mode, so every one is listed and no rank is
    left alone in an exchange), then a training step under ``error`` mode."""
    where = bind(rank, device)
    watch = where.type == "cuda"
    calls = step_calls(rank, n, where, torch.float32)
    warm_up(device)
    for _, call in calls:  # also warms the allocator and lazy initialisation
        call(leaf(rank, where, torch.float32, 0)).backward()
    found = []
    for name, call in calls:
        x = leaf(rank, where, torch.float32, 1)
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
        at = (_distgrad_s(frames) or frames)[-1]
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
        a, b = leaf(rank, where, torch.float32, 2 + step), leaf(rank, where, torch.float32, 9)
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
            at = (_distgrad_s(frames) or frames)[-1]
            return f"{short(exc)[:80]} at {Path(at.filename).name}:{at.lineno} ({at.name})"
        finally:
            if watch:
                torch.cuda.set_sync_debug_mode("default")
    return ""


def part(device: str, gpus: int) -> Section:
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
        per_rank = on_ranks(
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
