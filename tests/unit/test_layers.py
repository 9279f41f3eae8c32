"""The whole package's imports point one way: no module imports, even inside a function, a
module that imports it back (directly or through others).

Reads every module's imports with ``ast``. ``from distgrad.x import name`` counts as importing
submodule ``distgrad.x.name`` when there is one, and ``distgrad.x`` otherwise; a package's
``__init__`` re-exports its modules, so importing a package counts as importing its
``__init__``. ``distgrad.rpc`` has its own stricter layer test (tests/rpc/test_layout.py).
"""

from __future__ import annotations

import ast
from pathlib import Path

import distgrad

ROOT = Path(distgrad.__file__).parent


def _module_names() -> dict[str, Path]:
    names = {}
    for path in sorted(ROOT.rglob("*.py")):
        parts = ["distgrad", *path.relative_to(ROOT).with_suffix("").parts]
        if parts[-1] == "__init__":
            parts.pop()
        names[".".join(parts)] = path
    return names


def _imports(name: str, path: Path, modules: set[str]) -> set[str]:
    is_package = path.name == "__init__.py"
    package = name if is_package else name.rpartition(".")[0]
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                up = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*up, base]).rstrip(".")
            targets = [
                f"{base}.{alias.name}" if f"{base}.{alias.name}" in modules else base
                for alias in node.names
            ]
        else:
            continue
        for target in targets:
            while target and target not in modules:
                target = target.rpartition(".")[0]
            if target and target != name:
                found.add(target)
    return found


def _graph() -> dict[str, set[str]]:
    modules = _module_names()
    return {name: _imports(name, path, set(modules)) for name, path in modules.items()}


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return [*path[path.index(nxt) :], nxt]
            if nxt not in state:
                found = visit(nxt)
                if found:
                    return found
        path.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state:
            found = visit(node)
            if found:
                return found
    return None


def test_no_import_circle_anywhere_in_the_package() -> None:
    circle = _cycle(_graph())
    assert circle is None, "import circle: " + " -> ".join(circle or [])


def test_the_layer_test_sees_every_module() -> None:
    names = _module_names()
    assert "distgrad._comm" in names and "distgrad.rpc.fast" in names and len(names) > 50


def test_the_circle_finder_finds_one() -> None:
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert _cycle({"a": {"b"}, "b": set()}) is None
