"""distgrad: differentiable torch.distributed collectives with exact, checked gradients.

The objective every gradient refers to is the sum over ranks of what each rank back-propagates
(see docs/semantics.md); ``objective="replicated"`` selects the other contract where it applies.
"""

from __future__ import annotations

from distgrad import errors, integrations, losses, parallel, pipeline, rpc, testing
from distgrad._exchange.async_op import AsyncTensor
from distgrad._exchange.guard import set_guard
from distgrad._exchange.handshake import set_debug
from distgrad.collectives import (
    all_gather,
    all_reduce,
    all_to_all,
    broadcast,
    gather,
    permute,
    reduce,
    reduce_scatter,
    scatter,
)

__all__ = [
    "AsyncTensor",
    "all_gather",
    "all_reduce",
    "all_to_all",
    "broadcast",
    "errors",
    "gather",
    "integrations",
    "losses",
    "parallel",
    "permute",
    "pipeline",
    "reduce",
    "reduce_scatter",
    "rpc",
    "scatter",
    "set_debug",
    "set_guard",
    "testing",
]

__version__ = "0.1.0"
