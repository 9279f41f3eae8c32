"""What every pattern checks at its door, declared as the collectives and the losses declare
theirs: one :class:`~distgrad.collectives._signature.Signature` per pattern, whose fields word
every message (``<op> on rank <group rank>: <argument> must ..., got ...``, a
CollectiveArgumentError), so one argument gets one message wherever it is checked.

A pattern is made of collectives that check themselves across ranks, so its own signature is
checked on this rank only (``handshake=False``): nothing is exchanged or counted for it. A
problem a pattern finds past its door (in the data, or in what the ranks' calls make
together) is worded the same way by ``Bound.error``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

import torch
from torch import Tensor

from distgrad._exchange.group import ProcessGroup
from distgrad._mesh import GroupLike, process_group
from distgrad.collectives._common import OBJECTIVES
from distgrad.collectives._fields import (
    Args,
    Choice,
    Count,
    Dim,
    NotBoth,
    Option,
    Scalar,
    ScalarField,
    TensorArg,
    tensor_problem,
)
from distgrad.collectives._list_fields import ListField, Parts, Sizes
from distgrad.collectives._signature import Signature

__all__ = [
    "COLUMN_LAYER",
    "COLUMN_PARALLEL_LINEAR",
    "COMBINE",
    "COPY_TO_REGION",
    "DISPATCH",
    "GATHER_FROM_SEQUENCE",
    "REDUCE_FROM_REGION",
    "REDUCE_SCATTER_TO_SEQUENCE",
    "RING_ATTENTION",
    "ROUTE",
    "ROW_LAYER",
    "ROW_PARALLEL_LINEAR",
    "SPLIT_TO_SEQUENCE",
    "SYNC_BATCH_NORM",
    "as_process_group",
]


def as_process_group(group: GroupLike, op: str) -> ProcessGroup | None:
    """The ``ProcessGroup`` a module keeps for ``group`` (None stays None: the default group
    when the module runs), so that ``module.group`` is the group whatever form named it."""
    if group is None or isinstance(group, ProcessGroup):
        return group
    return process_group(group, op)


def _pattern(
    op: str,
    *fields: ScalarField,
    lists: tuple[ListField, ...] = (),
    tensor: str = "x",
    tensor_on: Literal["every", "none"] = "every",
) -> Signature:
    return Signature(
        op, fields=fields, lists=lists, tensor=tensor, tensor_on=tensor_on, handshake=False
    )


class _Relation(Scalar):
    """A field that relates its argument to others (its own check, worded here)."""

    same = False
    shown = False

    def code(self, value: Any, args: Args) -> int:
        return 0


@dataclass(frozen=True)
class _Decision(_Relation):
    """``route``'s ``num_experts`` (E): from the router's logits, or given with a decision
    made elsewhere (``experts=``), never both ways."""

    name: str = "num_experts"

    def local(self, value: Any, args: Args) -> tuple[Any, str | None]:
        logits, experts = args.passed["logits"], args.passed["experts"]
        if experts is None:
            if logits is None:
                return None, "pass logits [tokens, experts], or a decision made elsewhere: experts="
            if (
                value is not None
                or args.passed["weights"] is not None
                or args.passed["kept"] is not None
            ):
                return None, (
                    "weights=, kept= and num_experts= go with experts= (a decision made "
                    "elsewhere), not with logits"
                )
            return logits.shape[1], None
        if logits is not None:
            return None, "pass logits or experts= (a decision made elsewhere), not both"
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            return None, f"experts= needs num_experts= (E, at least 1), got {value!r}"
        return value, None


@dataclass(frozen=True)
class _TopK(_Relation):
    """``route``'s ``k``: between 1 and the experts, when the router's logits choose."""

    name: str = "k"

    def local(self, value: Any, args: Args) -> tuple[Any, str | None]:
        experts = args.values["num_experts"]
        if args.passed["logits"] is not None and (
            not isinstance(value, int) or not 1 <= value <= experts
        ):
            return value, f"k must be between 1 and the {experts} experts, got {value!r}"
        return value, None


@dataclass(frozen=True)
class _Dispatched(_Relation):
    """``combine``'s ``routing``: ``y`` holds the rows ``dispatch`` returned for it."""

    name: str = "routing"

    def local(self, value: Any, args: Args) -> tuple[Any, str | None]:
        y, rows = args.x, value.by_expert.shape[0]
        if isinstance(y, Tensor) and y.dim() and y.shape[0] != rows:
            return (
                None,
                f"y must have the {rows} rows dispatch returned on this rank, got {y.shape[0]}",
            )
        return None, None


@dataclass(frozen=True)
class _Blocks(_Relation):
    """Ring attention's ``k`` and ``v`` beside ``q``: this rank's block of the sequence."""

    name: str = "v"

    def local(self, value: Any, args: Args) -> tuple[Any, str | None]:
        q, k = args.x, args.passed["k"]
        if not isinstance(q, Tensor):
            return None, tensor_problem(q, "q")
        if k.shape[:-1] != q.shape[:-1] or value.shape[:-1] != k.shape[:-1]:
            return None, (
                "q, k and v must share every dim but the last (this rank's block of the "
                f"sequence at dim -2), got {tuple(q.shape)}, {tuple(k.shape)}, "
                f"{tuple(value.shape)}"
            )
        if q.shape[-1] != k.shape[-1]:
            return None, f"q and k must have the same last dim, got {q.shape[-1]} and {k.shape[-1]}"
        return None, None


_OBJECTIVE = Choice("objective", OBJECTIVES)
_WEIGHT, _BIAS = TensorArg("weight"), TensorArg("bias", optional=True)
# Megatron's rule, for the function and the layer alike.
_GATHER_OUTPUT = NotBoth(
    "gather_output",
    "sequence_parallel",
    " (as in Megatron): gather_output needs the whole input on every rank; gather the rows "
    "after the layer with gather_from_sequence",
)

# Tensor and sequence parallelism (_tensor.py).
COPY_TO_REGION = _pattern("copy_to_region")
REDUCE_FROM_REGION = _pattern("reduce_from_region")
GATHER_FROM_SEQUENCE = _pattern("gather_from_sequence", _OBJECTIVE)
SPLIT_TO_SEQUENCE = _pattern("split_to_sequence", _OBJECTIVE, Dim(), lists=(Sizes(rule="split"),))
REDUCE_SCATTER_TO_SEQUENCE = _pattern("reduce_scatter_to_sequence")
COLUMN_PARALLEL_LINEAR = _pattern(
    "column_parallel_linear",
    _OBJECTIVE,
    _WEIGHT,
    _BIAS,
    Option("sequence_parallel"),
    _GATHER_OUTPUT,
)
# splits, when a whole input is split here (input_is_parallel=False): x's features.
ROW_PARALLEL_LINEAR = _pattern(
    "row_parallel_linear",
    _OBJECTIVE,
    _WEIGHT,
    _BIAS,
    lists=(Parts("splits", total="x", whole="the features of x (its last dim)"),),
)
COLUMN_LAYER = _pattern(
    "ColumnParallelLinear",
    _OBJECTIVE,
    Option("sequence_parallel"),
    _GATHER_OUTPUT,
    Count("out_features"),
    lists=(Parts("splits", total="out_features", whole="out_features"),),
    tensor_on="none",
)
ROW_LAYER = _pattern(
    "RowParallelLinear",
    _OBJECTIVE,
    Count("in_features"),
    lists=(Parts("splits", total="in_features", whole="in_features"),),
    tensor_on="none",
)

# Mixture of experts (_moe.py). route has no x: its tensors are its fields.
ROUTE = _pattern(
    "route",
    Choice("order", ("token", "choice")),
    Count("capacity", optional=True),
    TensorArg("logits", optional=True, dims=2, expected="[tokens, experts]"),
    TensorArg(
        "experts",
        optional=True,
        dims=2,
        dtypes=(torch.int64, torch.int32),
        expected="[tokens, k] integer expert ids",
    ),
    TensorArg("weights", optional=True, like="experts", expected="of shape {like} like experts"),
    TensorArg(
        "kept",
        optional=True,
        like="experts",
        dtypes=(torch.bool,),
        expected="a bool tensor of shape {like} like experts",
    ),
    NotBoth("capacity", "kept", " (kept: what is kept, decided)"),
    _Decision(),
    _TopK(),
    lists=(Parts("experts_per_rank", total="num_experts", whole="the number of experts"),),
    tensor_on="none",
)
DISPATCH = _pattern("dispatch")
COMBINE = _pattern("combine", _Dispatched(), tensor="y")

# Ring attention (_ring_attention.py): q is this rank's block; sizes along the sequence.
RING_ATTENTION = _pattern(
    "ring_attention",
    TensorArg("k"),
    TensorArg("v"),
    _Blocks(),
    lists=(Sizes(rule="own", along=-2),),
    tensor="q",
)

# Synchronized batch norm (_batchnorm.py).
SYNC_BATCH_NORM = _pattern(
    "sync_batch_norm", TensorArg("x", least_dims=2, expected="[batch, channels, ...]")
)
