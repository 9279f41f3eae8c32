"""The checkers' reports: every distributed value against the single-process truth in a
table, and the diagnosis (``_diagnose``, one engine for both checkers) in words to act on.

Vocabulary of :class:`GradReport`: ``N`` ranks; ``L`` the single-process loss;
``J = sum_r loss_r`` what the ranks differentiate together; ``m`` the factor the input
gradients must carry for the training update to equal single-process training: ``N`` when
gradients are averaged over ranks (DDP), ``1`` when they are summed. Every distributed
gradient is compared with ``m`` times the reference.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Literal

import torch
from torch import Tensor

from distgrad.errors import GradientMismatchError
from distgrad.testing._diagnose import (
    Finding,
    Misrouted,
    NoGradient,
    NonFinite,
    RankDependent,
    Row,
    Scaled,
    Tolerance,
    Unreduced,
    compare,
    diagnose,
    loss_factor,
    near,
)

__all__ = [
    "Combine",
    "GradReport",
    "ModelReport",
    "ParameterCheck",
    "PipelineReport",
    "RunResult",
    "TensorCheck",
    "build_report",
    "parameter_words",
    "pipeline_words",
]

Combine = Literal["averaged", "summed"]


@dataclass(frozen=True)
class RunResult:
    """One process's loss and gradients (inputs by name, parameters by name): what a run of
    the checked function reports, in one process or on one rank."""

    loss: float
    input_grads: dict[str, Tensor | None]
    param_grads: dict[str, Tensor | None]


@dataclass(frozen=True)
class TensorCheck:
    """One distributed gradient against its expected value.

    ``rank`` is None for a parameter gradient combined over ranks. ``scale`` is the factor k
    that best fits ``got = k * expected`` (least squares), None when the expected gradient is 0.

    Attributes:
        name: the tensor's name: an input (``q``, ``input 0``) or ``param <name>``.
        rank: the rank whose gradient this is; None for a parameter's, combined over ranks.
        ok: whether it matches within the tolerances.
        max_abs_error: the largest absolute difference from the expected gradient.
        max_rel_error: the largest relative difference.
        scale: the least-squares factor k in ``got = k * expected``; None when expected is 0.
        note: what else the checker noticed about it (empty when nothing).

    Example:
        >>> g = torch.Generator().manual_seed(0)
        >>> q, k = torch.randn(2, 4, 3, dtype=torch.float64, generator=g)
        >>> report = dg.testing.check_against_single_process(
        ...     dg.losses.info_nce, {"query": q, "key": k}, simulate=True
        ... )
        >>> check = report.checks[0]
        >>> check.name, check.rank, check.ok, check.scale
        ('query', 0, True, 1.0)
    """

    name: str
    rank: int | None
    ok: bool
    max_abs_error: float
    max_rel_error: float
    scale: float | None
    note: str = ""


@dataclass
class GradReport:
    """What the checker found. ``ok`` is True when every loss and gradient agrees.

    Attributes:
        world_size: the ranks the check ran on.
        combine: how the ranks' gradients were combined: ``"averaged"`` or ``"summed"``.
        reference_loss: the single-process loss.
        losses: every rank's loss.
        checks: every gradient's ``TensorCheck``, input gradients per rank.
        diagnoses: what is wrong, in words (empty when everything agrees).
        params_agree: for each way of combining (``"averaged"``, ``"summed"``), whether the
            combined parameter gradients equal one process's; empty without parameters.
        contracts: for each way of combining, whether every gradient satisfies that contract.

    Example:
        >>> g = torch.Generator().manual_seed(0)
        >>> q, k = torch.randn(2, 4, 3, dtype=torch.float64, generator=g)
        >>> report = dg.testing.check_against_single_process(
        ...     dg.losses.info_nce, {"query": q, "key": k}, simulate=True
        ... )
        >>> report.ok, report.world_size, report.contracts
        (True, 2, {'averaged': True, 'summed': False})
        >>> print(str(report).splitlines()[0])
        distgrad check on 2 ranks, gradients averaged over ranks: AGREE
    """

    world_size: int
    combine: Combine
    reference_loss: float
    losses: list[float]
    checks: list[TensorCheck]
    diagnoses: list[str] = field(default_factory=list)
    #: For each way of combining parameter gradients over ranks ("averaged" as DDP does,
    #: "summed"), whether the combined gradients equal the single-process ones; empty when
    #: there are no parameters.
    params_agree: dict[str, bool] = field(default_factory=dict)
    #: The gradient contract the code satisfies, for each way of combining ("summed":
    #: ``sum_r dloss_r/dx`` equals the single-process gradient, so summing parameter gradients
    #: over ranks reproduces single-process training; "averaged": it equals ``N`` times the
    #: single-process gradient, so DDP's averaging reproduces it): True when every input and
    #: parameter gradient agrees under that way.
    contracts: dict[str, bool] = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        return not self.diagnoses and all(c.ok for c in self.checks)

    def table(self) -> str:
        """A plain-text table: one row per rank and tensor."""
        rows = [("tensor", "rank", "max abs err", "max rel err", "best scale", "")]
        for c in self.checks:
            scale = "-" if c.scale is None else f"{c.scale:.4g}"
            rank = "all" if c.rank is None else str(c.rank)
            status = "ok" if c.ok else "MISMATCH"
            rows.append(
                (
                    c.name,
                    rank,
                    f"{c.max_abs_error:.2e}",
                    f"{c.max_rel_error:.2e}",
                    scale,
                    status + (f" ({c.note})" if c.note else ""),
                )
            )
        widths = [max(len(r[i]) for r in rows) for i in range(5)]
        lines = [
            "  ".join(cell.ljust(w) for cell, w in zip(r[:5], widths, strict=True)) + "  " + r[5]
            for r in rows
        ]
        return "\n".join(line.rstrip() for line in lines)

    def __str__(self) -> str:
        head = [
            f"distgrad check on {self.world_size} ranks, gradients {self.combine} over ranks: "
            + ("AGREE" if self.ok else "MISMATCH"),
            f"loss: single process {self.reference_loss:.6g}; per rank {_floats(self.losses)}",
        ]
        if self.params_agree:
            ways = "; ".join(
                f"{way}: {'yes' if agree else 'no'}" for way, agree in self.params_agree.items()
            )
            head.append(f"parameter gradients equal to one process when combined by ({ways})")
        if self.contracts:
            head.append("contract: " + _contract_sentence(self.contracts, self.world_size))
        head += ["", self.table()]
        if self.diagnoses:
            head += ["", "Diagnosis:"] + [f"- {d}" for d in self.diagnoses]
        return "\n".join(head)

    def raise_if_mismatch(self) -> None:
        """Raise :class:`~distgrad.errors.GradientMismatchError` unless everything agrees."""
        if not self.ok:
            raise GradientMismatchError(str(self))


def build_report(
    reference: RunResult,
    results: Sequence[RunResult],
    sizes: Sequence[int],
    shard_dim: int,
    *,
    combine: Combine,
    tol: Tolerance,
    probe: Callable[[], Sequence[RunResult]],
) -> GradReport:
    """check_against_single_process's report. ``probe`` runs the job again with only rank 0
    back-propagating (gradients that reach other ranks then crossed a rank)."""
    n = len(results)
    factor = float(n if combine == "averaged" else 1)
    rows = _input_rows(reference, results, sizes, shard_dim, factor, tol)
    rows += _param_rows(reference, results, combine, tol)
    checks = [
        TensorCheck(r.name, _rank(r), r.ok, r.max_abs_error, r.max_rel_error, r.scale, r.note)
        for r in rows
    ]
    report = GradReport(n, combine, reference.loss, [r.loss for r in results], checks)
    if reference.param_grads:
        report.params_agree = {
            way: all(r.ok for r in _param_rows(reference, results, way, tol))
            for way in ("averaged", "summed")
        }
    ways: tuple[tuple[Combine, float], ...] = (("averaged", float(n)), ("summed", 1.0))
    report.contracts = {
        way: all(
            r.ok
            for r in _input_rows(reference, results, sizes, shard_dim, scale, tol)
            + _param_rows(reference, results, way, tol)
        )
        for way, scale in ways
    }

    def crossed() -> bool:
        return any(
            g is not None and g.numel() > 0 and bool(g.abs().max() > 0)
            for result in probe()[1:]
            for g in result.input_grads.values()
        )

    finding = diagnose(
        rows, tol, sizes={"ranks": n}, losses=(reference.loss, report.losses), crossed=crossed
    )
    report.diagnoses = _loss_words(finding, report, rows, sizes, tol)
    return report


def _contract_sentence(contracts: dict[str, bool], n: int) -> str:
    averaged, summed = contracts.get("averaged", False), contracts.get("summed", False)
    if averaged and summed:
        return (
            "the gradients equal one process's whether summed or averaged over ranks (the two "
            "coincide with one rank, or when every gradient is zero)."
        )
    if averaged:
        return (
            f"the gradients averaged over ranks (as DDP does) equal one process's; each rank's "
            f"input gradient is {n} x its slice of the single-process gradient. Summing over "
            f"ranks instead would give {n} x the single-process gradient."
        )
    if summed:
        return (
            "the gradients summed over ranks equal one process's; each rank's input gradient "
            "is its slice of the single-process gradient. Averaging over ranks as DDP does "
            f"would give 1/{n} of the single-process gradient."
        )
    return "neither the summed nor the averaged gradients equal one process's (see below)."


def _slice(t: Tensor | None, sizes: Sequence[int], dim: int, rank: int) -> Tensor | None:
    if t is None or t.dim() == 0:
        return t
    return torch.split(t, list(sizes), dim=dim)[rank]


def _input_rows(
    reference: RunResult,
    results: Sequence[RunResult],
    sizes: Sequence[int],
    dim: int,
    factor: float,
    tol: Tolerance,
) -> list[Row]:
    rows = []
    for name, ref_grad in reference.input_grads.items():
        if ref_grad is not None and ref_grad.dim() == 0:
            # A 0-dim input goes whole to every rank, like a parameter: combine the ranks'
            # gradients (sum / m) and compare with the single-process one.
            present = [g for r in results if (g := r.input_grads.get(name)) is not None]
            combined = torch.stack(present).sum(0) / factor if present else None
            way = "summed" if factor == 1 else "averaged"
            rows.append(compare(name, None, combined, ref_grad, tol, way))
            continue
        for rank, result in enumerate(results):
            expected = _slice(ref_grad, sizes, dim, rank)
            expected = None if expected is None else factor * expected
            rows.append(compare(name, (rank,), result.input_grads.get(name), expected, tol))
    return rows


def _param_rows(
    reference: RunResult, results: Sequence[RunResult], combine: Combine, tol: Tolerance
) -> list[Row]:
    rows = []
    for name, ref_grad in reference.param_grads.items():
        present = [g for r in results if (g := r.param_grads.get(name)) is not None]
        combined = torch.stack(present).sum(0) if present else None
        if combined is not None and combine == "averaged":
            combined = combined / len(results)
        rows.append(compare(f"param {name}", None, combined, ref_grad, tol, combine))
    return rows


def _loss_words(
    finding: Finding,
    report: GradReport,
    rows: Sequence[Row],
    sizes: Sequence[int],
    tol: Tolerance,
) -> list[str]:
    """The diagnosis of :class:`GradReport`, in sentences."""
    n = report.world_size
    if isinstance(finding, NonFinite):
        ranks = [p[0] for p in finding.places]
        return [
            "non-finite values (NaN or Inf) in the distributed loss or gradients"
            + (f" on ranks {ranks}" if ranks else "")
            + " while the single-process run"
            + (" is finite." if math.isfinite(report.reference_loss) else " is not finite either.")
        ]
    if finding == "forward differs":
        return [
            f"the forward pass already differs: the ranks' losses {_floats(report.losses)} fit "
            "no convention (each rank's loss equal to the single-process "
            f"{report.reference_loss:.6g}, or their sum equal to it, or to N times it)"
            + _mean_ratio(report)
            + ". Check "
            "the sharding, the labels or offsets each rank uses, and that statistics are "
            "computed over the global batch."
            + (
                f" The shards are uneven ({list(sizes)} rows): a mean over each rank's own rows "
                "weights rows unequally; sum over the local rows and divide by the global row "
                "count (and multiply by N when gradients are averaged)."
                if len(set(sizes)) > 1
                else ""
            )
        ]
    j = loss_factor(report.reference_loss, report.losses)
    assert j is not None  # else the forward differs
    averaged = report.combine == "averaged"
    if finding == "agree":
        return [_share_advice(n)] if averaged and not near(j, n, tol.rtol) else []
    if isinstance(finding, Scaled):
        subject = _subject(finding.failing, rows)
        which = _every(finding.failing, rows)
        if finding.size is None:
            return [
                f"{subject} scaled by {finding.factor:.4g}{which} against the single-process "
                "gradient."
            ]
        if finding.factor < 1 and near(j, 1.0, tol.rtol) and averaged:
            return [f"{subject} scaled by 1/{n}{which}: " + _share_advice(n)]
        if finding.factor < 1:
            return [
                f"{subject} scaled by 1/{n}{which}: the backward keeps only this rank's part of "
                "the gradient (a GatherLayer whose backward returns only the local slice, "
                "objective='replicated', or overwriting this rank's slot of a raw all_gather). "
                "Use dg.all_gather with its default sum contract, whose backward sums every "
                "rank's gradient for your rows."
            ]
        advice = (
            f"divide each rank's loss by {n}, or average the gradients over ranks as DDP does"
            if not averaged
            else "check that each rank's loss is not already summed over ranks (for example "
            "with an all_reduce) before the backward, and that no custom backward all-reduces "
            "a parameter's gradient that DDP then averages again"
        )
        return [f"{subject} scaled by {n}{which}: {advice}."]
    if isinstance(finding, NoGradient):
        return [
            f"no gradient reaches {finding.row.name} on rank {_rank(finding.row)}: a raw "
            "torch.distributed call (not differentiable) or a .detach() cut the graph; use the "
            "distgrad op."
        ]
    if isinstance(finding, Misrouted):
        return [
            f"rank {_rank(row)} received the gradient of rank {owner[0]}'s rows of "
            f"{row.name}: the backward routes slices to the wrong rank."
            for row, owner in finding.moves
        ]
    if isinstance(finding, RankDependent):
        good, bad = [p[0] for p in finding.agree], [p[0] for p in finding.differ]
        return [
            f"the gradients agree on ranks {good} but not on ranks {bad}: look for code that "
            "depends on the rank (a rank-dependent offset, a rank that skips part of the "
            "loss, or a root rank's special case)."
        ]
    if finding == "local-only":
        return [
            "the gradient misses the terms that flow through other ranks: when only rank 0 "
            "back-propagates its loss, no other rank's inputs receive any gradient, although "
            "rank 0's loss uses their rows. The backward is local-only (a GatherLayer whose "
            "backward keeps only its slice, or a raw torch.distributed collective); use the "
            "distgrad op."
        ]
    return [  # "no factor" (Unreduced needs replicas, which this checker has not)
        "the gradients differ from the single-process ones by no simple factor; compare the "
        "table above rank by rank, and check every collective's backward and the loss's "
        "global offsets."
    ]


def _rank(row: Row) -> int | None:
    return None if row.place is None else row.place[0]


def _share_advice(n: int) -> str:
    return (
        f"the ranks' losses add up to the single-process loss (each rank returns its share), "
        f"so averaging gradients over ranks as DDP does divides them by {n}: multiply each "
        f"rank's loss by {n}, or compute the global loss on every rank. (If your training sums "
        "the gradients over ranks instead, the code is right: check with gradients='summed'.)"
    )


def _subject(failing: Sequence[Row], rows: Sequence[Row]) -> str:
    """What a diagnosis of the failing rows is about: "every gradient" only when every row
    fails, else the tensors it names (with their ranks when only some fail) and those that
    agree, e.g. "the gradient of k (q agrees) is"."""
    if len(failing) == len(rows):
        return "every gradient is"
    names = list(dict.fromkeys(r.name for r in failing))
    parts = []
    for name in names:
        placed = [r for r in rows if r.name == name and r.place is not None]
        bad = sorted(r.place[0] for r in failing if r.name == name and r.place is not None)
        parts.append(f"{name} on ranks {bad}" if len(bad) < len(placed) else name)
    agreeing = list(dict.fromkeys(r.name for r in rows if r.name not in names))
    text = ("the gradient of " if len(parts) == 1 else "the gradients of ") + _listing(parts)
    if agreeing:
        text += f" ({_listing(agreeing)} {'agrees' if len(agreeing) == 1 else 'agree'})"
    return text + (" is" if len(parts) == 1 else " are")


def _mean_ratio(report: GradReport) -> str:
    """How far the ranks' mean loss is from the single-process loss, e.g. "; their mean is
    3.39 times it": the size of a forward bug in one figure."""
    mean, reference = sum(report.losses) / len(report.losses), report.reference_loss
    if not (math.isfinite(mean) and math.isfinite(reference)) or reference == 0:
        return ""
    return f"; their mean is {mean / reference:.3g} times it"


def _every(failing: Sequence[Row], rows: Sequence[Row]) -> str:
    """Where "every gradient" is the subject, the tensors it means, e.g. " (image and text)":
    a reader of the diagnosis alone learns which tensors are wrong without the table."""
    if len(failing) != len(rows):
        return ""
    return f" ({_listing(list(dict.fromkeys(r.name for r in failing)))})"


def _listing(items: Sequence[str]) -> str:
    return items[0] if len(items) == 1 else ", ".join(items[:-1]) + " and " + items[-1]


def _floats(values: Sequence[float]) -> str:
    return "[" + ", ".join(f"{v:.6g}" for v in values) + "]"


@dataclass(frozen=True)
class ParameterCheck:
    """One parameter's gradient (``what="grad"``) or update (``"update"``: what the optimizer
    step changed, and the value after it) at one step.

    Attributes:
        step: the training step, from 0.
        name: the parameter's name.
        what: ``"grad"`` (its gradient) or ``"update"`` (its value after the step).
        ok: whether it matches one process within the tolerances.
        max_abs_error: the largest absolute difference from one process.
        diagnosis: ``"agree"``, or what is wrong (a missing reduction, a scale, ...).
        stages: in a pipeline (``check_pipeline``), the stages holding the parameter (two for
            a tied one); empty for ``check_parallel_model``.

    Example:
        >>> g = torch.Generator().manual_seed(0)
        >>> batch = (torch.randn(4, 2, dtype=torch.float64, generator=g),)
        >>> report = dg.testing.check_parallel_model(
        ...     lambda: torch.nn.Linear(2, 1).double(),  # the model
        ...     lambda model, mesh: model,  # parallelized: unchanged, every rank the whole batch
        ...     batch,
        ...     lambda model, x: model(x).pow(2).mean(),  # the loss
        ...     2,
        ...     simulate=True,
        ... )
        >>> check = report.checks[0]
        >>> check.step, check.name, check.what, check.diagnosis
        (0, 'weight', 'grad', 'agree')
    """

    step: int
    name: str
    what: str
    ok: bool
    max_abs_error: float
    diagnosis: str
    #: In a pipeline (check_pipeline), the stages holding the parameter (two for a tied one).
    stages: tuple[int, ...] = ()


@dataclass
class ModelReport:
    """What :func:`check_parallel_model` found; ``ok`` when every gradient and update agrees.

    Attributes:
        mesh_shape: the mesh's shape.
        mesh_dim_names: the mesh's dimension names.
        reference_losses: the single-process loss at each step.
        rank_losses: every rank's loss at each step, ``[step][rank]``.
        checks: every parameter's ``ParameterCheck``, gradient and update, at every step.

    Example:
        >>> g = torch.Generator().manual_seed(0)
        >>> batch = (torch.randn(4, 2, dtype=torch.float64, generator=g),)
        >>> report = dg.testing.check_parallel_model(
        ...     lambda: torch.nn.Linear(2, 1).double(),  # the model
        ...     lambda model, mesh: model,  # parallelized: unchanged, every rank the whole batch
        ...     batch,
        ...     lambda model, x: model(x).pow(2).mean(),  # the loss
        ...     2,
        ...     simulate=True,
        ... )
        >>> report.ok, report.mesh_shape, report.mesh_dim_names
        (True, (2,), ('dp',))
    """

    mesh_shape: tuple[int, ...]
    mesh_dim_names: tuple[str, ...]
    reference_losses: list[float]
    rank_losses: list[list[float]]  # [step][rank]
    checks: list[ParameterCheck] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return all(c.ok for c in self.checks)

    @property
    def diagnoses(self) -> dict[str, str]:
        """Every parameter's diagnosis: its first failing check's (gradient before update),
        or ``agree``."""
        found: dict[str, str] = {}
        for check in self.checks:
            if not check.ok and check.name not in found:
                found[check.name] = f"{check.what}: {check.diagnosis}"
        return {c.name: found.get(c.name, "agree") for c in self.checks}

    def __str__(self) -> str:
        mesh = ", ".join(
            f"{n}={s}" for n, s in zip(self.mesh_dim_names, self.mesh_shape, strict=True)
        )
        lines = [f"mesh ({mesh}); {len(self.reference_losses)} step(s)"]
        for step, (want, got) in enumerate(
            zip(self.reference_losses, self.rank_losses, strict=True)
        ):
            lines.append(f"step {step}: loss single process {want:.6g}; per rank {_floats(got)}")
        lines.append(f"{'parameter':<28} {'step':>4} {'what':<6} {'max abs err':>11}  diagnosis")
        for c in self.checks:
            if not c.ok or c.step == 0:
                shown = "ok" if c.ok else c.diagnosis
                lines.append(
                    f"{c.name:<28} {c.step:>4} {c.what:<6} {c.max_abs_error:>11.2e}  {shown}"
                )
        lines.append("Diagnosis:")
        wrong = {n: d for n, d in self.diagnoses.items() if d != "agree"}
        if not wrong:
            lines.append("- every parameter's gradient and update agree with one process")
        for name, diagnosis in wrong.items():
            lines.append(f"- {name}: {diagnosis}")
        return "\n".join(lines)

    def raise_if_mismatch(self) -> None:
        """Raise :class:`GradientMismatchError` with the report unless everything agrees."""
        if not self.ok:
            raise GradientMismatchError(str(self))


def parameter_words(finding: Finding, rows: Sequence[Row], tol: Tolerance) -> str:
    """A parameter's diagnosis in :class:`ModelReport`'s words; ``rows``: its replicas."""
    if finding == "agree":
        return "agree"
    if isinstance(finding, NonFinite):
        finite = all(bool(torch.isfinite(r.want).all()) for r in rows)
        return "non-finite values (NaN or Inf) on some ranks while the single-process value " + (
            "is finite" if finite else "is not finite either"
        )
    if isinstance(finding, Unreduced):
        if finding.how == "sum":
            return (
                f"missing a reduction over mesh dim {finding.dim!r}: its {finding.size} ranks "
                "hold different parts whose sum is the single-process value (all-reduce it "
                f"over {finding.dim!r})"
            )
        return (
            f"missing an average over mesh dim {finding.dim!r}: its {finding.size} ranks hold "
            "different values whose mean is the single-process value"
        )
    if isinstance(finding, Scaled) and finding.size is not None:
        shown = f"1/{finding.size}" if finding.factor < 1 else f"{finding.size}"
        what = "sizes of mesh dims" if " and " in finding.label else "size of mesh dim"
        return f"scaled by {shown} (the {what} {finding.label!r})"
    if isinstance(finding, NoGradient):
        return "no gradient on some ranks or in one process"
    # Any other factor, some ranks only, no pattern: the replicas and their best scale.
    same = all(tol.close(r.got, rows[0].got) for r in rows)
    how = "the ranks disagree" if not same else "the ranks agree with each other"
    shown = "-" if rows[0].scale is None else f"{rows[0].scale:.4g}"
    return (
        f"wrong: no reduction over a mesh dim or factor explains it ({how}; best scale "
        f"{shown}): terms are missing, as when a local-only backward (a GatherLayer) drops the "
        "gradient that flows through other ranks' rows"
    )


@dataclass
class PipelineReport(ModelReport):
    """What :func:`~distgrad.testing.check_pipeline` found; ``ok`` when every stage's copy
    of every parameter has the single-process gradient and update. ``rank_losses`` holds, at
    each step, each data-parallel replica's loss (the mean over its microbatches; NaN when a
    program reports none); each check's ``stages`` the stages holding its parameter.

    Attributes:
        mesh_shape: the mesh's shape, ``(pp,)`` or ``(pp, dp)``.
        mesh_dim_names: the mesh's dimension names, one of them ``"pp"``.
        reference_losses: the single-process loss at each step (the mean over microbatches).
        rank_losses: each data-parallel replica's loss at each step, ``[step][replica]``.
        checks: every stage copy's ``ParameterCheck``, gradient and update, at every step.
        schedule: the schedule's name (a torch schedule's class name, or the program's name).
        n_microbatches: the microbatches each replica ran.
        stage_ranks: stage index -> the pipeline rank holding it.

    Example:
        >>> report = dg.testing.PipelineReport(  # as check_pipeline returns one
        ...     (2,), ("pp",), [0.5], [[0.5]], schedule="ScheduleGPipe", n_microbatches=4,
        ...     stage_ranks={0: 0, 1: 1},
        ... )
        >>> report.checks.append(dg.testing.ParameterCheck(
        ...     0, "0.weight", "grad", False, 0.25, "scaled by 1/2 (the number of stages)", (0,)
        ... ))
        >>> report.ok, report.diagnoses
        (False, {'0.weight': 'grad: scaled by 1/2 (the number of stages)'})
        >>> print(report)
        pipeline ScheduleGPipe: 2 stages (stage->pipeline rank 0->0, 1->1), 4 microbatches,
        mesh (pp=2); 1 step(s)
        step 0: loss single process 0.5; per replica [0.5]
        parameter                    stages  step what   max abs err  diagnosis
        0.weight                     0          0 grad      2.50e-01  scaled by 1/2
        (the number of stages)
        Diagnosis:
        - 0.weight: grad: scaled by 1/2 (the number of stages)
    """

    schedule: str = ""
    n_microbatches: int = 1
    stage_ranks: dict[int, int] = field(default_factory=dict)  # stage -> pipeline rank

    def __str__(self) -> str:
        n = len(self.stage_ranks)
        layout = ", ".join(f"{s}->{r}" for s, r in sorted(self.stage_ranks.items()))
        mesh = ", ".join(
            f"{d}={s}" for d, s in zip(self.mesh_dim_names, self.mesh_shape, strict=True)
        )
        lines = [
            f"pipeline {self.schedule}: {n} stages (stage->pipeline rank {layout}), "
            f"{self.n_microbatches} microbatches, mesh ({mesh}); {len(self.reference_losses)} "
            "step(s)"
        ]
        for step, (want, got) in enumerate(
            zip(self.reference_losses, self.rank_losses, strict=True)
        ):
            lines.append(f"step {step}: loss single process {want:.6g}; per replica {_floats(got)}")
        lines.append(
            f"{'parameter':<28} {'stages':<7} {'step':>4} {'what':<6} {'max abs err':>11}  "
            "diagnosis"
        )
        for c in self.checks:
            if not c.ok or c.step == 0:
                shown = "ok" if c.ok else c.diagnosis.split(": ")[0]  # its head; in full below
                held = ",".join(str(s) for s in c.stages)
                lines.append(
                    f"{c.name:<28} {held:<7} {c.step:>4} {c.what:<6} {c.max_abs_error:>11.2e}  "
                    f"{shown}"
                )
        lines.append("Diagnosis:")
        found = self.diagnoses
        grouped: dict[str, list[str]] = {}
        for name, diagnosis in found.items():
            if diagnosis != "agree":
                grouped.setdefault(diagnosis, []).append(name)
        if not grouped:
            lines.append("- every parameter's gradient and update agree with one process")
        for diagnosis, names in grouped.items():
            who = "every parameter" if len(names) == len(found) > 1 else ", ".join(names)
            lines.append(f"- {who}: {diagnosis}")
        return "\n".join(lines)


def pipeline_words(
    finding: Finding, rows: Sequence[Row], tol: Tolerance, holders: Sequence[str]
) -> str:
    """A pipeline parameter's diagnosis in :class:`PipelineReport`'s words; ``rows``: its
    copies (one per stage holding it and data-parallel replica), ``holders``: those stages,
    in words ("stage 0 (rank 0)"). A missing gradient is worded by the caller, which sees
    every stage."""
    if isinstance(finding, Unreduced) and finding.dim == "stages":
        both = _listing(list(holders))
        if finding.how == "mean":
            return (
                f"tied between {both}: the copies' gradients were averaged, not summed (the "
                "single-process gradient is the sum of every stage's part)"
            )
        return (
            f"tied between {both}: each stage's copy holds only its own stage's part of the "
            "gradient, whose sum is the single-process gradient: the copies were never summed "
            "(all-reduce the gradient between the stages' ranks after the backward, before the "
            "optimizer step)"
        )
    if isinstance(finding, Scaled) and finding.size is not None:
        shown = f"1/{finding.size}" if finding.factor < 1 else f"{finding.size}"
        return f"scaled by {shown} ({finding.label})"
    if finding == "agree" or isinstance(finding, (NonFinite, Unreduced, NoGradient)):
        return parameter_words(finding, rows, tol)
    same = all(tol.close(r.got, rows[0].got) for r in rows)
    how = "its copies disagree" if not same else "its copies agree with each other"
    shown = "-" if rows[0].scale is None else f"{rows[0].scale:.4g}"
    return (
        f"wrong: no factor, missing stage or unsummed tie explains it ({how}; best scale {shown})"
    )
