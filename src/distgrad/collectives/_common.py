"""What every differentiable collective shares: argument checks a rank makes alone, dim moves.

Cross-rank checks live in ``_signature``; everything here looks at one rank's arguments only.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal

import torch
import torch.distributed as dist
from torch import Tensor

from distgrad._meta import dtype_problem

__all__ = [
    "OBJECTIVES",
    "REDUCE_OPS",
    "Objective",
    "ReduceOp",
    "anchor",
    "as_bytes",
    "byte_shape",
    "extent",
    "from_bytes",
    "from_front",
    "ndim_of",
    "near_even",
    "normalize_dim",
    "objective_problem",
    "offsets",
    "op_name",
    "op_problem",
    "output",
    "rank_problem",
    "reduce_dtype_problem",
    "sizes_problem",
    "split_sizes",
    "to_front",
]

ReduceOp = Literal["sum", "avg", "prod", "max", "min"] | dist.ReduceOp | dist.ReduceOp.RedOpType
Objective = Literal["sum", "replicated"]
REDUCE_OPS: tuple[str, ...] = ("sum", "avg", "prod", "max", "min")
OBJECTIVES: tuple[str, ...] = ("sum", "replicated")

# torch.distributed's reduce ops, as every torch user writes them (dist.ReduceOp.SUM).
_TORCH_OP_NAMES = {
    dist.ReduceOp.SUM: "sum",
    dist.ReduceOp.AVG: "avg",
    dist.ReduceOp.PRODUCT: "prod",
    dist.ReduceOp.MAX: "max",
    dist.ReduceOp.MIN: "min",
}


def op_name(op: object) -> str:
    """``op`` as distgrad's name: a name as it is, one of torch's ``dist.ReduceOp`` values as
    its name; anything else shown as what it is (and refused by ``op_problem``)."""
    if isinstance(op, str):
        return op
    for torch_op, name in _TORCH_OP_NAMES.items():
        if op == torch_op:
            return name
    return f"<{type(op).__name__} {op}>"


def op_problem(op: str, allowed: Sequence[str] = REDUCE_OPS) -> str | None:
    if op not in allowed:
        return f"op must be one of {sorted(allowed)} (or their dist.ReduceOp), got {op!r}"
    return None


def objective_problem(objective: object) -> str | None:
    if objective not in OBJECTIVES:
        return f"objective must be one of {sorted(OBJECTIVES)}, got {objective!r}"
    return None


def sizes_problem(name: str, sizes: Sequence[int], parts: int) -> str | None:
    """Whether ``sizes`` is one non-negative int per rank."""
    if len(sizes) != parts or any(not isinstance(s, int) or s < 0 for s in sizes):
        return f"{name} must be {parts} non-negative ints (one per rank), got {list(sizes)}"
    return None


def split_sizes(
    name: str, sizes: Sequence[int] | None, total: int, parts: int
) -> tuple[tuple[int, ...], str | None]:
    """The part lengths along dim: ``sizes`` checked, or an even split when it is None.

    Returns the lengths (zeros when invalid, so callers can still join the handshake) and the
    problem, if any, worded for the user; ``name`` is the argument's name in messages.
    """
    if sizes is None:
        if total % parts:
            return (0,) * parts, (
                f"x has {total} entries along dim, which does not divide evenly over {parts} "
                f"ranks; pass {name}=[...] to split unevenly"
            )
        return (total // parts,) * parts, None
    sizes = tuple(sizes)
    problem = sizes_problem(name, sizes, parts)
    if problem is None and sum(sizes) != total:
        problem = f"{name} {list(sizes)} add up to {sum(sizes)}, but x has {total} along dim"
    return ((0,) * parts, problem) if problem else (sizes, None)


def rank_problem(name: str, value: object, size: int) -> str | None:
    if not isinstance(value, int) or not 0 <= value < size:
        return f"{name} must be a group rank in [0, {size}), got {value!r}"
    return None


def normalize_dim(dim: int, ndim: int) -> tuple[int, str | None]:
    """``dim`` as a non-negative index, or a problem if it does not exist."""
    if ndim == 0:
        return 0, "x must have at least 1 dim, got a 0-dim tensor (use x.unsqueeze(0))"
    if not isinstance(dim, int) or not -ndim <= dim < ndim:
        return 0, f"dim {dim} is out of range for a tensor with {ndim} dims"
    return dim % ndim, None


def ndim_of(x: object) -> int:
    """``x.dim()``, or 1 for a non-tensor (whose problem is reported by the signature)."""
    return x.dim() if isinstance(x, Tensor) else 1


def extent(x: object, dim: int) -> int:
    """``x.shape[dim]``, or 0 when ``x`` is not a tensor or has no such dim."""
    if not isinstance(x, Tensor) or not -x.dim() <= dim < max(x.dim(), 1) or x.dim() == 0:
        return 0
    return int(x.shape[dim])


def anchor(x: Tensor | None, required: bool, device: torch.device | None = None) -> Tensor | None:
    """A leaf that makes autograd record an op on a rank that passes no tensor (scatter's
    receivers) when the source's input requires grad: the backward is a collective that every
    rank must run."""
    if not required or (x is not None and x.requires_grad):
        return None
    return torch.empty(0, device=device if x is None else x.device, requires_grad=True)


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
    """Why ``x``'s dtype cannot be reduced with ``op``, or None (also for a non-tensor ``x``,
    an unknown ``op`` or a dtype that cannot be sent: those are reported elsewhere).

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
                f"op={op!r} cannot reduce {x.dtype} tensors (torch: {first}); cast x to a "
                "dtype torch can reduce, e.g. x.float(), or gather it and reduce it yourself"
            )
    return _reducible[key]


# The dtypes the backends move natively. Every other dtype (complex, float8, float4, bits,
# int16 and the unsigned types but uint8) is moved as its bytes by the ops that only move
# data: gloo's broadcast, gather and scatter refuse them ("Invalid scalar type"), and moving
# bytes is exact for any dtype. Reductions cannot do this; see reduce_dtype_problem.
_NATIVE = frozenset(
    {
        torch.float32,
        torch.float64,
        torch.float16,
        torch.bfloat16,
        torch.int8,
        torch.uint8,
        torch.int32,
        torch.int64,
        torch.bool,
    }
)


def as_bytes(x: Tensor) -> Tensor:
    """``x`` itself for a natively moved dtype; else its bytes, a uint8 view with one more
    trailing dim of the item size (the leading dims, which the exchanges split, stay)."""
    if x.dtype in _NATIVE:
        return x
    return x.contiguous().unsqueeze(-1).view(torch.uint8)


def from_bytes(y: Tensor, dtype: torch.dtype) -> Tensor:
    """The inverse of :func:`as_bytes` for a tensor of ``dtype``."""
    if dtype in _NATIVE:
        return y
    return y.view(dtype).squeeze(-1)


def byte_shape(trailing: tuple[int, ...], dtype: torch.dtype) -> tuple[int, ...]:
    """What :func:`as_bytes` makes of a tensor of ``dtype`` whose shape ends in ``trailing``."""
    return trailing if dtype in _NATIVE else (*trailing, dtype.itemsize)


def to_front(x: Tensor, dim: int) -> Tensor:
    """``x`` with ``dim`` moved to the front and contiguous: the layout ``_comm`` works in."""
    return (x if dim == 0 else x.movedim(dim, 0)).contiguous()


def from_front(y: Tensor, dim: int) -> Tensor:
    return y if dim == 0 else y.movedim(0, dim)


def output(y: Tensor) -> Tensor:
    """``y`` as an autograd Function returns it: a new tensor object on the same memory.

    Two reasons, both about what autograd does with the output. (1) Autograd forbids modifying
    a custom Function's output in place when that output is a view (``movedim`` for
    ``dim != 0``, a slice of a padded buffer), so the caller could not, say, scale an
    all_gather's result in place. (2) A collective's work object may still hold its output
    buffer for a moment after it completes, and AccumulateGrad copies a gradient that anything
    else references instead of taking it (measured on gloo: 1 in 5 backwards of a 4096 x 512
    all_gather copied 8 MB). ``detach()`` gives a tensor nobody else holds, without the view
    relation, on memory the collective no longer writes.
    """
    return y.detach()


def near_even(total: int, parts: int) -> list[int]:
    """Split ``total`` into ``parts`` sizes that differ by at most one, larger ones first."""
    base, extra = divmod(total, parts)
    return [base + (1 if i < extra else 0) for i in range(parts)]


def offsets(sizes: Sequence[int]) -> list[int]:
    out = [0]
    for s in sizes:
        out.append(out[-1] + s)
    return out
