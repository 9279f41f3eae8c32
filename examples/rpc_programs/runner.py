"""Run one program in one mode on fresh processes, and compare two runs step by step, bit
for bit.

Each run gets its own processes: re-initialising torch's RPC in a process after a program
that passed RRefs around hung in torch's ``shutdown`` (the next program's barrier) here."""

from __future__ import annotations

import importlib
import tempfile
from typing import Any

import torch
from examples.rpc_programs import AUTOGRAD_PROGRAMS, PROGRAMS
from examples.rpc_programs._api import Result

from distgrad.testing import run_on_ranks

WORLD_SIZE = 3  # worker0, worker1, worker2 (rnn leaves worker2 idle)


def modes_for(name: str) -> tuple[str, ...]:
    """SMART differs from FAST only where distributed autograd runs."""
    return ("torch", "fast", "smart") if name in AUTOGRAD_PROGRAMS else ("torch", "fast")


def launch(name: str, mode: str, timeout: float = 60.0) -> list[Result]:
    """Every rank's Result of program ``name`` run with ``mode``'s modules; every process
    must exit 0 (``run_on_ranks`` checks)."""
    assert name in PROGRAMS, name
    program = importlib.import_module(f"examples.rpc_programs.{name}")
    with tempfile.TemporaryDirectory() as folder:
        return run_on_ranks(  # type: ignore[no-any-return]
            program.run, WORLD_SIZE, args=(mode, folder), init="none", timeout=timeout
        )


def differences(want: list[Result], got: list[Result]) -> list[str]:
    """Where two runs of one program differ (every rank, every step, every value)."""
    found = []
    for rank, (a, b) in enumerate(zip(want, got, strict=True)):
        if len(a.steps) != len(b.steps):
            found.append(f"rank {rank}: {len(a.steps)} steps against {len(b.steps)}")
        for step, (sa, sb) in enumerate(zip(a.steps, b.steps, strict=False)):
            for key in sa:
                if not _equal(sa[key], sb.get(key)):
                    found.append(f"rank {rank}, step {step}: {key} differs")
    return found


def _equal(a: Any, b: Any) -> bool:
    if isinstance(a, list):
        return isinstance(b, list) and len(a) == len(b) and all(map(_equal, a, b))
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and bool(torch.equal(a, b))
    return bool(a == b)
