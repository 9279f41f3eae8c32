"""The public surface is small, sorted, documented and pinned."""

from __future__ import annotations

import importlib
import pkgutil
import re

import distgrad
import distgrad.collectives
import distgrad.errors
import distgrad.testing

PUBLIC = [
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


TESTING = [
    "GradReport",
    "Microbatches",
    "ModelReport",
    "ParameterCheck",
    "PipelineProgram",
    "PipelineReport",
    "TensorCheck",
    "check_against_single_process",
    "check_parallel_model",
    "check_pipeline",
    "run_on_ranks",
]


def test_testing_exports_are_pinned_and_documented() -> None:
    assert distgrad.testing.__all__ == TESTING
    for name in TESTING:
        assert getattr(distgrad.testing, name).__doc__, f"testing.{name} has no docstring"


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


def _error_classes_defined_in_the_package() -> dict[str, type[BaseException]]:
    """Every exception class defined in any module of distgrad (found by walking the package)."""
    found: dict[str, type[BaseException]] = {}
    for info in pkgutil.walk_packages(distgrad.__path__, prefix="distgrad."):
        module = importlib.import_module(info.name)
        for name, value in vars(module).items():
            if (
                isinstance(value, type)
                and issubclass(value, BaseException)
                and value.__module__ == module.__name__
            ):
                found[f"{module.__name__}.{name}"] = value
    return found


def test_every_error_class_in_the_package_joins_the_error_tree() -> None:
    """A public error lives in distgrad.errors; a private one (a leading underscore) derives
    from DistgradError too, so that `except DistgradError` catches everything distgrad raises."""
    found = _error_classes_defined_in_the_package()
    assert len(found) >= len(distgrad.errors.__all__)
    for where, cls in found.items():
        assert issubclass(cls, distgrad.errors.DistgradError), f"{where} is not a DistgradError"
        if not cls.__name__.startswith("_"):
            assert where == f"distgrad.errors.{cls.__name__}", f"{where}: move it to errors.py"
            assert cls.__name__ in distgrad.errors.__all__, f"{where} is not exported"


def test_the_error_tree_drawn_in_errors_docstring_is_the_class_hierarchy() -> None:
    """Each drawn line `├── Name` sits under its parent; compare with the classes' bases."""
    doc = distgrad.errors.__doc__ or ""
    drawn: dict[str, str | None] = {}
    parents: list[tuple[int, str]] = []  # (indent, name) of the open branches
    for line in doc.splitlines():
        match = re.match(r"^(\s*)(?:[│ ]*[├└]── )?([A-Z]\w+Error)\b", line)
        if not match:
            continue
        name = match.group(2)
        indent = line.index(name)
        while parents and parents[-1][0] >= indent:
            parents.pop()
        drawn[name] = parents[-1][1] if parents else None
        parents.append((indent, name))
    assert sorted(drawn) == sorted(distgrad.errors.__all__)
    for name, parent in drawn.items():
        cls = getattr(distgrad.errors, name)
        own_bases = [b.__name__ for b in cls.__bases__ if b.__module__ == "distgrad.errors"]
        assert own_bases == ([parent] if parent else []), f"{name} is drawn under {parent}"
