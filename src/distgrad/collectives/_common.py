"""What every differentiable collective shares: argument checks a rank makes alone, dim moves.

Cross-rank checks live in ``_signature``; everything here looks at one rank's arguments only.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal

import torch
import torch.distributed as dist
from torch import Tensor

from distgrad.errors import UnsupportedAdjointError

__all__ = [
    "OBJECTIVES",
    "REDUCE_OPS",
    "Objective",
    "ReduceOp",
    "anchor",
    "apply",
    "check_grad_dtype",
    "extent",
    "from_front",
    "ndim_of",
    "near_even",
    "normalize_dim",
    "objective_problem",
    "offsets",
    "op_name",
    "op_problem",
    "output",
    "partner",
    "rank_problem",
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


def check_grad_dtype(desc: str, op: str, x: Tensor) -> None:
    if x.dtype.is_complex and op in ("max", "min") and x.requires_grad:
        raise UnsupportedAdjointError(
            f"{desc}: op={op!r} has no gradient for complex tensors (complex numbers are not "
            "ordered)"
        )


def apply(function: type[torch.autograd.Function], *args: object) -> Tensor:
    """``function.apply(*args)``, typed (torch leaves ``Function.apply`` untyped)."""
    out: Tensor = function.apply(*args)  # type: ignore[no-untyped-call]
    return out


def partner(function: type[torch.autograd.Function], *args: object) -> Tensor:
    """A backward's partner op: differentiable when the backward itself is recorded (a double
    backward, ``create_graph=True``), else its forward's work alone (``function.run``): an
    ``autograd.Function`` call costs 10-20 us, a tenth of a small exchange."""
    if torch.is_grad_enabled():
        return apply(function, *args)
    out: Tensor = function.run(*args)  # type: ignore[attr-defined]
    return out


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
