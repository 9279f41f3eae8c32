"""The typed arguments of a :class:`~distgrad.collectives._signature.Signature`.

Each field is one argument, declared once per op, and gives everything about it:

* its **local check**, ``local(value, args)``: the value as the op uses it (``dim`` made
  non-negative, a ``dist.ReduceOp`` as its name, ``sizes`` split) and this rank's problem with
  it, worded ``"<argument> must be <what is expected>, got <what was passed>"``;
* its **cross-rank check**: ``code(value, passed)``, the integer every rank sends in the
  handshake, ``show(code)`` how a peer's code reads in a message, and ``same`` (a list field):
  whether every rank must pass the same list. The rule of a mismatch is ``"every rank must pass
  the same <argument>"``;
* its place in the **call's description** (``shown``): ``all_gather(dim=0)``,
  ``reduce(dst=0, op='sum')``, which starts every message about the call.

So every message about an argument comes from here, named by its declared name.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import torch
from torch import Tensor

from distgrad._exchange.group import Group
from distgrad._exchange.handshake import dtype_problem
from distgrad.collectives import _common as c

__all__ = ["Args", "Choice", "Dim", "ListField", "Perm", "Rank", "Reduction", "Shape", "Sizes"]


@dataclass(slots=True)
class Args:
    """One call's arguments as its fields check them: what was passed, and what the fields
    before have made of theirs (so ``sizes`` reads the checked ``dim``)."""

    group: Group
    x: object
    passed: Mapping[str, Any]
    tensor_optional: bool  # whether a rank may pass no tensor (scatter's receivers)
    values: dict[str, Any]

    @property
    def dim(self) -> int:
        dim: int = self.values.get("dim", 0)
        return dim


class _Scalar:
    """What the scalar fields share: a peer's code reads as itself, and the call's description
    shows the value as it was passed."""

    def show(self, code: int) -> object:
        return code

    def describe(self, value: Any) -> str:
        return repr(value)


@dataclass(frozen=True)
class Rank(_Scalar):
    """A group rank every rank passes alike (``src``, ``dst``)."""

    name: str
    shown: bool = True

    def local(self, value: Any, args: Args) -> tuple[Any, str | None]:
        if not isinstance(value, int) or not 0 <= value < args.group.size:
            expected = f"a group rank in [0, {args.group.size})"
            return value, f"{self.name} must be {expected}, got {value!r}"
        return value, None

    def code(self, value: Any, args: Args) -> int:
        return value if isinstance(value, int) else -1


@dataclass(frozen=True)
class Dim(_Scalar):
    """The dim an op works along, made non-negative for ``x``.

    Across ranks: the non-negative dim, or the dim as passed where a rank may pass no tensor
    (it cannot make it non-negative).
    """

    name: str = "dim"
    shown: bool = True

    def local(self, value: Any, args: Args) -> tuple[Any, str | None]:
        x = args.x
        if x is None and args.tensor_optional:
            return 0, None
        ndim = x.dim() if isinstance(x, Tensor) else 1  # a non-tensor x: the signature says so
        if ndim == 0:
            return 0, "x must have at least 1 dim, got a 0-dim tensor (use x.unsqueeze(0))"
        if not isinstance(value, int) or not -ndim <= value < ndim:
            expected = f"in [{-ndim}, {ndim}) for a tensor with {ndim} dims"
            return 0, f"{self.name} must be {expected}, got {value!r}"
        return value % ndim, None

    def code(self, value: Any, args: Args) -> int:
        # A rank that may pass no tensor cannot make dim non-negative: compare dims as passed.
        chosen = args.passed[self.name] if args.tensor_optional else value
        return chosen if isinstance(chosen, int) else -1


@dataclass(frozen=True)
class Choice(_Scalar):
    """One of a few names (``objective``); across ranks, its index in ``options``."""

    name: str
    options: tuple[str, ...]
    shown: bool = False

    def local(self, value: Any, args: Args) -> tuple[Any, str | None]:
        if value not in self.options:
            return value, f"{self.name} must be one of {sorted(self.options)}, got {value!r}"
        return value, None

    def code(self, value: Any, args: Args) -> int:
        return self.options.index(value) if value in self.options else -1

    def show(self, code: int) -> object:
        return self.options[code] if 0 <= code < len(self.options) else "?"


@dataclass(frozen=True)
class Reduction(Choice):
    """``op``: a reduction's name, or torch's ``dist.ReduceOp`` for it, which ``x``'s dtype
    must support (a local check: torch reduces this dtype on this device or not)."""

    name: str = "op"
    options: tuple[str, ...] = c.REDUCE_OPS
    shown: bool = True

    def local(self, value: Any, args: Args) -> tuple[Any, str | None]:
        name = c.op_name(value)
        if name not in self.options:
            return name, (
                f"{self.name} must be one of {sorted(self.options)} (or their dist.ReduceOp), "
                f"got {name!r}"
            )
        return name, reduce_dtype_problem(name, args.x)

    def describe(self, value: Any) -> str:
        return repr(c.op_name(value))  # dist.ReduceOp.SUM reads 'sum', as the checks name it


ScalarField = Rank | Dim | Choice


@dataclass(frozen=True)
class Sizes:
    """One length per rank along ``dim``, carried whole in the handshake.

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

    def local(self, value: Any, args: Args) -> tuple[tuple[int, ...] | None, str | None]:
        n, rank, dim = args.group.size, args.group.rank, args.dim
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
            return (
                None,
                f"{self.name} must be {n} non-negative ints (one per rank), got {list(value)}",
            )
        if self.rule == "parts" and not isinstance(args.x, Tensor):
            got = "None" if args.x is None else type(args.x).__qualname__
            return None, (
                f"x must be a tensor shaped like this rank's part (its dtype and trailing dims, "
                f"as torch.distributed.scatter's output tensor) when {self.name} is given, got "
                f"{got}; or pass neither"
            )
        mine = c.extent(args.x, dim)
        if self.rule in ("own", "parts") and value[rank] != mine:
            entry = f"{self.name}[{rank}] must be {mine}"
            return None, f"{entry}, the entries of this rank's x along dim {dim}, got {value[rank]}"
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


ListField = Sizes | Perm | Shape


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
    if len(sizes) != parts or any(not isinstance(s, int) or s < 0 for s in sizes):
        return None, f"{name} must be {parts} non-negative ints (one per rank), got {list(sizes)}"
    if sum(sizes) != total:
        return None, (
            f"{name} must add up to {total}, the entries of x along dim {dim}, got "
            f"{list(sizes)} (which add up to {sum(sizes)})"
        )
    return sizes, None


# What a reduction computes locally with torch, by op: a dtype torch cannot reduce this way
# (float8, float4, bits; complex max and min) is refused at the call, naming the dtype.
_LOCAL_REDUCTIONS = {
    "sum": lambda t: t.sum(),
    "avg": lambda t: t.sum(),
    "prod": lambda t: t.prod(),
    "max": lambda t: t.amax(),
    "min": lambda t: t.amin(),
}
_reducible: dict[tuple[torch.dtype, str, str], str | None] = {}


def reduce_dtype_problem(op: str, x: object) -> str | None:
    """Why ``x``'s dtype cannot be reduced with ``op``, or None (also for a non-tensor ``x``
    or a dtype that cannot be sent: those are reported by the signature).

    Found by asking torch to reduce two entries of that dtype on that device type, once per
    (dtype, device type, op): the backends reduce what torch's kernels reduce, or less (gloo
    adds no 16-bit or unsigned integers beyond uint8: docs/semantics.md).
    """
    if not isinstance(x, Tensor) or op not in _LOCAL_REDUCTIONS or x.device.type == "meta":
        return None
    if dtype_problem(x.dtype) is not None:
        return None
    key = (x.dtype, x.device.type, op)
    if key not in _reducible:
        try:
            _LOCAL_REDUCTIONS[op](torch.zeros(2, dtype=x.dtype, device=x.device))
            _reducible[key] = None
        except (RuntimeError, NotImplementedError, TypeError) as exc:
            first = f"{exc}".splitlines()[0] if f"{exc}" else type(exc).__name__
            _reducible[key] = (
                f"op must be a reduction torch computes on x's dtype, got {op!r}: torch cannot "
                f"reduce {x.dtype} tensors with it ({first}); cast x to a dtype torch can "
                "reduce, e.g. x.float(), or gather it and reduce it yourself"
            )
    return _reducible[key]
