"""The demo's outputs: a terminal table, a markdown report and a PNG of the curves."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from distgrad._demo.train import Curve, Settings, summary_rows

_COLOURS = {"distgrad": "tab:blue", "naive GatherLayer": "tab:red"}
_FLOOR = 1e-17  # exact zeros (a float64 run can match to the last bit) drawn at the bottom
_ROUNDING = 2.2e-16  # float64 machine epsilon: "equal to rounding error" lies around here


def table(curves: list[Curve]) -> str:
    rows = summary_rows(curves)
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)) for r in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(line.rstrip() for line in lines)


def markdown_table(rows: Sequence[Sequence[str]]) -> str:
    """A GitHub-flavoured markdown table; a ``|`` inside a cell is escaped."""

    def line(cells: Sequence[str]) -> str:
        return "| " + " | ".join(c.replace("|", "\\|") for c in cells) + " |"

    return "\n".join([line(rows[0]), "|" + "---|" * len(rows[0]), *map(line, rows[1:])])


def plot(curves: list[Curve], path: Path) -> bool:
    """Write the PNG; False when matplotlib is not installed.

    Two log-scale panels, one line per distributed run: how far the gradient is from the
    one-process gradient at the same parameters, and how far the parameters are from the
    one-process run's. The story in one look: distgrad stays at rounding error, the naive run
    starts wrong and drifts away.
    """
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    fig, (grads, params) = plt.subplots(1, 2, figsize=(10, 3.6))
    panels = [
        (grads, "deviations", "gradient vs one process, same parameters"),
        (params, "distances", "parameters vs the one-process run"),
    ]
    for axis, attribute, title in panels:
        for curve in curves[1:]:
            values = [max(v, _FLOOR) for v in getattr(curve, attribute)]
            colour = _COLOURS.get(curve.name, "black")
            steps = range(1, len(values) + 1)
            axis.semilogy(steps, values, label=curve.name, color=colour, linewidth=2)
            axis.annotate(
                _percent(values[-1]),
                (len(values), values[-1]),
                textcoords="offset points",
                xytext=(-4, 6),
                ha="right",
                color=colour,
                fontsize=9,
            )
        axis.axhline(_ROUNDING, color="grey", linestyle=":", linewidth=1)
        axis.text(1, _ROUNDING * 3, "float64 rounding", color="grey", fontsize=8)
        axis.set(title=title, xlabel="SGD step", ylabel="relative error (log scale)")
        axis.set_ylim(_FLOOR / 2, 10)
        axis.legend(loc="center right")
    _title(fig, curves)
    fig.tight_layout()
    fig.savefig(path, dpi=80)
    plt.close(fig)
    return True


def _percent(value: float) -> str:
    return f"{100 * value:.0f}% off" if value >= 0.01 else f"{value:.0e}"


def _title(fig: Any, curves: list[Curve]) -> None:
    naive = [c for c in curves if c.name == "naive GatherLayer" and c.deviations]
    tail = (
        f"; naive GatherLayer's gradient up to {100 * max(naive[0].deviations):.0f}% off"
        if naive
        else ""
    )
    fig.suptitle(f"distgrad matches one process to rounding error{tail}", fontsize=11)


def markdown(curves: list[Curve], settings: Settings, png: str | None, seconds: float) -> str:
    lines = [
        "# distgrad demo: NT-Xent on synthetic data, trained three ways",
        "",
        f"Global batch {settings.batch} pairs, {settings.steps} SGD steps, "
        f"{settings.world_size} processes (gloo, CPU), float64, seed {settings.seed}; "
        f"{seconds:.1f} s in all.",
        "",
        markdown_table(summary_rows(curves)),
        "",
        "The gradient deviation is ||g - g*|| / ||g*|| at every step, where g is the run's "
        "gradient after DistributedDataParallel averaged it and g* the one-process gradient of "
        "the full batch at the same parameters. The parameter distance is ||p - p*|| / ||p*||, "
        "where p* are the one-process run's parameters after the same number of steps. Both "
        "are the largest over the steps.",
        "",
        "- **distgrad** gathers the other ranks' embeddings with `dg.all_gather`, whose backward "
        "returns to each rank the gradient every rank's loss sends to its rows: it follows the "
        "one-process run to rounding error.",
        "- **naive GatherLayer** keeps only its own slice of its own gradient in backward: the "
        "terms that flow through other ranks' losses are lost, the gradient is wrong at the "
        "first step, and the parameters drift away from the one-process run. Its loss can even "
        "end lower: it optimises a different objective, not the one-process one.",
    ]
    if png:
        lines += ["", f"![gradient deviation and parameter distance from one process]({png})"]
    return "\n".join(lines) + "\n"
