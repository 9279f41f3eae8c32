"""The README's example, executed as written: run as the script it says to save, and its
promise about DDP averaging.

Semantics asserted: the example, saved to a file and run with ``python``, exits 0 and prints the
checker's AGREE. Each rank back-propagates its local-mean InfoNCE over gathered keys; the
gradients of the local queries and keys, averaged over ranks as DDP averages parameter
gradients (here: scaled by 1/N, since every input row lives on exactly one rank), equal the
single-process gradient of the loss on the full batch. float64, tolerance 1e-12.

The README's other blocks run too (each has its test, listed in README_BLOCKS): the torchrun
launch note on 2 CPU ranks, the DeviceMesh snippet on 4 (its loss is the single-process loss),
and the install lines name the torch the tests run with. CONTRIBUTING's model op is the real
``_AllToAll``, character for character.
"""

from __future__ import annotations

import importlib
import inspect
import os
import re
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest
import torch

from distgrad.testing import run_on_ranks
from tests._support import FLOAT64_ROUNDING, seeded

README = Path(__file__).resolve().parents[2] / "README.md"
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


# --- Every other code block of the README, and CONTRIBUTING's model op ---------------------

ROOT = README.parent
CONTRIBUTING = ROOT / "CONTRIBUTING.md"


def _blocks(path: Path) -> list[tuple[str, str]]:
    """Every fenced block of a page: (its language, its text)."""
    return re.findall(r"^[ \t]*```(\w*)\n(.*?)^[ \t]*```", path.read_text(), re.S | re.M)


def _block(language: str, first_line: str) -> str:
    found = [text for lang, text in _blocks(README) if lang == language and first_line in text]
    assert len(found) == 1, f"README: one {language} block with {first_line!r}, found {len(found)}"
    return found[0]


# Each block of the README and the test that runs it; a new block needs a test and a line here.
README_BLOCKS = {
    (
        "bash",
        "pip install torch==2.13.0",
    ): "test_readme_front_door_runs_as_written_in_a_fresh_clone",
    ("python", "def info_nce"): "test_readme_example_runs_as_shown_and_the_checker_agrees",
    ("python", "# train.py"): "test_readme_torchrun_script_runs_under_torchrun_on_cpu",
    ("bash", "torchrun --standalone"): "test_readme_torchrun_script_runs_under_torchrun_on_cpu",
    ("python", "init_device_mesh"): "test_readme_mesh_snippet_runs_and_gives_the_global_loss",
}


def test_every_readme_code_block_has_its_test() -> None:
    for language, text in _blocks(README):
        keys = [key for key in README_BLOCKS if key[0] == language and key[1] in text]
        assert len(keys) == 1, f"a README {language or 'text'} block without its test:\n{text}"
        assert README_BLOCKS[keys[0]] in globals(), README_BLOCKS[keys[0]]


CPU_INDEX = "--index-url https://download.pytorch.org/whl/cpu"
CI = ROOT / ".ci" / "run"


def _front_door() -> list[str]:
    """The README's first bash block (the one right after its opening paragraph), as commands:
    comments and blank lines left out."""
    text = README.read_text()
    opening = text[: text.index("## ")]
    block = re.search(r"```bash\n(.*?)```", opening, re.S)
    assert block is not None, "the README opens with no bash block"
    return [c for c in (line.split("#")[0].strip() for line in block.group(1).splitlines()) if c]


def _readme_install() -> list[str]:
    """The front door's install steps: every line up to the last pip install."""
    lines = _front_door()
    last = max(i for i, line in enumerate(lines) if line.startswith("pip install"))
    return lines[: last + 1]


def _ci_install() -> list[str]:
    """.ci/run's copy of the README's install block, between its two markers, comments out."""
    text = CI.read_text()
    block = text[text.index("# --- the README's install block") :]
    block = block[: block.index("# --- end of the README's install block")]
    return [c for c in (line.split("#")[0].strip() for line in block.splitlines()) if c]


def test_readme_install_names_the_tested_torch_and_the_cpu_index() -> None:
    """Installs need the network, so this checks what they name rather than running them: a
    virtual environment first, then the torch the tests run with from PyTorch's CPU wheel index,
    then this clone with the extras the default tier and the demo need; then the two commands."""
    lines = _front_door()
    tested = torch.__version__.split("+")[0]
    assert lines[0].startswith("python3 -m venv .venv"), lines
    assert f"pip install torch=={tested} {CPU_INDEX}" in lines
    assert 'pip install -e ".[test,demo]"' in lines
    assert lines[-2:] == ["distgrad demo", "python -m pytest -q"]
    assert f"Tested with torch {tested}" in README.read_text()


def test_the_test_extra_holds_what_the_default_tier_imports() -> None:
    """``pip install -e ".[test]"`` is all the default tier needs beyond torch: pyproject's
    ``test`` extra names pytest, pytest-timeout (pyproject's timeout), hypothesis (the random
    collectives) and expecttest (torch's own distributed test internals)."""
    import tomllib

    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"][
        "optional-dependencies"
    ]
    names = {re.split(r"[<>=!\[ ]", r)[0] for r in extras["test"]}
    assert {"pytest", "pytest-timeout", "hypothesis", "expecttest"} <= names, names
    assert {re.split(r"[<>=!\[ ]", r)[0] for r in extras["demo"]} == {"matplotlib"}


def test_ci_installs_exactly_as_the_readme_says() -> None:
    """.ci/run's install block is the README's, line for line, with two differences allowed:
    the environment's folder (CI's ``"$venv"`` for the README's ``.venv``) and the CPU index,
    which CI cannot reach (only PyPI is, where the plain pin is the CPU wheel)."""
    readme = [
        line.replace(".venv", '"$venv"').replace(f" {CPU_INDEX}", "") for line in _readme_install()
    ]
    assert _ci_install() == readme
    ci = CI.read_text()
    assert f"\n{_front_door()[-1]} " in ci, "CI runs the README's test command"


def test_saved_readme_example_runs_under_the_distgrad_check_command(tmp_path: Path) -> None:
    """The README's command-line check, run on the file the README has you save (its
    ``make_inputs()`` gives the global batch): exit 0 and AGREE, simulated as ``--simulate``
    runs it (the processes' run is the script test's)."""
    script = tmp_path / "check_info_nce.py"
    script.write_text(_example())
    command = "distgrad check check_info_nce.py:info_nce"
    assert f"`{command}`" in README.read_text()
    result = subprocess.run(
        [sys.executable, "-m", "distgrad", *command.split()[1:], "--simulate"],
        capture_output=True, text=True, timeout=180, cwd=tmp_path,
    )  # fmt: skip
    assert result.returncode == 0, result.stdout + result.stderr
    assert "AGREE" in result.stdout, result.stdout


# The README's front door run as written, with its tests cut to a selection that exercises the
# package (real processes on gloo) in seconds: the whole default tier is CI's own step.
SELECTION = "tests/unit/test_readme_example.py -k runs_as_shown_and_the_checker_agrees"


def _clone(into: Path) -> None:
    """This checkout's files as a fresh clone has them: git's tracked files (and any new ones
    it does not ignore), or the tree less the environments and caches when not a git checkout."""
    listed = subprocess.run(
        ["git", "ls-files", "--cached", "--others", "--exclude-standard", "-z"],
        cwd=ROOT, capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    if listed.returncode == 0:
        for name in filter(None, listed.stdout.split("\0")):
            source = ROOT / name
            if source.is_file():
                (into / name).parent.mkdir(parents=True, exist_ok=True)
                shutil.copy2(source, into / name)
    else:
        ignore = shutil.ignore_patterns(".venv", ".git", "__pycache__", "*.egg-info", ".*cache")
        shutil.copytree(ROOT, into, ignore=ignore, dirs_exist_ok=True)


@pytest.mark.slow  # a fresh virtual environment and torch installed into it: a minute or two
def test_readme_front_door_runs_as_written_in_a_fresh_clone(tmp_path: Path) -> None:
    """The README's opening block, run as written with bash in a copy of this checkout: a new
    .venv, torch, this clone with its extras, the demo, the tests. Two steps differ, as CI's
    do: the CPU index is left out (only PyPI is reachable; its plain pin is the CPU wheel), and
    the tests are a selection (SELECTION). It must end with the demo's report and a green run."""
    clone = tmp_path / "distgrad"
    clone.mkdir()
    _clone(clone)
    lines = []
    for line in _front_door():
        line = line.replace(f" {CPU_INDEX}", "")
        if line == "python -m pytest -q":
            line = f"python -m pytest -q -p no:cacheprovider {SELECTION}"
        lines.append(line)
    env = {k: v for k, v in os.environ.items() if k not in ("VIRTUAL_ENV", "PYTHONPATH")}
    result = subprocess.run(
        ["bash", "-euo", "pipefail", "-c", "\n".join(lines)],
        capture_output=True, text=True, timeout=900, cwd=clone, env={**env, "PIP_QUIET": "1"},
    )  # fmt: skip
    output = result.stdout + result.stderr
    assert result.returncode == 0, output[-6000:]
    assert "report: distgrad-demo/report.md" in result.stdout, output[-6000:]
    assert (clone / "distgrad-demo" / "report.md").is_file()
    assert (clone / "distgrad-demo" / "curves.png").is_file()  # the demo extra: the plot
    assert re.search(r"\b\d+ passed\b", result.stdout.splitlines()[-1]), output[-3000:]
    assert "failed" not in result.stdout.splitlines()[-1], output[-3000:]


@pytest.mark.slow  # a torchrun launch; CI's slow part runs it
def test_readme_torchrun_script_runs_under_torchrun_on_cpu(tmp_path: Path) -> None:
    """The launch note as written: train.py saved, the torchrun line run (torchrun's module, on
    2 CPU ranks over gloo, as on a machine without a GPU); every rank ends with its gradient."""
    (tmp_path / "train.py").write_text(_block("python", "# train.py"))
    command = _block("bash", "torchrun --standalone").split("#")[0].split()
    assert command[0] == "torchrun"
    env = {**os.environ, "GLOO_SOCKET_IFNAME": "lo", "OMP_NUM_THREADS": "1"}
    result = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", *command[1:]],
        capture_output=True, text=True, timeout=180, cwd=tmp_path, env=env,
    )  # fmt: skip
    assert result.returncode == 0, result.stdout + result.stderr
    grads = sorted(re.findall(r"rank (\d): (\d+\.\d+)", result.stdout))
    assert [rank for rank, _ in grads] == ["0", "1"], result.stdout
    assert all(float(norm) > 0 for _, norm in grads)  # x is unseeded: its gradient, not a value


def _mesh_rank(rank: int, world_size: int) -> float:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    import distgrad as dg
    from distgrad import parallel as P

    sys.path.insert(0, str(ROOT / "examples"))
    import mesh_2d

    images, texts = mesh_2d.make_batch()
    dp = rank // 2  # mesh (2, 2), row-major: ranks 0, 1 are dp 0; ranks 2, 3 are dp 1
    rows = slice(dp * len(images) // 2, (dp + 1) * len(images) // 2)
    namespace: dict[str, Any] = {
        "init_device_mesh": init_device_mesh,
        "fully_shard": fully_shard,
        "dg": dg,
        "P": P,
        "model": mesh_2d.make_model(),
        "images": images[rows],
        "texts": texts[rows],
    }
    exec(_block("python", "init_device_mesh"), namespace)
    return float(namespace["loss"].detach())


def test_readme_mesh_snippet_runs_and_gives_the_global_loss() -> None:
    """The DeviceMesh snippet as written, on 4 CPU ranks (dp=2 x tp=2), with examples/mesh_2d.py's
    model and batch: every rank's loss is CLIP's loss of the whole batch in one process
    (float64; the reduction order differs, hence 1e-12)."""
    sys.path.insert(0, str(ROOT / "examples"))
    try:
        import mesh_2d
    finally:
        sys.path.remove(str(ROOT / "examples"))
    import distgrad as dg

    model = mesh_2d.make_model()
    images, texts = mesh_2d.make_batch()
    want = float(dg.losses.clip_loss(model(images), model(texts)).detach())
    losses = run_on_ranks(_mesh_rank, 4)
    assert losses == [pytest.approx(want, rel=1e-12)] * 4


def test_contributing_model_op_is_the_real_all_to_all() -> None:
    """CONTRIBUTING's model autograd Function is _AllToAll as the package defines it, and it
    runs: defined in all_to_all.py's namespace it is a Collective whose adjoint is itself with
    the sizes swapped."""
    module = importlib.import_module("distgrad.collectives.all_to_all")  # not the function

    shown = next(text for _, text in _blocks(CONTRIBUTING) if "class _AllToAll" in text)
    real = inspect.getsource(module._AllToAll)
    assert textwrap.dedent(shown).strip() == real.strip()
    namespace = dict(vars(module))
    exec(textwrap.dedent(shown), namespace)
    op = namespace["_AllToAll"]
    assert issubclass(op, module.Collective) and op.name == "all_to_all"

    class Plan:
        def swapped(self) -> str:
            return "swapped"

    assert op.adjoint(Plan()) == (op, "swapped")


@pytest.mark.slow  # a demo run (4 s): CI's slow part runs this file
def test_demo_without_its_extra_writes_the_report_and_says_how_to_get_the_plot(
    tmp_path: Path,
) -> None:
    """Without matplotlib (the ``demo`` extra: made unimportable in the demo's process), the
    demo still exits 0 with its report and says, in words that work from a clone, how to get
    the plot: ``pip install -e ".[demo]"``."""
    from distgrad._cli import NO_PLOT

    blocked = (
        "import sys; sys.modules['matplotlib'] = None; from distgrad._cli import main; "
        "sys.exit(main(sys.argv[1:]))"
    )
    out = tmp_path / "out"
    result = subprocess.run(
        [sys.executable, "-c", blocked, "demo", "--steps", "2", "--output", str(out)],
        capture_output=True, text=True, timeout=180, cwd=tmp_path,
    )  # fmt: skip
    assert result.returncode == 0, result.stdout + result.stderr
    assert NO_PLOT in result.stdout
    assert 'pip install -e ".[demo]"' in NO_PLOT
    assert (out / "report.md").is_file() and not (out / "curves.png").exists()
