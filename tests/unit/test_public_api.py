"""The public surface is small, sorted, documented and pinned."""

from __future__ import annotations

import distgrad
import distgrad.collectives
import distgrad.errors

PUBLIC = [
    "all_gather",
    "all_reduce",
    "all_to_all",
    "broadcast",
    "errors",
    "gather",
    "losses",
    "permute",
    "reduce",
    "reduce_scatter",
    "rpc",
    "scatter",
    "set_debug",
    "testing",
]


COLLECTIVES = [
    "all_gather",
    "all_reduce",
    "all_to_all",
    "broadcast",
    "gather",
    "permute",
    "reduce",
    "reduce_scatter",
    "scatter",
]


def test_collectives_exports_are_pinned_and_sorted() -> None:
    assert distgrad.collectives.__all__ == COLLECTIVES


def test_every_collective_documents_its_gradient_and_communication() -> None:
    for name in distgrad.collectives.__all__:
        doc = " ".join((getattr(distgrad.collectives, name).__doc__ or "").split())
        assert "Gradient" in doc, f"collectives.{name} does not state its gradient"
        assert "Communication" in doc, f"collectives.{name} does not state its cost"
        assert "not modified" in doc, f"collectives.{name} does not promise non-mutation"


def test_top_level_exports_are_pinned_and_sorted() -> None:
    assert distgrad.__all__ == PUBLIC
    assert sorted(distgrad.__all__) == distgrad.__all__


def test_every_export_is_documented() -> None:
    for name in distgrad.__all__:
        assert getattr(distgrad, name).__doc__, f"distgrad.{name} has no docstring"
    for name in distgrad.errors.__all__:
        assert getattr(distgrad.errors, name).__doc__, f"errors.{name} has no docstring"


def test_every_collective_is_exported_at_the_top() -> None:
    for name in distgrad.collectives.__all__:
        assert getattr(distgrad, name) is getattr(distgrad.collectives, name)


def test_every_error_derives_from_distgrad_error() -> None:
    for name in distgrad.errors.__all__:
        assert issubclass(getattr(distgrad.errors, name), distgrad.errors.DistgradError)
