"""The whole package's imports point one way: no module imports, even inside a function, a
module that imports it back (directly or through others). ``distgrad.rpc`` has its own,
stricter layer test (tests/rpc/test_layout.py); both read the graph with tests/import_graph.py.
"""

from __future__ import annotations

from tests.import_graph import find_cycle, import_graph, module_files


def test_no_import_circle_anywhere_in_the_package() -> None:
    circle = find_cycle(import_graph("distgrad"))
    assert circle is None, "import circle: " + " -> ".join(circle or [])


def test_the_layer_test_sees_every_module() -> None:
    names = module_files("distgrad")
    assert "distgrad._comm" in names and "distgrad.rpc.fast" in names and len(names) > 50


def test_the_circle_finder_finds_one() -> None:
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": set()}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None


def test_no_test_module_imports_another_test_module() -> None:
    """Shared test code lives in helper modules (tests/collectives/reference.py, ...), so that
    running one test file never runs or depends on another's."""
    graph = import_graph("tests")
    offenders = {
        name: sorted(dep for dep in deps if dep.rpartition(".")[2].startswith("test_"))
        for name, deps in graph.items()
    }
    assert not {k: v for k, v in offenders.items() if v}, offenders
