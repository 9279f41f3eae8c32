"""distgrad.parallel's public surface is pinned, sorted and documented like the ops: every
function states its gradient, its communication and that its inputs are not modified."""

from __future__ import annotations

import inspect

from distgrad import parallel

PUBLIC = [
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


def test_exports_are_pinned_and_sorted() -> None:
    assert parallel.__all__ == PUBLIC


def test_every_function_documents_its_gradient_communication_and_non_mutation() -> None:
    for name in parallel.__all__:
        obj = getattr(parallel, name)
        doc = " ".join((obj.__doc__ or "").split())
        assert doc, f"parallel.{name} has no docstring"
        if inspect.isfunction(obj):
            assert "Gradient" in doc, f"parallel.{name} does not state its gradient"
            assert "Communication" in doc, f"parallel.{name} does not state its cost"
            assert "not modified" in doc, f"parallel.{name} does not promise non-mutation"
