"""The typed arguments of a :class:`~distgrad.collectives._signature.Signature`.

Each field is one argument, declared once per op (a collective, a loss or a parallel pattern),
and gives everything about it:

* its **local check**, ``local(value, args)``: the value as the op uses it (``dim`` made
  non-negative, a ``dist.ReduceOp`` as its name, ``sizes`` split) and this rank's problem with
  it, worded ``"<argument> must be <what is expected>, got <what was passed>"``;
* whether every rank passes the **same** value, and then its **cross-rank check**:
  ``code(value, args)``, the integer every rank sends in the handshake, and ``show(code)``,
  how a peer's code reads in a message. The rule of a mismatch is ``"every rank must pass the
  same <compared>"`` (``compared``: the argument's name, or what of it is compared);
* its place in the **call's description** (``shown``): ``all_gather(dim=0)``,
  ``reduce(dst=0, op='sum')``, which starts every message about the call.

So every message about an argument comes from here, named by its declared name, whichever op
it is passed to. The integer lists (``sizes``, ``perm``) are in ``_list_fields``; an argument
may have several fields (a check each), the last of which makes its value.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Protocol

import torch
from torch import Tensor

from distgrad._exchange.group import Group
from distgrad._exchange.handshake import dtype_problem
from distgrad._mesh import dtensor_problem
from distgrad.collectives import _common as c

__all__ = [
    "Args",
    "Block",
    "Choice",
    "Count",
    "Dim",
    "NotBoth",
    "Option",
    "Pair",
    "Positive",
    "Rank",
    "Reduction",
    "Scalar",
    "ScalarField",
    "TensorArg",
    "positive_problem",
    "tensor_problem",
]


@dataclass(slots=True)
class Args:
    """One call's arguments as its fields check them: what was passed, and what the fields
    before have made of theirs (so ``sizes`` reads the checked ``dim``)."""

    group: Group
    x: object
    passed: Mapping[str, Any]
    tensor_optional: bool  # whether a rank may pass no tensor (scatter's receivers)
    values: dict[str, Any]
    tensor: str = "x"  # x's name in messages (a loss's ``key``, ring attention's ``q``)
    # Whether this call is checked across ranks: a check that reads a tensor's value (a host
    # synchronisation) reads it only then.
    checked: bool = False

    @property
    def dim(self) -> int:
        dim: int = self.values.get("dim", 0)
        return dim


class ScalarField(Protocol):
    """What a signature reads of a scalar field (see the module docstring)."""

    @property
    def name(self) -> str: ...
    @property
    def shown(self) -> bool: ...
    @property
    def same(self) -> bool: ...
    @property
    def compared(self) -> str: ...
    def local(self, value: Any, args: Args) -> tuple[Any, str | None]: ...
    def code(self, value: Any, args: Args) -> int: ...
    def show(self, code: int) -> object: ...
    def describe(self, value: Any) -> str: ...


def tensor_problem(x: object, name: str = "x") -> str | None:
    """Why ``x`` cannot be the tensor argument ``name`` (not a tensor; a DTensor, with what to
    call instead), or None."""
    if isinstance(x, Tensor):
        return None if type(x) is Tensor else dtensor_problem(x, name)
    if x is None or isinstance(x, (bool, int, float, complex)):
        return f"{name} must be a torch.Tensor, got {x!r}"
    return f"{name} must be a torch.Tensor, got {type(x).__module__}.{type(x).__qualname__}"


class Scalar:
    """What the scalar fields share (a base for a field an op declares itself): every rank
    passes the same value, a peer's code reads as itself, and the call's description shows
    the value as it was passed."""

    name: str
    same = True

    @property
    def compared(self) -> str:
        return self.name

    def show(self, code: int) -> object:
        return code

    def describe(self, value: Any) -> str:
        return repr(value)


@dataclass(frozen=True)
class Rank(Scalar):
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
class Dim(Scalar):
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
class Choice(Scalar):
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


# ---------------------------------------------------------------------------------------------
# Fields checked on this rank alone: not carried in the handshake, not in the description.


class _Local(Scalar):
    same = False
    shown = False

    def code(self, value: Any, args: Args) -> int:
        return 0


def positive_problem(name: str, value: float) -> str | None:
    """Why ``value`` cannot be ``name``, a finite positive number, or None."""
    if not math.isfinite(value) or value <= 0:
        return f"{name} must be finite and positive, got {value}"
    return None


@dataclass(frozen=True)
class Positive(_Local):
    """A finite positive number, or a tensor holding one (a learnable temperature), whose value
    is read (a host synchronisation) only on the calls checked across ranks."""

    name: str

    def local(self, value: Any, args: Args) -> tuple[Any, str | None]:
        if isinstance(value, Tensor):
            return None, positive_problem(
                self.name, float(value.detach())
            ) if args.checked else None
        return None, positive_problem(self.name, value)


@dataclass(frozen=True)
class Block(_Local):
    """``block_size``: None (dense), ``"auto"`` or a positive int (the ring's block)."""

    name: str = "block_size"

    def local(self, value: Any, args: Args) -> tuple[Any, str | None]:
        if value is None or value == "auto":
            return value, None
        if isinstance(value, int) and not isinstance(value, bool) and value >= 1:
            return value, None
        return value, f"{self.name} must be None (dense), 'auto' or a positive int, got {value!r}"


@dataclass(frozen=True)
class Count(_Local):
    """An int of at least ``least`` (``capacity``, ``out_features``), or None if ``optional``."""

    name: str
    least: int = 0
    optional: bool = False

    def local(self, value: Any, args: Args) -> tuple[Any, str | None]:
        if value is None and self.optional:
            return None, None
        if isinstance(value, int) and not isinstance(value, bool) and value >= self.least:
            return value, None
        none = "None or " if self.optional else ""
        return value, f"{self.name} must be {none}at least {self.least}, got {value!r}"


@dataclass(frozen=True)
class Option(_Local):
    """An option used as passed, declared so that other fields may read it (``NotBoth``)."""

    name: str

    def local(self, value: Any, args: Args) -> tuple[Any, str | None]:
        return value, None


@dataclass(frozen=True)
class NotBoth(_Local):
    """An option that cannot go with another (given: anything but None and False); passes
    the value on as the fields before made it."""

    name: str
    other: str
    why: str = ""  # what the message adds: " (as in Megatron)"

    def local(self, value: Any, args: Args) -> tuple[Any, str | None]:
        other = args.passed[self.other]
        made = args.values.get(self.name, value)
        if not (value is None or value is False or other is None or other is False):
            return made, f"pass {self.other} or {self.name}, not both{self.why}"
        return made, None


@dataclass(frozen=True)
class TensorArg(_Local):
    """A tensor argument besides ``x`` (``weight``, ``logits``): a plain tensor (a DTensor is
    refused with what to call instead), of ``dims`` dims, of one of ``dtypes``, shaped
    ``like`` another tensor argument; None allowed where ``optional``. ``expected`` words
    what it must be (``{like}`` stands for the other tensor's shape)."""

    name: str
    optional: bool = False
    dims: int | None = None
    least_dims: int = 0
    dtypes: tuple[torch.dtype, ...] = ()
    like: str = ""
    expected: str = ""

    def local(self, value: Any, args: Args) -> tuple[Any, str | None]:
        if value is None and self.optional:
            return None, None
        problem = tensor_problem(value, self.name)
        if problem is not None:
            return None, problem
        like = args.passed[self.like] if self.like else None
        if (
            (self.dims is not None and value.dim() != self.dims)
            or value.dim() < self.least_dims
            or (self.dtypes and value.dtype not in self.dtypes)
            or (isinstance(like, Tensor) and value.shape != like.shape)
        ):
            expected = self.expected.format(like=_shape(like) if isinstance(like, Tensor) else "")
            got = f"{value.dtype} of " if self.dtypes else ""
            got += f"shape {_shape(value)}"
            return None, f"{self.name} must be {expected}, got {got}"
        return None, None


@dataclass(frozen=True)
class Pair(_Local):
    """A tensor whose rows pair with ``x``'s (a loss's query and key): both plain
    ``[batch, dim]`` tensors of the same shape."""

    name: str

    def local(self, value: Any, args: Args) -> tuple[Any, str | None]:
        x, names = args.x, f"{self.name} and {args.tensor}"
        problem = tensor_problem(value, self.name) or tensor_problem(x, args.tensor)
        if problem is not None:
            return None, problem
        assert isinstance(value, Tensor) and isinstance(x, Tensor)
        if value.dim() == 2 and value.shape == x.shape:
            return None, None
        shapes = f"{_shape(value)} and {_shape(x)}"
        if value.dim() != 2 or x.dim() != 2:
            return None, f"{names} must be [batch, dim] matrices, got shapes {shapes}"
        return None, f"{names} must have the same shape (rows are pairs), got {shapes}"


def _shape(x: Tensor) -> str:
    return str(tuple(x.shape))


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
