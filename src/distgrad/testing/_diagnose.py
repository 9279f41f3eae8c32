"""The diagnosis engine of both checkers: distributed values read against the single-process
truth, and what the pattern of their disagreement says (``_report`` words it).

A :class:`Row` is one distributed tensor and the value it should have: a rank's input
gradient and its slice of the reference, a parameter gradient combined over ranks, or one
replica of a parameter reassembled from a parallelized model. :func:`compare` is the one
comparison; :func:`diagnose` reads a set of rows and returns the first finding that fits:

1. :class:`NonFinite`: NaN or Inf in a distributed value or loss;
2. ``"forward differs"``: the ranks' losses fit no convention (when losses are given);
3. ``"agree"``: every row agrees;
4. :class:`Unreduced`: replicas that differ along one mesh dim sum (or average) to the truth;
5. :class:`Scaled`: every failing row is ``k`` times the truth, ``k`` a size of the group
   (``1/N``, ``N``: a local-only backward, a loss averaged or summed once too often) or any
   one factor; asked only when no place (rank, replica) agrees while another fails;
6. :class:`NoGradient`: a place receives no gradient at all;
7. :class:`Misrouted`: a place holds the value another place should hold;
8. :class:`RankDependent`: some places agree, others do not;
9. ``"local-only"``: when only rank 0 back-propagates, no other rank's inputs receive any
   gradient (asked when the caller can run that probe);
10. ``"no factor"``: none of the above.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Literal

import torch
from torch import Tensor

__all__ = [
    "Finding",
    "Misrouted",
    "NoGradient",
    "NonFinite",
    "RankDependent",
    "Row",
    "Scaled",
    "Tolerance",
    "Unreduced",
    "compare",
    "diagnose",
    "loss_factor",
    "near",
]

#: Where a distributed value lives: a rank, ``(r,)``, or a replica's coordinates along the
#: mesh dims over which the reassembled tensors are replicas.
Place = tuple[int, ...]


@dataclass(frozen=True)
class Tolerance:
    """When a distributed value equals the truth: ``torch.allclose`` in float64."""

    rtol: float
    atol: float

    @classmethod
    def default(
        cls, tensors: Sequence[Tensor], rtol: float | None, atol: float | None
    ) -> Tolerance:
        """``rtol=1e-7, atol=1e-10`` when every floating tensor is float64, else ``1e-4,
        1e-6`` (the ranks reduce in a different order than one process does)."""
        wide = all(t.dtype == torch.float64 for t in tensors if t.is_floating_point())
        default = (1e-7, 1e-10) if wide else (1e-4, 1e-6)
        return cls(default[0] if rtol is None else rtol, default[1] if atol is None else atol)

    def close(self, got: Tensor, want: Tensor) -> bool:
        return bool(torch.allclose(got.double(), want.double(), rtol=self.rtol, atol=self.atol))


@dataclass(frozen=True)
class Row:
    """One distributed value against what it should be. ``place`` is None for a value combined
    over ranks; ``scale`` is the ``k`` that best fits ``got = k * want`` (least squares), None
    when ``want`` is 0. A missing gradient reads as zeros."""

    name: str
    place: Place | None
    got: Tensor
    want: Tensor
    ok: bool
    max_abs_error: float
    max_rel_error: float
    scale: float | None
    note: str = ""


def compare(
    name: str,
    place: Place | None,
    got: Tensor | None,
    want: Tensor | None,
    tol: Tolerance,
    note: str = "",
) -> Row:
    if want is None:
        want = torch.zeros_like(got) if got is not None else torch.zeros(())
    if got is None:
        got = torch.zeros_like(want)
    got64, want64 = got.detach().double(), want.detach().double()
    diff = (got64 - want64).abs()
    max_abs = float(diff.max()) if diff.numel() else 0.0
    if not torch.isfinite(got64).all():
        max_abs = math.inf
    size = float(want64.abs().max()) if want64.numel() else 0.0
    max_rel = max_abs / size if size > 0 else (0.0 if max_abs == 0 else math.inf)
    ok = tol.close(got64, want64) and math.isfinite(max_abs)
    denom = float((want64 * want64).sum())
    scale = float((got64 * want64).sum()) / denom if denom > 0 else None
    return Row(name, place, got64, want64, ok, max_abs, max_rel, scale, note)


@dataclass(frozen=True)
class NonFinite:
    places: list[Place]  # where a value is not finite (none: a loss, or a combined value)


@dataclass(frozen=True)
class Unreduced:
    dim: str  # the mesh dim along which the replicas hold parts of the truth
    size: int
    how: Literal["sum", "mean"]


@dataclass(frozen=True)
class Scaled:
    factor: float
    size: int | None  # when the factor is 1/size or size; ``label`` names what has that size
    label: str
    failing: list[Row]


@dataclass(frozen=True)
class NoGradient:
    row: Row  # the first failing row whose place received no gradient


@dataclass(frozen=True)
class Misrouted:
    moves: list[tuple[Row, Place]]  # a failing row, and the place whose value it holds


@dataclass(frozen=True)
class RankDependent:
    agree: list[Place]
    differ: list[Place]


Finding = (
    Literal["agree", "forward differs", "local-only", "no factor"]
    | NonFinite
    | Unreduced
    | Scaled
    | NoGradient
    | Misrouted
    | RankDependent
)


def diagnose(
    rows: Sequence[Row],
    tol: Tolerance,
    *,
    sizes: Mapping[str, int],
    losses: tuple[float, Sequence[float]] | None = None,
    replica_dims: Sequence[tuple[str, int]] = (),
    crossed: Callable[[], bool] | None = None,
) -> Finding:
    """What ``rows`` say, the first finding that fits (the module's docstring lists them).

    ``sizes``: what ``N`` may be in a factor ``1/N`` or ``N``, by label. ``losses``: the
    single-process loss and the ranks'. ``replica_dims``: the mesh dims (name, size) along
    which the rows' places are coordinates. ``crossed``: whether any gradient reaches another
    rank when only rank 0 back-propagates (it runs the job again)."""
    finding = _non_finite(rows, losses[1] if losses is not None else ())
    if finding is not None:
        return finding
    if losses is not None and loss_factor(*losses) is None:
        return "forward differs"
    failing = [r for r in rows if not r.ok]
    if not failing:
        return "agree"
    found = _patterns(rows, failing, tol, sizes, replica_dims, crossed)
    return next(f for f in found if f is not None)


def _patterns(
    rows: Sequence[Row],
    failing: Sequence[Row],
    tol: Tolerance,
    sizes: Mapping[str, int],
    replica_dims: Sequence[tuple[str, int]],
    crossed: Callable[[], bool] | None,
) -> Iterator[Finding | None]:
    """Each pattern of disagreement in turn (None where it does not fit), asked lazily."""
    yield _unreduced(rows, replica_dims, tol)
    agree, differ = _places(rows)
    some_agree = bool(agree and differ)
    if not some_agree:  # a factor is about every rank
        yield _scaled(failing, sizes, tol)
    yield _no_gradient(failing)
    yield _misrouted(rows, failing, tol)
    if some_agree:
        yield RankDependent(agree, differ)
    if crossed is not None and not crossed():
        yield "local-only"
    yield "no factor"


def near(a: float, b: float, rtol: float) -> bool:
    return abs(a - b) <= max(1e-12, 10 * rtol * max(abs(a), abs(b)))


def loss_factor(reference: float, losses: Sequence[float]) -> float | None:
    """``J / L``, what the ranks' losses add up to over the single-process loss: ``N`` when
    every rank returns the global loss (or its local mean, over even shards), 1 when they are
    shares; None when they fit neither."""
    n, total = len(losses), sum(losses)
    if all(near(x, reference, 1e-6) for x in losses):
        return float(n)
    for candidate in (1.0, float(n)):
        if near(total, candidate * reference, 1e-6):
            return candidate
    return None


def _non_finite(rows: Sequence[Row], losses: Sequence[float]) -> NonFinite | None:
    bad = [r for r in rows if r.max_abs_error == math.inf]
    if not bad and all(math.isfinite(x) for x in losses):
        return None
    return NonFinite(sorted({r.place for r in bad if r.place is not None}))


def _unreduced(
    rows: Sequence[Row], dims: Sequence[tuple[str, int]], tol: Tolerance
) -> Unreduced | None:
    for i, (dim, size) in enumerate(dims):
        groups: dict[Place, list[Row]] = {}
        for row in rows:
            assert row.place is not None
            groups.setdefault(row.place[:i] + row.place[i + 1 :], []).append(row)
        if all(all(tol.close(r.got, g[0].got) for r in g) for g in groups.values()):
            continue  # the replicas along this dim agree: nothing is missing over it
        sums = [(torch.stack([r.got for r in g]).sum(0), g) for g in groups.values()]
        if all(tol.close(s, g[0].want) for s, g in sums):
            return Unreduced(dim, size, "sum")
        if all(tol.close(s / len(g), g[0].want) for s, g in sums):
            return Unreduced(dim, size, "mean")
    return None


def _places(rows: Sequence[Row]) -> tuple[list[Place], list[Place]]:
    """The places where every row agrees, and those where one differs."""
    places = {r.place for r in rows if r.place is not None}
    differ = {r.place for r in rows if r.place is not None and not r.ok}
    return sorted(places - differ), sorted(differ)


def _scaled(failing: Sequence[Row], sizes: Mapping[str, int], tol: Tolerance) -> Scaled | None:
    def every(k: float) -> bool:
        return all(tol.close(r.got, k * r.want) for r in failing)

    for label, n in sizes.items():
        if n > 1:
            for k in (1.0 / n, float(n)):
                if every(k):
                    return Scaled(k, n, label, list(failing))
    best = failing[0].scale
    if best is None or near(best, 1.0, 1e-3) or not every(best):
        return None
    return Scaled(best, None, "", list(failing))


def _no_gradient(failing: Sequence[Row]) -> NoGradient | None:
    for row in failing:
        if row.place is not None and not bool((row.got != 0).any()):
            return NoGradient(row)
    return None


def _misrouted(rows: Sequence[Row], failing: Sequence[Row], tol: Tolerance) -> Misrouted | None:
    moves = []
    for row in failing:
        if row.place is None:
            continue
        for other in rows:
            if (
                other.name == row.name
                and other.place not in (None, row.place)
                and other.want.shape == row.got.shape
                and tol.close(row.got, other.want)
            ):
                assert other.place is not None
                moves.append((row, other.place))
                break
    return Misrouted(moves) if moves else None
