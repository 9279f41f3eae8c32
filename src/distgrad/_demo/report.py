"""The demo's outputs: a terminal table, a markdown report and a PNG of the curves."""

from __future__ import annotations

from pathlib import Path

from distgrad._demo.train import Curve, Settings, summary_rows


def table(curves: list[Curve]) -> str:
    rows = summary_rows(curves)
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)) for r in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(line.rstrip() for line in lines)


def plot(curves: list[Curve], path: Path) -> bool:
    """Write the PNG; False when matplotlib is not installed."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    # The one-process run goes last, dashed, so it shows on top of the run that matches it.
    for curve, colour in reversed(
        list(zip(curves, ["black", "tab:blue", "tab:red"], strict=False))
    ):
        style = "--" if curve.name == "one process" else "-"
        left.plot(curve.losses, style, label=curve.name, color=colour)
        if curve.deviations:
            deviations = [max(d, 1e-17) for d in curve.deviations]
            right.semilogy(deviations, label=curve.name, color=colour)
    left.set(title="NT-Xent loss", xlabel="step", ylabel="loss")
    right.set(
        title="gradient deviation from one process", xlabel="step", ylabel="relative L2 error"
    )
    left.legend()
    right.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def markdown(curves: list[Curve], settings: Settings, png: str | None, seconds: float) -> str:
    rows = summary_rows(curves)
    lines = [
        "# distgrad demo: NT-Xent on synthetic data, trained three ways",
        "",
        f"Global batch {settings.batch} pairs, {settings.steps} SGD steps, "
        f"{settings.world_size} processes (gloo, CPU), float64, seed {settings.seed}; "
        f"{seconds:.1f} s in all.",
        "",
        "| " + " | ".join(rows[0]) + " |",
        "|" + "---|" * len(rows[0]),
        *("| " + " | ".join(r) + " |" for r in rows[1:]),
        "",
        "The gradient deviation is ||g - g*|| / ||g*|| at every step, where g is the run's "
        "gradient after DistributedDataParallel averaged it and g* the one-process gradient of "
        "the full batch at the same parameters.",
        "",
        "- **distgrad** gathers the other ranks' embeddings with `dg.all_gather`, whose backward "
        "returns to each rank the gradient every rank's loss sends to its rows: it follows the "
        "one-process run to rounding error.",
        "- **naive GatherLayer** keeps only its own slice of its own gradient in backward: the "
        "terms that flow through other ranks' losses are lost, the gradient is wrong at the "
        "first step, and training drifts away.",
    ]
    if png:
        lines += ["", f"![loss and gradient deviation]({png})"]
    return "\n".join(lines) + "\n"
