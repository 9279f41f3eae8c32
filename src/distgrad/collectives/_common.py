"""What every differentiable collective shares: argument checks, the handshake, dim moves.

The handshake (``distgrad._meta``) also settles one thing autograd cannot settle locally: whether
the op's output requires grad. A collective's backward is itself a collective, so either every
rank runs it or none does. The output therefore requires grad on every rank as soon as the input
does on *any* rank; a rank whose own input does not require grad passes a tiny ``anchor`` leaf to
the autograd function so that autograd still records the node, runs it in backward (taking part
in the communication) and returns no gradient for its input.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Literal

import torch
from torch import Tensor

from distgrad._group import Group
from distgrad._meta import RankCall, exchange, require_same
from distgrad.errors import UnsupportedAdjointError

__all__ = [
    "OBJECTIVES",
    "REDUCE_OPS",
    "Arg",
    "Objective",
    "ReduceOp",
    "anchor",
    "apply",
    "at_call",
    "check_shapes_equal",
    "check_shapes_except",
    "from_front",
    "handshake",
    "near_even",
    "needs_grad",
    "normalize_dim",
    "op_problem",
    "output",
    "split_sizes",
    "to_front",
]

ReduceOp = Literal["sum", "avg", "prod", "max", "min"]
Objective = Literal["sum", "replicated"]
REDUCE_OPS: tuple[str, ...] = ("sum", "avg", "prod", "max", "min")
OBJECTIVES: tuple[str, ...] = ("sum", "replicated")


def _same(value: int) -> object:
    return value


@dataclass(frozen=True)
class Arg:
    """One integer argument that every rank must pass identically, with how to show it."""

    name: str
    value: int
    show: Callable[[int], object] = field(default=_same)
    same: bool = True  # whether every rank must pass the same value


def op_problem(op: str, allowed: Sequence[str] = REDUCE_OPS) -> str | None:
    if op not in allowed:
        return f"op must be one of {sorted(allowed)}, got {op!r}"
    return None


def objective_problem(objective: str) -> str | None:
    if objective not in OBJECTIVES:
        return f"objective must be one of {sorted(OBJECTIVES)}, got {objective!r}"
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
    if len(sizes) != parts or any(not isinstance(s, int) or s < 0 for s in sizes):
        return (
            0,
        ) * parts, f"{name} must be {parts} non-negative ints (one per rank), got {list(sizes)}"
    if sum(sizes) != total:
        return (
            0,
        ) * parts, f"{name} {list(sizes)} add up to {sum(sizes)}, but x has {total} along dim"
    return sizes, None


def rank_problem(name: str, value: int, size: int) -> str | None:
    if not isinstance(value, int) or not 0 <= value < size:
        return f"{name} must be a group rank in [0, {size}), got {value!r}"
    return None


def normalize_dim(dim: int, ndim: int) -> tuple[int, str | None]:
    """``dim`` as a non-negative index, or a problem if it does not exist."""
    if ndim == 0:
        return 0, "x must have at least 1 dim, got a 0-dim tensor (use x.unsqueeze(0))"
    if not -max(ndim, 1) <= dim < max(ndim, 1):
        return 0, f"dim {dim} is out of range for a tensor with {ndim} dims"
    return dim % max(ndim, 1), None


def handshake(
    op: str,
    desc: str,
    group: Group,
    x: Tensor | None,
    args: Sequence[Arg] = (),
    problem: str | None = None,
) -> list[RankCall]:
    """Exchange calls and check what every op needs: same arguments, dtype and device type."""
    grad_mode = Arg("grad mode (torch.is_grad_enabled())", int(torch.is_grad_enabled()), bool)
    args = (*args, grad_mode)
    calls = exchange(op, desc, group, x, [a.value for a in args], problem)
    for i, arg in enumerate(args):
        if not arg.same:
            continue
        require_same(
            desc,
            group,
            calls,
            arg.name,
            _arg_value(i, arg),
            f"every rank must pass the same {arg.name}",
        )
    with_tensor = [c for c in calls if c.has_tensor]
    if with_tensor:
        require_same(
            desc,
            group,
            with_tensor,
            "dtype",
            lambda c: c.dtype,
            "every rank must pass the same dtype",
        )
        require_same(
            desc,
            group,
            with_tensor,
            "device type",
            lambda c: c.device_type,
            "every rank must pass tensors on the same kind of device",
        )
    return calls


def at_call(group: Group, calls: Sequence[RankCall]) -> Group:
    """``group`` marked with the call its handshake just made (debug mode checks backward order)."""
    return replace(group, call=calls[0].call)


def _arg_value(index: int, arg: Arg) -> Callable[[RankCall], object]:
    return lambda call: arg.show(call.args[index])


def check_shapes_equal(desc: str, group: Group, calls: Sequence[RankCall]) -> None:
    require_same(
        desc,
        group,
        calls,
        "shape",
        lambda c: c.shape,
        "every rank must pass a tensor of the same shape",
    )


def check_shapes_except(desc: str, group: Group, calls: Sequence[RankCall], dim: int) -> None:
    require_same(
        desc,
        group,
        calls,
        "number of dims",
        lambda c: len(c.shape),
        "every rank must pass a tensor with the same number of dims",
    )
    require_same(
        desc,
        group,
        calls,
        f"the shape outside dim {dim}",
        lambda c: tuple(s for i, s in enumerate(c.shape) if i != dim),
        f"all dims except dim {dim} must match",
        shown=lambda c: c.shape,
    )


def needs_grad(calls: Sequence[RankCall]) -> bool:
    return any(c.requires_grad for c in calls)


def anchor(x: Tensor | None, required: bool, device: torch.device | None = None) -> Tensor | None:
    """A leaf that makes autograd record the op here when another rank's input requires grad."""
    if not required or (x is not None and x.requires_grad):
        return None
    return torch.empty(0, device=device if x is None else x.device, requires_grad=True)


def check_grad_dtype(desc: str, op: str, dtype: torch.dtype | None, required: bool) -> None:
    if required and dtype is not None and dtype.is_complex and op in ("max", "min"):
        raise UnsupportedAdjointError(
            f"{desc}: op={op!r} has no gradient for complex tensors (complex numbers are not "
            "ordered)"
        )


def apply(function: type[torch.autograd.Function], *args: object) -> Tensor:
    """``function.apply(*args)``, typed (torch leaves ``Function.apply`` untyped)."""
    out: Tensor = function.apply(*args)  # type: ignore[no-untyped-call]
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
