"""The results file: one ``Section`` (a table) per part, and a summary of every part on top."""

from __future__ import annotations

import datetime
import platform
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch


@dataclass
class Section:
    """One part's table. The last column of every row is its result: ``pass``, ``FAIL: ...``,
    ``not run: ...`` or a measurement."""

    part: str
    what: str
    header: tuple[str, ...]
    rows: list[tuple[str, ...]] = field(default_factory=list)

    def counts(self) -> dict[str, int]:
        found = {"pass": 0, "FAIL": 0, "not run": 0, "measured": 0}
        for row in self.rows:
            result = row[-1]
            key = next((k for k in ("pass", "FAIL", "not run") if result.startswith(k)), None)
            found[key or "measured"] += 1
        return found


def one_row(part: str, result: str) -> Section:
    """A part reduced to one row: why it did not run, or how it failed as a whole."""
    return Section(part, f"The {part} part.", ("setup", "result"), [("-", result)])


def render(sections: Sequence[Section], device: str, gpus: int, seconds: float) -> str:
    """The results file: what ran where, a summary per part, then each part's table."""
    names = [torch.cuda.get_device_name(i) for i in range(gpus)] if gpus else []
    title = "CPU (gloo): a check of the command, not GPU results" if device == "cpu" else "GPU"
    lines = [f"# distgrad on {title}", ""]
    if device == "cpu":
        lines += [
            "**CPU MODE.** Written by `python benchmarks/gpu_check.py --device cpu`: every part",
            "ran on gloo with CPU tensors at small sizes to prove the command's logic. Nothing",
            "here is a GPU result; `benchmarks/results/gpu_check.md` is what a GPU run writes.",
            "",
        ]
    when = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    lines += [
        f"* Run: {when}, {seconds:.0f} s; torch {torch.__version__}, Python "
        f"{platform.python_version()}, CUDA {torch.version.cuda or 'none'}",
        f"* Devices: {', '.join(names) if names else 'no CUDA device'}",
        "",
        "| part | pass | FAIL | not run | measured |",
        "| --- | --- | --- | --- | --- |",
    ]
    for s in sections:
        c = s.counts()
        lines.append(f"| {s.part} | {c['pass']} | {c['FAIL']} | {c['not run']} | {c['measured']} |")
    for s in sections:
        lines += ["", f"## {s.part}", "", s.what, "", _table(s.header, s.rows)]
    return "\n".join(lines) + "\n"


def _table(header: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    def cell(text: str) -> str:
        return text.replace("|", "\\|").replace("\n", " ")

    out = ["| " + " | ".join(header) + " |", "|" + " --- |" * len(header)]
    out += ["| " + " | ".join(cell(c) for c in row) + " |" for row in rows]
    return "\n".join(out)
