"""The `distgrad` command, run as a user runs it: in a subprocess, checking exit codes and text."""

from __future__ import annotations

import importlib.metadata
import importlib.util
import re
import subprocess
import sys
from pathlib import Path

import pytest

from distgrad._cli import main

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "check_info_nce.py"
TARGETS = Path(__file__).resolve().parent / "targets.py"


def distgrad(*args: str, cwd: Path = ROOT) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "distgrad", *args],
        capture_output=True,
        text=True,
        timeout=240,
        cwd=cwd,
    )


def distgrad_many(commands: list[list[str]]) -> list[subprocess.CompletedProcess[str]]:
    """Run several short commands at once: each spends its ~2 s importing torch."""
    procs = [
        subprocess.Popen(
            command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT
        )
        for command in commands
    ]
    results = []
    for command, proc in zip(commands, procs, strict=True):
        out, err = proc.communicate(timeout=120)
        results.append(subprocess.CompletedProcess(command, proc.returncode, out, err))
    return results


CONSOLE_SCRIPT = Path(sys.executable).parent / "distgrad"


def in_process(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str, str]:
    """The command's own entry point in this process: (exit code, stdout, stderr). Its ranks
    start from this process's forkserver, which has torch loaded already, where a new process
    per case spends seconds importing it; the subprocess cases above and below keep the
    command's real process covered."""
    try:
        code = main(list(args))
    except SystemExit as exited:
        code = exited.code if isinstance(exited.code, int) else 1
    out, err = capsys.readouterr()
    return code, out, err


@pytest.mark.slow  # processes of the installed command: CI's slow part runs tests/cli
def test_help_is_there_for_every_command_and_the_console_script() -> None:
    module = [sys.executable, "-m", "distgrad"]
    commands = [[*module, "--help"], [*module, "demo", "--help"], [*module, "check", "--help"]]
    if CONSOLE_SCRIPT.exists():  # installed with pip install -e .
        commands.append([str(CONSOLE_SCRIPT), "--help"])
    results = distgrad_many(commands)
    for result in results:
        assert result.returncode == 0, (result.args, result.stderr)
        assert "usage: distgrad" in result.stdout, result.args
    assert "make_inputs()" in results[2].stdout


@pytest.mark.slow  # processes of the installed command: CI's slow part runs tests/cli
def test_demo_runs_and_distgrad_tracks_one_process_while_naive_drifts(tmp_path: Path) -> None:
    result = distgrad("demo", "--steps", "4", "--batch", "16", "--output", str(tmp_path / "out"))
    assert result.returncode == 0, result.stderr
    rows = {line.split("  ")[0]: line.split() for line in result.stdout.splitlines() if line}
    distgrad_gap, distgrad_dev, distgrad_dist = map(float, rows["distgrad"][2:5])
    naive_dev, naive_dist = map(float, rows["naive GatherLayer"][4:6])
    assert distgrad_gap < 1e-12 and distgrad_dev < 1e-12 and distgrad_dist < 1e-12
    assert naive_dev > 1e-2 and naive_dist > 1e-3
    report = (tmp_path / "out" / "report.md").read_text()
    table = [line for line in report.splitlines() if line.startswith("|")]
    assert table[0].startswith("| run | final loss | max \\|loss - one process\\| |")
    cells = [len(re.split(r"(?<!\\)\|", line)) for line in table]  # unescaped pipes only
    assert cells == [cells[0]] * 5 and cells[0] == 7, table  # 5 columns, every row
    assert table[2].startswith("| one process |")
    if importlib.util.find_spec("matplotlib") is None:  # the optional `demo` extra
        assert "no plot: matplotlib is not installed" in result.stdout
        assert not (tmp_path / "out" / "curves.png").exists()
    else:
        assert "curves.png" in report
        assert (tmp_path / "out" / "curves.png").stat().st_size > 1000


@pytest.mark.slow  # 7 s, a process of the installed command: CI's slow part runs tests/cli
def test_check_exits_0_when_the_gradients_agree() -> None:
    result = distgrad("check", f"{EXAMPLE}:info_nce", "--world-size", "2")
    assert result.returncode == 0, result.stdout + result.stderr
    assert "AGREE" in result.stdout


def test_check_exits_1_with_a_diagnosis_on_a_mismatch(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = in_process(capsys, "check", f"{EXAMPLE}:info_nce_naive", "--world-size", "2")
    assert code == 1
    assert "MISMATCH" in out and "Diagnosis:" in out


def test_check_simulate_gives_the_same_report_in_one_process(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """--simulate: every rank in this process; the same verdicts and diagnoses as processes,
    and what cannot be simulated is a bad argument (exit 2) that says to drop --simulate."""
    code, out, err = in_process(capsys, "check", f"{EXAMPLE}:info_nce", "--simulate")
    assert code == 0 and "AGREE" in out, out + err
    code, out, _ = in_process(capsys, "check", f"{EXAMPLE}:info_nce_naive", "--simulate")
    assert code == 1 and "misses the terms that flow through other ranks" in out
    code, _, err = in_process(
        capsys, "check", f"{EXAMPLE}:info_nce", "--simulate", "--shard-sizes", "5,3"
    )
    assert code == 2 and "drop simulate=True" in err, err


def test_check_takes_uneven_shard_sizes_and_tolerances(capsys: pytest.CaptureFixture[str]) -> None:
    """A global loss is right on any shards; the example's even-shard offsets are not."""
    code, out, err = in_process(
        capsys, "check", f"{TARGETS}:global_loss", "--world-size", "2", "--shard-sizes", "5,1",
        "--rtol", "1e-9", "--atol", "1e-12",
    )  # fmt: skip
    assert code == 0, out + err
    code, out, _ = in_process(capsys, "check", f"{EXAMPLE}:info_nce", "--shard-sizes", "5,3")
    assert code == 1
    assert "the forward pass already differs" in out


def test_check_exits_1_with_the_traceback_when_the_function_raises(
    capsys: pytest.CaptureFixture[str],
) -> None:
    code, _, err = in_process(capsys, "check", f"{TARGETS}:raises")
    assert code == 1
    assert err.startswith("distgrad: error: raises failed in the single-process run")
    assert "a bug in the user's loss" in err
    code, _, err = in_process(capsys, "check", f"{TARGETS}:raises_on_rank_1")
    assert code == 1
    assert err.startswith("distgrad: error: raises_on_rank_1 failed on the ranks")
    assert "rank 1: RuntimeError: a bug on rank 1" in err


def test_check_hints_that_the_reference_runs_without_a_process_group(
    capsys: pytest.CaptureFixture[str],
) -> None:
    code, _, err = in_process(capsys, "check", f"{TARGETS}:unguarded_world_size")
    assert code == 1
    assert err.startswith("distgrad: error: unguarded_world_size failed in the single")
    assert "reference runs the function in this process, without a process group" in err


@pytest.mark.slow  # processes of the installed command: CI's slow part runs tests/cli
def test_check_accepts_a_module_name(tmp_path: Path) -> None:
    result = distgrad("check", "check_info_nce:info_nce", "--world-size", "1", cwd=EXAMPLE.parent)
    assert result.returncode == 0, result.stdout + result.stderr


BAD: list[tuple[list[str], str]] = [
    (["check", "no_such_module_xyz:f"], "cannot import module 'no_such_module_xyz'"),
    (["check", "missing_file.py:f"], "no such file: missing_file.py"),
    (["check", f"{EXAMPLE}:nope"], "has no 'nope'"),
    (["check", f"{EXAMPLE}:make_model"], "cannot take the model and the inputs images, texts"),
    (["check", f"{TARGETS}:global_loss", "--inputs", "wrong_names"], "cannot take the inputs y by"),
    (["check", "just_a_name"], "TARGET must look like MODULE:FUNCTION"),
    (["check", f"{TARGETS}:returns_a_matrix"], "must return this rank's loss as a scalar"),
    (
        ["check", f"{TARGETS}:global_loss", "--inputs", "not_tensors"],
        "not_tensors() must return the global batch as a tensor",
    ),
    (["check", f"{TARGETS}:global_loss", "--shard-sizes", "5,x"], "separated by commas"),
    (["check", f"{TARGETS}:global_loss", "--shard-sizes", "5,2"], "adding up to 6"),
    (["check", f"{EXAMPLE}:info_nce", "--world-size", "0"], "must be at least 1"),
    (["demo", "--world-size", "0"], "must be at least 1"),
    (
        ["demo", "--output", "/proc/distgrad-cannot-write-here"],
        "cannot create the output folder",
    ),
]


@pytest.mark.parametrize(("args", "message"), BAD, ids=[" ".join(a)[-40:] for a, _ in BAD])
def test_a_bad_argument_is_one_line_with_the_error_prefix_and_exit_2(
    args: list[str], message: str, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    """The command's own entry point, in this process (a new process per case spends ~2 s
    importing torch; the slow tier runs every case as its own process too)."""
    with pytest.raises(SystemExit) as exited:
        main(args)
    err = capsys.readouterr().err
    assert exited.value.code == 2, (args, err)
    assert message in err, (args, err)
    assert err.count("\n") == 1 and err.startswith("distgrad: error: "), (args, err)


def test_a_bad_argument_exits_2_from_the_installed_command() -> None:
    """One case as a user meets it: the console script, its own process."""
    result = subprocess.run(
        [str(CONSOLE_SCRIPT), "check", "just_a_name"], capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 2, result.stderr
    assert result.stderr == (
        "distgrad: error: TARGET must look like MODULE:FUNCTION or FILE.py:FUNCTION, "
        "got 'just_a_name'\n"
    ), result.stderr


@pytest.mark.slow
def test_bad_arguments_give_one_line_with_the_error_prefix_and_exit_2() -> None:
    """Every case is its own process, run side by side; each must exit 2 with one line."""
    results = distgrad_many([[sys.executable, "-m", "distgrad", *args] for args, _ in BAD])
    for (args, message), result in zip(BAD, results, strict=True):
        assert result.returncode == 2, (args, result.stdout + result.stderr)
        assert message in result.stderr, (args, result.stderr)
        assert result.stderr.count("\n") == 1, (args, result.stderr)
        assert result.stderr.startswith("distgrad: error: "), (args, result.stderr)


@pytest.mark.slow  # processes of the installed command: CI's slow part runs tests/cli
def test_version_is_the_package_version() -> None:
    result = distgrad("--version")
    assert result.returncode == 0, result.stderr
    assert result.stdout == f"distgrad {importlib.metadata.version('distgrad')}\n"
