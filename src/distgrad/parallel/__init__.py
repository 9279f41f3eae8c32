"""Model-parallel patterns built on distgrad's collectives, each equal to one process.

* Tensor and sequence parallelism: :func:`column_parallel_linear`,
  :func:`row_parallel_linear` (and their modules :class:`ColumnParallelLinear`,
  :class:`RowParallelLinear`), Megatron's region operators :func:`copy_to_region` ("f") and
  :func:`reduce_from_region` ("g"), and :func:`gather_from_sequence`,
  :func:`reduce_scatter_to_sequence` and :func:`split_to_sequence`.
* Mixture of experts: :func:`route` (top-k, capacity, dropped tokens), :func:`dispatch` and
  :func:`combine` (all_to_all with uneven sizes that change every step).
* :func:`ring_attention`: exact attention over a sequence split across ranks, causal or not.
* :class:`SyncBatchNorm` / :func:`sync_batch_norm`: batch statistics over every rank, on CPU
  and GPU, with uneven (and empty) per-rank batches.

Every gradient follows distgrad's contract (the objective is the sum over ranks of what each
rank back-propagates) unless ``objective="replicated"`` says otherwise; docs/patterns.md
gives each pattern's data movement, cost and the hand-written code it replaces.
"""

from __future__ import annotations

from distgrad.parallel._batchnorm import SyncBatchNorm, sync_batch_norm
from distgrad.parallel._moe import Routing, combine, dispatch, route
from distgrad.parallel._ring_attention import ring_attention
from distgrad.parallel._tensor import (
    ColumnParallelLinear,
    RowParallelLinear,
    column_parallel_linear,
    copy_to_region,
    gather_from_sequence,
    reduce_from_region,
    reduce_scatter_to_sequence,
    row_parallel_linear,
    split_to_sequence,
)

__all__ = [
    "ColumnParallelLinear",
    "Routing",
    "RowParallelLinear",
    "SyncBatchNorm",
    "column_parallel_linear",
    "combine",
    "copy_to_region",
    "dispatch",
    "gather_from_sequence",
    "reduce_from_region",
    "reduce_scatter_to_sequence",
    "ring_attention",
    "route",
    "row_parallel_linear",
    "split_to_sequence",
    "sync_batch_norm",
]
