"""Where a part's ranks run (a ``Setup``: backend, world size, device), and the row a part
writes when its ranks fail."""

from __future__ import annotations

import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from distgrad.errors import RankFailedError
from distgrad.testing import run_on_ranks

from .report import Section


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


def bind(rank: int, device: str) -> torch.device:
    """This rank's device: its own GPU (ranks share GPUs when there are fewer), or the CPU."""
    if device == "cpu":
        return torch.device("cpu")
    index = rank % torch.cuda.device_count()
    torch.cuda.set_device(index)
    return torch.device("cuda", index)


def short(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}".splitlines()[0][:200]


def failure(exc: BaseException | str, setup: Setup) -> str:
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


def on_ranks(
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
        section.rows.append((setup.label, *failed, failure(exc, setup)))
        return None
