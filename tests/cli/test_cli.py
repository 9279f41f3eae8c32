"""The `distgrad` command, run as a user runs it: in a subprocess, checking exit codes and text."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "check_info_nce.py"


def distgrad(*args: str, cwd: Path = ROOT) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "distgrad", *args],
        capture_output=True,
        text=True,
        timeout=240,
        cwd=cwd,
    )


@pytest.mark.parametrize("args", [["--help"], ["demo", "--help"], ["check", "--help"]])
def test_help_is_there_for_every_command(args: list[str]) -> None:
    result = distgrad(*args)
    assert result.returncode == 0
    assert "usage: distgrad" in result.stdout


def test_demo_runs_and_distgrad_tracks_one_process_while_naive_drifts(tmp_path: Path) -> None:
    result = distgrad("demo", "--steps", "4", "--batch", "16", "--output", str(tmp_path / "out"))
    assert result.returncode == 0, result.stderr
    rows = {line.split("  ")[0]: line.split() for line in result.stdout.splitlines() if line}
    distgrad_gap, distgrad_dev = float(rows["distgrad"][2]), float(rows["distgrad"][3])
    naive_dev = float(rows["naive GatherLayer"][4])
    assert distgrad_gap < 1e-12 and distgrad_dev < 1e-12
    assert naive_dev > 1e-2
    report = (tmp_path / "out" / "report.md").read_text()
    assert "| distgrad |" in report and "curves.png" in report
    assert (tmp_path / "out" / "curves.png").stat().st_size > 1000


def test_check_exits_0_when_the_gradients_agree() -> None:
    result = distgrad("check", f"{EXAMPLE}:info_nce", "--world-size", "2")
    assert result.returncode == 0, result.stdout + result.stderr
    assert "AGREE" in result.stdout


def test_check_exits_1_with_a_diagnosis_on_a_mismatch() -> None:
    result = distgrad("check", f"{EXAMPLE}:info_nce_naive", "--world-size", "2")
    assert result.returncode == 1
    assert "MISMATCH" in result.stdout and "Diagnosis:" in result.stdout


def test_check_accepts_a_module_name(tmp_path: Path) -> None:
    result = distgrad("check", "check_info_nce:info_nce", "--world-size", "1", cwd=EXAMPLE.parent)
    assert result.returncode == 0, result.stdout + result.stderr


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["check", "no_such_module_xyz:f"], "cannot import module 'no_such_module_xyz'"),
        (["check", "missing_file.py:f"], "no such file: missing_file.py"),
        (["check", f"{EXAMPLE}:nope"], "has no 'nope'"),
        (["check", f"{EXAMPLE}:make_model"], "cannot take the model and 2 input tensor(s)"),
        (["check", "just_a_name"], "TARGET must look like MODULE:FUNCTION"),
        (["check", f"{EXAMPLE}:info_nce", "--world-size", "0"], "must be at least 1"),
        (["demo", "--world-size", "0"], "must be at least 1"),
        (
            ["demo", "--output", "/proc/distgrad-cannot-write-here"],
            "cannot create the output folder",
        ),
    ],
)
def test_bad_arguments_give_one_line_and_exit_2(args: list[str], message: str) -> None:
    result = distgrad(*args)
    assert result.returncode == 2, result.stdout + result.stderr
    assert message in result.stderr
    assert "Traceback" not in result.stderr
