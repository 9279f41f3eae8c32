"""The local reductions in the middle of prod, max and min: over the N slices a rank received.

``amax``/``amin`` are torch's, with its rule for ties (the gradient is split evenly among the
entries that hold the extreme value). ``prod`` is not torch's: ``torch.prod``'s backward
divides the product by each entry where it can, which turns an infinite entry into nan
(``inf / inf``) and loses the gradient when the full product over- or underflows while the
others' product does not. Here each entry's gradient is the product of the *other* entries,
from prefix and suffix products, with no division: exact for zeros, infinities and overflow.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor
from torch.autograd.function import FunctionCtx

__all__ = ["others_product", "reduce_stacked"]


def others_product(stacked: Tensor) -> Tensor:
    """Entry i of the result (along dim 0) is the product of every entry but i."""
    ones = torch.ones_like(stacked[:1])
    before = torch.cat([ones, stacked[:-1].cumprod(0)])  # prod_{j < i}
    after = torch.cat([stacked[1:].flip(0).cumprod(0).flip(0), ones])  # prod_{j > i}
    return before * after


class _Prod(torch.autograd.Function):
    @staticmethod
    def forward(ctx: FunctionCtx, stacked: Tensor) -> Tensor:
        ctx.save_for_backward(stacked)
        return stacked.prod(0)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> Tensor:
        (stacked,) = ctx.saved_tensors
        # Built from differentiable ops, so a double backward works too.
        return grad.unsqueeze(0) * others_product(stacked)


def reduce_stacked(stacked: Tensor, op: str) -> Tensor:
    """Reduce ``stacked`` ([N, ...]) over dim 0 with ``op`` in prod, max, min."""
    if op == "max":
        return stacked.amax(0)
    if op == "min":
        return stacked.amin(0)
    assert op == "prod", op
    out: Tensor = _Prod.apply(stacked)  # type: ignore[no-untyped-call]
    return out
