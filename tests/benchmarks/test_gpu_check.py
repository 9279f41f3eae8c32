"""``benchmarks/gpu_check.py``, the one command that checks distgrad on a GPU, stays correct
between the times a GPU is at hand.

Semantics asserted: ``--device cpu`` runs every part for real (gloo ranks started by
``run_on_ranks``, the reference sweep, the losses against float64, the compiled step with
aot_eager) and each part's rows pass or say why they did not run; the file it writes is
labelled as a CPU run and is not the GPU results file. Without a CUDA device, the GPU command
still writes every part, each as a "not run: no CUDA device" row. The results writer counts
each part's rows by their result and keeps table cells whole.
"""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "benchmarks" / "gpu_check.py"
PARTS = ("gradients", "losses", "sync", "guard", "compile", "memory", "timing", "scale")


def _script() -> ModuleType:
    """The command's module, imported as a file (benchmarks/ is not a package; the command puts
    its folder on ``sys.path`` for its parts, the package ``gpu``)."""
    spec = importlib.util.spec_from_file_location("gpu_check", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _sections(text: str) -> dict[str, str]:
    """Each part's text in a results file, by part name."""
    chunks = text.split("\n## ")[1:]
    return {chunk.split("\n", 1)[0]: chunk for chunk in chunks}


def _results(section: str) -> list[str]:
    """The last cell of every table row of a part."""
    rows = [line for line in section.splitlines() if line.startswith("| ")][2:]  # past the header
    return [row.rstrip(" |").rsplit(" | ", 1)[-1] for row in rows]


# Every part in fresh gloo processes, aot_eager compiling one step: about 45 s on 2 busy cores.
@pytest.mark.slow  # every part on gloo: 20-50 s; CI runs it
@pytest.mark.timeout(300)
def test_cpu_mode_runs_every_part_and_labels_its_file_as_cpu(tmp_path: Path) -> None:
    out = tmp_path / "gpu_check_cpu.md"
    done = subprocess.run(
        [sys.executable, str(SCRIPT), "--device", "cpu", "--out", str(out)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=280,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    text = out.read_text()
    assert text.startswith("# distgrad on CPU (gloo): a check of the command, not GPU results")
    assert "**CPU MODE.**" in text
    sections = _sections(text)
    assert list(sections) == list(PARTS)
    # The losses: every function and module checked, then CLIP's times at world size 1 (plain
    # torch, dense and ring at two batches, the ring alone at a third).
    losses = _results(sections["losses"])
    checks, times = losses[: 18 * 2], losses[18 * 2 :]
    assert len(times) == 3 * 2 + 1 and all(" ms, " in r for r in times), times
    assert sum("x plain torch" in r for r in times) == 2 * 2, times
    for part, results in [(p, _results(sections[p])) for p in ("gradients", "guard", "compile")]:
        assert results and all(r.startswith("pass") for r in results), (part, results)
    assert all(r.startswith("pass") for r in checks), checks
    # The sweep covers every op: float64, float32, float64 with async_op=True.
    assert len(_results(sections["gradients"])) == 9 * 3
    for part in ("sync", "memory"):  # ran on CPU, but what they measure needs CUDA: said so
        results = _results(sections[part])
        assert results and all(r.startswith("not run: no CUDA device") for r in results), results
    timing = _results(sections["timing"])
    # 3 shapes; c10d, distgrad and the autograd floor for each of 9 ops; 4 with funcol
    assert len(timing) == 3 * (9 * 3 + 4), timing
    assert all(r.endswith(")") and "x (" in r for r in timing), timing


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the run without a CUDA device")
def test_without_a_gpu_every_part_is_a_not_run_row(tmp_path: Path) -> None:
    out = tmp_path / "gpu_check.md"
    assert _script().main(["--out", str(out)]) == 0
    text = out.read_text()
    assert text.startswith("# distgrad on GPU")
    sections = _sections(text)
    assert list(sections) == list(PARTS)
    for part, section in sections.items():
        assert _results(section) == ["not run: no CUDA device (torch.cuda is not available)"], part


def test_the_results_writer_counts_each_result_and_keeps_cells_whole() -> None:
    gc = _script()
    section = gc.Section("demo", "What ran.", ("case", "result"))
    section.rows += [("a", "pass"), ("b|c", "FAIL: x\ny"), ("d", "not run: why"), ("e", "1.02x")]
    assert section.counts() == {"pass": 1, "FAIL": 1, "not run": 1, "measured": 1}
    text = gc.render([section], "cpu", 0, 1.0)
    assert "| demo | 1 | 1 | 1 | 1 |" in text
    assert "| b\\|c | FAIL: x y |" in text


def test_an_unknown_part_is_refused() -> None:
    with pytest.raises(SystemExit):
        _script().main(["--parts", "gradients,speed"])
