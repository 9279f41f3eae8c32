"""The README's example, executed as written: run as the script it says to save, and its
promise about DDP averaging.

Semantics asserted: the example, saved to a file and run with ``python``, exits 0 and prints the
checker's AGREE. Each rank back-propagates its local-mean InfoNCE over gathered keys; the
gradients of the local queries and keys, averaged over ranks as DDP averages parameter
gradients (here: scaled by 1/N, since every input row lives on exactly one rank), equal the
single-process gradient of the loss on the full batch. float64, tolerance 1e-12.
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import torch

from distgrad.testing import run_on_ranks
from tests._support import FLOAT64_ROUNDING, seeded

README = Path(__file__).resolve().parents[1] / "README.md"
B_LOCAL, DIM = 3, 5


def _example() -> str:
    """The README's first python block: the example."""
    block = re.search(r"```python\n(.*?)```", README.read_text(), re.S)
    assert block is not None, "README has no python example"
    return block.group(1)


def _example_namespace() -> dict[str, Any]:
    namespace: dict[str, Any] = {}  # __name__ is not "__main__" here: the guarded part is skipped
    exec(_example(), namespace)
    return namespace


def test_readme_example_runs_as_shown_and_the_checker_agrees(tmp_path: Path) -> None:
    script = tmp_path / "check_info_nce.py"
    script.write_text(_example())
    result = subprocess.run(
        [sys.executable, str(script)], capture_output=True, text=True, timeout=180, cwd=tmp_path
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert "distgrad check on 2 ranks, gradients averaged over ranks: AGREE" in result.stdout


def _data(world_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = seeded(7)
    q = torch.randn(world_size * B_LOCAL, DIM, dtype=torch.float64, generator=gen)
    k = torch.randn(world_size * B_LOCAL, DIM, dtype=torch.float64, generator=gen)
    return q, k


def _distributed(rank: int, world_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    info_nce = _example_namespace()["info_nce"]
    q, k = _data(world_size)
    rows = slice(rank * B_LOCAL, (rank + 1) * B_LOCAL)
    q_local = q[rows].clone().requires_grad_()
    k_local = k[rows].clone().requires_grad_()
    info_nce(q_local, k_local).backward()
    assert q_local.grad is not None and k_local.grad is not None
    return q_local.grad / world_size, k_local.grad / world_size


def test_readme_example_gives_the_single_process_gradient_under_ddp_averaging() -> None:
    world_size = 2
    info_nce = _example_namespace()["info_nce"]
    q, k = _data(world_size)
    q.requires_grad_()
    k.requires_grad_()
    info_nce(q, k).backward()
    results = run_on_ranks(_distributed, world_size)
    for rank, (gq, gk) in enumerate(results):
        rows = slice(rank * B_LOCAL, (rank + 1) * B_LOCAL)
        torch.testing.assert_close(gq, q.grad[rows], **FLOAT64_ROUNDING)
        torch.testing.assert_close(gk, k.grad[rows], **FLOAT64_ROUNDING)
