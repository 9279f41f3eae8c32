"""``benchmarks/ring_overlap.py`` and ``benchmarks/loss_memory.py`` keep running between the
times someone measures with them.

Semantics asserted: ``--quick`` runs each for real (gloo ranks started by ``run_on_ranks``):
ring_overlap first checks that its hand-written overlapped and serial loops bring home the
same accumulators as distgrad's (an assertion inside each rank) and then prints a row for
each of the six ring loops with all four forms measured; loss_memory prints a row per loss
whose constant is the same at every B_local and whose real and fake peaks agree. Neither
writes a results file. No timing is asserted.
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
LOOPS = ("loss fwd", "loss bwd", "clip fwd", "clip bwd", "attention fwd", "attention bwd")


def _quick(script: str) -> str:
    done = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / script), "--quick"],
        capture_output=True,
        text=True,
        timeout=240,
        cwd=ROOT,
    )
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-4000:]
    return done.stdout


@pytest.mark.slow  # 10-25 s each on 2 cores
def test_ring_overlap_quick_runs_every_loop_in_every_form() -> None:
    out = _quick("ring_overlap.py")
    for loop in LOOPS:
        rows = [line for line in out.splitlines() if line.startswith(f"| {loop} | 2 |")]
        assert rows, (loop, out)
        assert "not run" not in rows[-1], rows[-1]
        assert len(re.findall(r"\d+\.\d+ \(\d+\.\d+x\)", rows[-1])) == 4, rows[-1]


@pytest.mark.slow
def test_loss_memory_quick_finds_a_constant_beyond_the_per_row_bytes() -> None:
    out = _quick("loss_memory.py")
    for loss in ("clip", "siglip", "info_nce+hard", "nt_xent"):
        rows = [line for line in out.splitlines() if line.startswith(f"| {loss} | 64 |")]
        assert len(rows) >= 3, (loss, out)  # world size 1, the real check, 2 ranks
        cells = [c.strip() for c in rows[0].strip("|").split("|")]
        ring_constants = set(cells[3].split(", "))
        assert len(ring_constants) == 1, rows[0]
        real, fake = rows[1].split("|")[3].strip().split(" / ")  # the ring's peaks, MiB
        assert abs(float(real) - float(fake)) < 0.05, rows[1]
