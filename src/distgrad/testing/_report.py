"""The checker's report: a per-rank, per-tensor table and a diagnosis in words to act on.

Vocabulary: ``N`` ranks; ``L`` the single-process loss; ``J = sum_r loss_r`` what the ranks
differentiate together; ``m`` the factor the input gradients must carry for the training update
to equal single-process training: ``N`` when gradients are averaged over ranks (DDP), ``1`` when
they are summed. Every distributed gradient is compared with ``m`` times the reference.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Literal

import torch
from torch import Tensor

from distgrad.errors import GradientMismatchError


@dataclass(frozen=True)
class RunResult:
    """One process's loss and gradients (inputs by name, parameters by name): what a run of
    the checked function reports, in one process or on one rank."""

    loss: float
    input_grads: dict[str, Tensor | None]
    param_grads: dict[str, Tensor | None]


__all__ = ["GradReport", "TensorCheck", "build_report"]

Combine = Literal["averaged", "summed"]


@dataclass(frozen=True)
class TensorCheck:
    """One distributed gradient against its expected value.

    ``rank`` is None for a parameter gradient combined over ranks. ``scale`` is the factor k
    that best fits ``got = k * expected`` (least squares), None when the expected gradient is 0.
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
    """What the checker found. ``ok`` is True when every loss and gradient agrees."""

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
        losses = ", ".join(f"{x:.6g}" for x in self.losses)
        head = [
            f"distgrad check on {self.world_size} ranks, gradients {self.combine} over ranks: "
            + ("AGREE" if self.ok else "MISMATCH"),
            f"loss: single process {self.reference_loss:.6g}; per rank [{losses}]",
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
    rtol: float,
    atol: float,
    probe: Callable[[], Sequence[RunResult]],
) -> GradReport:
    n = len(results)
    factor = float(n if combine == "averaged" else 1)
    checks = _input_checks(reference, results, sizes, shard_dim, factor, rtol, atol)
    checks += _param_checks(reference, results, combine, rtol, atol)
    report = GradReport(n, combine, reference.loss, [r.loss for r in results], checks)
    if reference.param_grads:
        report.params_agree = {
            way: all(c.ok for c in _param_checks(reference, results, way, rtol, atol))
            for way in ("averaged", "summed")
        }
    ways: tuple[tuple[Combine, float], ...] = (("averaged", float(n)), ("summed", 1.0))
    report.contracts = {
        way: all(
            c.ok
            for c in _input_checks(reference, results, sizes, shard_dim, scale, rtol, atol)
            + _param_checks(reference, results, way, rtol, atol)
        )
        for way, scale in ways
    }
    report.diagnoses = _diagnose(
        report, reference, results, sizes, shard_dim, factor, rtol, atol, probe
    )
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


def _compare(
    name: str,
    rank: int | None,
    got: Tensor | None,
    expected: Tensor | None,
    rtol: float,
    atol: float,
    note: str = "",
) -> TensorCheck:
    if expected is None:
        expected = torch.zeros_like(got) if got is not None else torch.zeros(())
    if got is None:
        got = torch.zeros_like(expected)
    got64, exp64 = got.double(), expected.double()
    diff = (got64 - exp64).abs()
    max_abs = float(diff.max()) if diff.numel() else 0.0
    if not torch.isfinite(got64).all():
        max_abs = math.inf
    scale_of = float(exp64.abs().max()) if exp64.numel() else 0.0
    max_rel = max_abs / scale_of if scale_of > 0 else (0.0 if max_abs == 0 else math.inf)
    ok = bool(torch.allclose(got64, exp64, rtol=rtol, atol=atol)) and math.isfinite(max_abs)
    denom = float((exp64 * exp64).sum())
    scale = float((got64 * exp64).sum()) / denom if denom > 0 else None
    return TensorCheck(name, rank, ok, max_abs, max_rel, scale, note)


def _slice(t: Tensor | None, sizes: Sequence[int], dim: int, rank: int) -> Tensor | None:
    if t is None or t.dim() == 0:
        return t
    return torch.split(t, list(sizes), dim=dim)[rank]


def _input_checks(
    reference: RunResult,
    results: Sequence[RunResult],
    sizes: Sequence[int],
    dim: int,
    factor: float,
    rtol: float,
    atol: float,
) -> list[TensorCheck]:
    checks = []
    for name, ref_grad in reference.input_grads.items():
        if ref_grad is not None and ref_grad.dim() == 0:
            # A 0-dim input goes whole to every rank, like a parameter: combine the ranks'
            # gradients (sum / m) and compare with the single-process one.
            present = [g for r in results if (g := r.input_grads.get(name)) is not None]
            combined = torch.stack(present).sum(0) / factor if present else None
            way = "summed" if factor == 1 else "averaged"
            checks.append(_compare(name, None, combined, ref_grad, rtol, atol, way))
            continue
        for rank, result in enumerate(results):
            expected = _slice(ref_grad, sizes, dim, rank)
            expected = None if expected is None else factor * expected
            checks.append(_compare(name, rank, result.input_grads.get(name), expected, rtol, atol))
    return checks


def _param_checks(
    reference: RunResult,
    results: Sequence[RunResult],
    combine: Combine,
    rtol: float,
    atol: float,
) -> list[TensorCheck]:
    checks = []
    for name, ref_grad in reference.param_grads.items():
        per_rank = [r.param_grads.get(name) for r in results]
        present = [g for g in per_rank if g is not None]
        combined = torch.stack(present).sum(0) if present else None
        if combined is not None and combine == "averaged":
            combined = combined / len(results)
        checks.append(_compare(f"param {name}", None, combined, ref_grad, rtol, atol, combine))
    return checks


def _close(a: float, b: float, rtol: float) -> bool:
    return abs(a - b) <= max(1e-12, 10 * rtol * max(abs(a), abs(b)))


def _diagnose(
    report: GradReport,
    reference: RunResult,
    results: Sequence[RunResult],
    sizes: Sequence[int],
    dim: int,
    factor: float,
    rtol: float,
    atol: float,
    probe: Callable[[], Sequence[RunResult]],
) -> list[str]:
    n = report.world_size
    out: list[str] = []
    if not all(math.isfinite(x) for x in report.losses) or any(
        c.max_abs_error == math.inf for c in report.checks
    ):
        bad = sorted(
            c.rank for c in report.checks if c.max_abs_error == math.inf and c.rank is not None
        )
        out.append(
            "non-finite values (NaN or Inf) in the distributed loss or gradients"
            + (f" on ranks {bad}" if bad else "")
            + " while the single-process run"
            + (" is finite." if math.isfinite(reference.loss) else " is not finite either.")
        )
        return out
    loss_factor = _loss_factor(report)
    if loss_factor is None:
        out.append(
            f"the forward pass already differs: the ranks' losses {_floats(report.losses)} fit no "
            "convention (each rank's loss equal to the single-process "
            f"{report.reference_loss:.6g}, or their sum equal to it, or to N times it). Check "
            "the sharding, the labels or offsets each rank uses, and that statistics are "
            "computed over the global batch."
            + (
                f" The shards are uneven ({list(sizes)} rows): a mean over each rank's own rows "
                "weights rows unequally; sum over the local rows and divide by the global row "
                "count (and multiply by N when gradients are averaged)."
                if len(set(sizes)) > 1
                else ""
            )
        )
        return out
    failing = [c for c in report.checks if not c.ok]
    if not failing:
        if report.combine == "averaged" and not _close(loss_factor, n, rtol):
            out.append(_share_advice(n))
        return out
    ranks_failing = {c.rank for c in failing if c.rank is not None}
    some_ranks_agree = bool(ranks_failing) and len(ranks_failing) < n
    if not some_ranks_agree:
        subject = _subject(failing, report.checks)
        out += _scale_diagnosis(failing, subject, n, loss_factor, report.combine, rtol)
    if out:
        return out
    out += _rank_diagnosis(report, reference, results, sizes, dim, factor, rtol, atol)
    if not out:
        out.append(_cross_rank_diagnosis(probe(), reference))
    return out


def _loss_factor(report: GradReport) -> float | None:
    """J / L: N when every rank returns the global (or local mean) loss, 1 for shares."""
    n, ref, total = report.world_size, report.reference_loss, sum(report.losses)
    if all(_close(x, ref, 1e-6) for x in report.losses):
        return float(n)
    for candidate in (1.0, float(n)):
        if _close(total, candidate * ref, 1e-6):
            return candidate
    return None


def _share_advice(n: int) -> str:
    return (
        f"the ranks' losses add up to the single-process loss (each rank returns its share), "
        f"so averaging gradients over ranks as DDP does divides them by {n}: multiply each "
        f"rank's loss by {n}, or compute the global loss on every rank. (If your training sums "
        "the gradients over ranks instead, the code is right: check with gradients='summed'.)"
    )


def _subject(failing: Sequence[TensorCheck], checks: Sequence[TensorCheck]) -> str:
    """What a diagnosis of the failing rows is about: "every gradient" only when every row
    fails, else the tensors it names (with their ranks when only some fail) and those that
    agree, e.g. "the gradient of k (q agrees) is"."""
    if len(failing) == len(checks):
        return "every gradient is"
    names = list(dict.fromkeys(c.name for c in failing))
    parts = []
    for name in names:
        rows = [c for c in checks if c.name == name]
        bad = sorted(c.rank for c in failing if c.name == name and c.rank is not None)
        partial = len(bad) < len([c for c in rows if c.rank is not None])
        parts.append(f"{name} on ranks {bad}" if partial else name)
    agree = [c.name for c in checks if c.name not in names]
    agreeing = list(dict.fromkeys(agree))
    text = ("the gradient of " if len(parts) == 1 else "the gradients of ") + _listing(parts)
    if agreeing:
        text += f" ({_listing(agreeing)} {'agrees' if len(agreeing) == 1 else 'agree'})"
    return text + (" is" if len(parts) == 1 else " are")


def _listing(items: Sequence[str]) -> str:
    return items[0] if len(items) == 1 else ", ".join(items[:-1]) + " and " + items[-1]


def _scale_diagnosis(
    failing: Sequence[TensorCheck],
    subject: str,
    n: int,
    loss_factor: float,
    combine: Combine,
    rtol: float,
) -> list[str]:
    scales = [c.scale for c in failing]
    if any(s is None for s in scales):
        return []
    common = [s for s in scales if s is not None]
    if not all(_close(s, common[0], 1e-3) for s in common):
        return []
    k = common[0]
    if _close(k, 1.0 / n, 1e-3):
        if _close(loss_factor, 1.0, rtol) and combine == "averaged":
            return [f"{subject} scaled by 1/{n}: " + _share_advice(n)]
        return [
            f"{subject} scaled by 1/{n}: the backward keeps only this rank's part of "
            "the gradient (a GatherLayer whose backward returns only the local slice, "
            "objective='replicated', or overwriting this rank's slot of a raw all_gather). "
            "Use dg.all_gather with its default sum contract, whose backward sums every "
            "rank's gradient for your rows."
        ]
    if _close(k, float(n), 1e-3):
        advice = (
            f"divide each rank's loss by {n}, or average the gradients over ranks as DDP does"
            if combine == "summed"
            else "check that each rank's loss is not already summed over ranks (for example "
            "with an all_reduce) before the backward"
        )
        return [f"{subject} scaled by {n}: {advice}."]
    if not _close(k, 1.0, 1e-3):
        return [f"{subject} scaled by {k:.4g} against the single-process gradient."]
    return []


def _rank_diagnosis(
    report: GradReport,
    reference: RunResult,
    results: Sequence[RunResult],
    sizes: Sequence[int],
    dim: int,
    factor: float,
    rtol: float,
    atol: float,
) -> list[str]:
    out = []
    per_rank = [c for c in report.checks if c.rank is not None]
    bad_ranks = sorted({c.rank for c in per_rank if not c.ok and c.rank is not None})
    good_ranks = sorted({c.rank for c in per_rank if c.rank is not None} - set(bad_ranks))
    for check in per_rank:
        if check.ok or check.rank is None:
            continue
        got = results[check.rank].input_grads.get(check.name)
        if got is None or not bool(got.abs().max() > 0 if got.numel() else False):
            out.append(
                f"no gradient reaches {check.name} on rank {check.rank}: a raw torch.distributed "
                "call (not differentiable) or a .detach() cut the graph; use the distgrad op."
            )
            return out
        owner = _gradient_owner(
            got, reference.input_grads.get(check.name), sizes, dim, factor, rtol, atol
        )
        if owner is not None and owner != check.rank:
            out.append(
                f"rank {check.rank} received the gradient of rank {owner}'s rows of "
                f"{check.name}: the backward routes slices to the wrong rank."
            )
    if not out and bad_ranks and good_ranks:
        out.append(
            f"the gradients agree on ranks {good_ranks} but not on ranks {bad_ranks}: look for "
            "code that depends on the rank (a rank-dependent offset, a rank that skips part of "
            "the loss, or a root rank's special case)."
        )
    return out


def _gradient_owner(
    got: Tensor,
    ref_grad: Tensor | None,
    sizes: Sequence[int],
    dim: int,
    factor: float,
    rtol: float,
    atol: float,
) -> int | None:
    if ref_grad is None:
        return None
    for owner in range(len(sizes)):
        candidate = _slice(ref_grad, sizes, dim, owner)
        if (
            candidate is not None
            and candidate.shape == got.shape
            and torch.allclose(got.double(), factor * candidate.double(), rtol=rtol, atol=atol)
        ):
            return owner
    return None


def _cross_rank_diagnosis(probe_results: Sequence[RunResult], reference: RunResult) -> str:
    crossed = any(
        g is not None and g.numel() > 0 and bool(g.abs().max() > 0)
        for result in probe_results[1:]
        for g in result.input_grads.values()
    )
    if not crossed:
        return (
            "the gradient misses the terms that flow through other ranks: when only rank 0 "
            "back-propagates its loss, no other rank's inputs receive any gradient, although "
            "rank 0's loss uses their rows. The backward is local-only (a GatherLayer whose "
            "backward keeps only its slice, or a raw torch.distributed collective); use the "
            "distgrad op."
        )
    return (
        "the gradients differ from the single-process ones by no simple factor; compare the "
        "table above rank by rank, and check every collective's backward and the loss's "
        "global offsets."
    )


def _floats(values: Sequence[float]) -> str:
    return "[" + ", ".join(f"{v:.6g}" for v in values) + "]"
