"""What every differentiable collective shares: reduce op names, dim moves, moving bytes.

Argument checks live in ``_fields`` (each argument's own) and ``_signature`` (across ranks).
"""

from __future__ import annotations

from typing import Literal

import torch
import torch.distributed as dist
from torch import Tensor

from distgrad._exchange.async_op import AsyncTensor

__all__ = [
    "OBJECTIVES",
    "REDUCE_OPS",
    "Objective",
    "ReduceOp",
    "anchor",
    "as_bytes",
    "byte_shape",
    "extent",
    "from_exchange",
    "from_front",
    "near_even",
    "op_name",
    "output",
    "to_exchange",
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
    its name; anything else shown as what it is (and refused by ``_fields.Reduction``)."""
    if isinstance(op, str):
        return op
    for torch_op, name in _TORCH_OP_NAMES.items():
        if op == torch_op:
            return name
    return f"<{type(op).__name__} {op}>"


def extent(x: object, dim: int) -> int:
    """``x.shape[dim]``, or 0 when ``x`` is not a tensor or has no such dim."""
    if not isinstance(x, Tensor) or not -x.dim() <= dim < max(x.dim(), 1) or x.dim() == 0:
        return 0
    return x.shape[dim]  # (not int(): a per-rank extent under simulate=True stays one)


def anchor(x: Tensor | None, required: bool, device: torch.device | None = None) -> Tensor | None:
    """A leaf that makes autograd record an op on a rank that passes no tensor (scatter's
    receivers) when the source's input requires grad: the backward is a collective that every
    rank must run."""
    if not required or (x is not None and x.requires_grad):
        return None
    return torch.empty(0, device=device if x is None else x.device, requires_grad=True)


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


def byte_shape(trailing: tuple[int, ...], dtype: torch.dtype) -> tuple[int, ...]:
    """What :func:`as_bytes` makes of a tensor of ``dtype`` whose shape ends in ``trailing``."""
    return trailing if dtype in _NATIVE else (*trailing, dtype.itemsize)


def to_front(x: Tensor, dim: int) -> Tensor:
    """``x`` with ``dim`` moved to the front and contiguous: the layout the exchanges work in."""
    return (x if dim == 0 else x.movedim(dim, 0)).contiguous()


def from_front(y: Tensor, dim: int) -> Tensor:
    return y if dim == 0 else y.movedim(0, dim)


# The two below are what every op's run does around its exchange, each in one call: a
# forward+backward makes each twice, and at 32 KB a Python call is 1-2% of the exchange.


def to_exchange(x: Tensor, dim: int = 0) -> Tensor:
    """``as_bytes(to_front(x, dim))``: ``x`` as an exchange takes it."""
    y = (x if dim == 0 else x.movedim(dim, 0)).contiguous()
    return y if y.dtype in _NATIVE else y.unsqueeze(-1).view(torch.uint8)


def from_exchange(y: Tensor, dtype: torch.dtype, dim: int = 0) -> Tensor:
    """The inverse of :func:`to_exchange` for a tensor of ``dtype``, as an op returns it
    (:func:`output`)."""
    if dtype not in _NATIVE:
        y = y.view(dtype).squeeze(-1)
    return output(y if dim == 0 else y.movedim(0, dim))


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
    if isinstance(y, AsyncTensor) and y._base is None:
        return y  # async_op=True: a tensor of its own already, on no buffer of a work's
    return y.detach()


def near_even(total: int, parts: int) -> list[int]:
    """Split ``total`` into ``parts`` sizes that differ by at most one, larger ones first."""
    base, extra = divmod(total, parts)
    return [base + (1 if i < extra else 0) for i in range(parts)]
