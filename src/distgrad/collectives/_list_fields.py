"""The integer-list arguments of a :class:`~distgrad.collectives._signature.Signature`:
``sizes``, ``perm``, ``recv_shape``, a layer's ``splits``.

A list field is a field (``_fields``) carried whole in the handshake, so messages show the
lists (never a hash); ``same`` says whether every rank passes the same list, and ``known``
whether this rank knows every rank's lengths without an exchange.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal, Protocol

from torch import Tensor

from distgrad._exchange.group import own_rows
from distgrad.collectives import _common as c
from distgrad.collectives._fields import Args

__all__ = ["ListField", "Parts", "Perm", "Shape", "Sizes", "parts_problem", "split_sizes"]


class ListField(Protocol):
    """What a signature reads of a list field."""

    @property
    def name(self) -> str: ...
    @property
    def same(self) -> bool: ...
    def local(self, value: Any, args: Args) -> tuple[tuple[int, ...] | None, str | None]: ...
    def known(self, passed: Mapping[str, Any]) -> bool: ...


@dataclass(frozen=True)
class Sizes:
    """One length per rank along ``dim`` (or along the fixed dim ``along``).

    ``rule`` says what this rank's list means and what its absence means:

    * ``"own"``: every rank's extent; entry ``rank`` is this rank's. Absent: learned from the
      peers (the call exchanges its metadata);
    * ``"split"``: the parts this rank's ``x`` is split into. Absent: an even split;
    * ``"parts"``: scatter's: on the rank named by the field ``root``, the parts its ``x`` is
      split into (absent: even); elsewhere the same list, with ``x`` shaped like this rank's
      part. Absent there: learned from the root;
    * ``"any"``: one length per rank. Absent: learned, unless ``even_with`` (a ``"split"``
      field) is absent too, when it is that field's even split.
    """

    name: str = "sizes"
    rule: Literal["own", "split", "parts", "any"] = "own"
    same: bool = True
    root: str = ""
    even_with: str = ""
    along: int | None = None

    def local(self, value: Any, args: Args) -> tuple[tuple[int, ...] | None, str | None]:
        n, rank = args.group.size, args.group.rank
        dim = args.dim if self.along is None else self.along
        if self.rule == "split" or (self.rule == "parts" and args.values[self.root] == rank):
            if self.rule == "parts" and args.x is None:
                where = f"the source rank ({self.root}={rank})"
                return None, f"x must be the tensor to scatter on {where}, got None"
            return split_sizes(self.name, value, c.extent(args.x, dim), dim, n)
        if value is None:
            unknown = self.rule != "any" or args.passed[self.even_with] is not None
            return (None if unknown else args.values[self.even_with]), None
        value = tuple(value)
        if len(value) != n or any(not isinstance(s, int) or s < 0 for s in value):
            return None, _count_problem(self.name, value, n)
        if self.rule == "parts" and not isinstance(args.x, Tensor):
            got = "None" if args.x is None else type(args.x).__qualname__
            return None, (
                f"x must be a tensor shaped like this rank's part (its dtype and trailing dims, "
                f"as torch.distributed.scatter's output tensor) when {self.name} is given, got "
                f"{got}; or pass neither"
            )
        mine = c.extent(args.x, dim)
        if self.rule in ("own", "parts") and own_rows(value, rank) != mine:
            entry = f"{self.name}[{rank}] must be {mine}"
            along = f"the entries of this rank's {args.tensor} along dim {dim}"
            return None, f"{entry}, {along}, got {value[rank]}"
        return value, None

    def known(self, passed: Mapping[str, Any]) -> bool:
        """Whether this rank knows every rank's lengths without an exchange."""
        if self.rule == "split":
            return True
        if self.rule == "any" and passed[self.even_with] is None:
            return True
        return passed[self.name] is not None


@dataclass(frozen=True)
class Perm:
    """A permutation of the group ranks (rank r sends to ``perm[r]``), the same on every rank."""

    name: str = "perm"
    same: bool = True

    def local(self, value: Any, args: Args) -> tuple[tuple[int, ...] | None, str | None]:
        perm = tuple(value)
        if sorted(perm) != list(range(args.group.size)) or not all(
            isinstance(p, int) for p in perm
        ):
            return perm, (
                f"{self.name} must be a permutation of the group ranks 0..{args.group.size - 1}, "
                f"got {list(perm)}"
            )
        return perm, None

    def known(self, passed: Mapping[str, Any]) -> bool:
        return True


@dataclass(frozen=True)
class Shape:
    """A shape this rank receives (``recv_shape``). Absent: learned from the peers."""

    name: str
    same: bool = False

    def local(self, value: Any, args: Args) -> tuple[tuple[int, ...] | None, str | None]:
        return (None if value is None else tuple(value)), None

    def known(self, passed: Mapping[str, Any]) -> bool:
        return passed[self.name] is not None


@dataclass(frozen=True)
class Parts:
    """A whole split into one part per rank (a layer's ``splits`` of its features, MoE's
    ``experts_per_rank``): ``total`` names the field whose value is the whole (``"x"``: the
    last dim of ``x``), ``whole`` words it; absent, as even as possible, larger parts first."""

    name: str
    total: str
    whole: str
    same: bool = False

    def local(self, value: Any, args: Args) -> tuple[tuple[int, ...] | None, str | None]:
        x = args.x
        total = x.shape[-1] if self.total == "x" and isinstance(x, Tensor) else 0
        if self.total != "x":
            total = args.values[self.total]
        if value is None:
            return tuple(c.near_even(total, args.group.size)), None
        value = tuple(value)
        problem = parts_problem(self.name, value, total, self.whole, args.group.size)
        return (None, problem) if problem else (value, None)

    def known(self, passed: Mapping[str, Any]) -> bool:
        return True


def _count_problem(name: str, sizes: Sequence[object], parts: int) -> str:
    return f"{name} must be {parts} non-negative ints (one per rank), got {list(sizes)}"


def parts_problem(
    name: str, sizes: Sequence[int], total: int, whole: str, parts: int
) -> str | None:
    """Why ``sizes`` cannot split ``total`` (``whole`` words it) into ``parts``, or None."""
    if len(sizes) != parts or any(not isinstance(s, int) or s < 0 for s in sizes):
        return _count_problem(name, sizes, parts)
    if sum(sizes) != total:
        return (
            f"{name} must add up to {total}, {whole}, got {list(sizes)} (which add up to "
            f"{sum(sizes)})"
        )
    return None


def split_sizes(
    name: str, sizes: Sequence[int] | None, total: int, dim: int, parts: int
) -> tuple[tuple[int, ...] | None, str | None]:
    """The part lengths along ``dim``: ``sizes`` checked, or an even split when it is None."""
    if sizes is None:
        if total % parts:
            return None, (
                f"{name} must be given to split x unevenly (x has {total} entries along dim "
                f"{dim}, which does not divide evenly over {parts} ranks), got None; pass "
                f"{name}=[...]"
            )
        return (total // parts,) * parts, None
    sizes = tuple(sizes)
    problem = parts_problem(name, sizes, total, f"the entries of x along dim {dim}", parts)
    return (None, problem) if problem else (sizes, None)
