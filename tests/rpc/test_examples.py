"""The RPC examples run as a user runs them: a subprocess, exit code 0, their own checks."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

EXAMPLES = {
    "rpc_design_note.py": "gradients of t1, t2, t4 match local autograd",
    "rpc_parameter_server.py": "trainer worker2: loss",
    "rpc_model_parallel.py": "(mean of the last 10 steps)",
}


# Every example in the slow tier, which CI runs (the training examples take 10-25 s each); the
# RPC area keeps its fast cases in the other files.
SLOW = {"rpc_parameter_server.py", "rpc_model_parallel.py", "rpc_design_note.py"}


@pytest.mark.parametrize(
    "name", [pytest.param(n, marks=pytest.mark.slow) if n in SLOW else n for n in sorted(EXAMPLES)]
)
def test_example_runs_and_checks_itself(name: str) -> None:
    result = subprocess.run(
        [sys.executable, str(ROOT / "examples" / name)],
        capture_output=True,
        text=True,
        timeout=100,
        cwd=ROOT,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert EXAMPLES[name] in result.stdout, result.stdout
