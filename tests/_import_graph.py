"""The import graph of a package, read from its files with ``ast`` (imports inside functions
count too), and a circle finder: shared by the layer tests of the whole package
(tests/unit/test_layers.py) and of ``distgrad.rpc`` (tests/rpc/test_layout.py).

``from p.x import name`` counts as importing submodule ``p.x.name`` when there is one, and
``p.x`` otherwise; importing a package counts as importing its ``__init__``.
"""

from __future__ import annotations

import ast
import importlib
from pathlib import Path

Graph = dict[str, set[str]]


def module_files(package: str) -> dict[str, Path]:
    """Every module of ``package`` (subpackages included), by dotted name."""
    root = Path(importlib.import_module(package).__file__ or "").parent
    names = {}
    for path in sorted(root.rglob("*.py")):
        parts = [*package.split("."), *path.relative_to(root).with_suffix("").parts]
        if parts[-1] == "__init__":
            parts.pop()
        names[".".join(parts)] = path
    return names


def _imports(name: str, path: Path, modules: set[str]) -> set[str]:
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
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
            while target and target not in modules:  # p.x.y.z -> the module it lives in
                target = target.rpartition(".")[0]
            if target and target != name:
                found.add(target)
    return found


def import_graph(package: str) -> Graph:
    """Which modules of ``package`` each of its modules imports."""
    modules = module_files(package)
    return {name: _imports(name, path, set(modules)) for name, path in modules.items()}


def find_cycle(graph: Graph) -> list[str] | None:
    """An import circle of ``graph`` (its first module repeated at the end), or None."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return [*path[path.index(nxt) :], nxt]
            if nxt not in state and (found := visit(nxt)):
                return found
        path.pop()
        state[node] = 2
        return None

    for start in sorted(graph):
        if start not in state and (found := visit(start)):
            return found
    return None


# A layering: bottom first; each layer a list of areas, each area a list of module names (a
# name stands for the module and every module below it, the most specific name winning).
Layers = list[list[list[str]]]


def init_named(graph: Graph, package: str) -> Graph:
    """``graph`` with ``package``'s ``__init__`` named ``package.__init__``, so that a layering
    can place it apart from the modules of the package (a name stands for those below it)."""

    def name(module: str) -> str:
        return f"{package}.__init__" if module == package else module

    return {name(m): {name(d) for d in deps} for m, deps in graph.items()}


def placement(module: str, layers: Layers) -> tuple[int, int] | None:
    """(layer, area) of ``module``: where its most specific declared name sits, or None."""
    best: tuple[int, int, int] | None = None  # (length of the name, layer, area)
    for i, layer in enumerate(layers):
        for j, area in enumerate(layer):
            for name in area:
                if (module == name or module.startswith(name + ".")) and (
                    best is None or len(name) > best[0]
                ):
                    best = (len(name), i, j)
    return None if best is None else (best[1], best[2])


def layer_violations(graph: Graph, layers: Layers) -> list[str]:
    """Every import that does not point down: a module may import a module of a lower layer,
    or of its own area; never one of a higher layer or of another area of its own layer.
    A module no layer names is a violation too (so that a new module gets declared)."""
    found = []
    for module in sorted(graph):
        here = placement(module, layers)
        if here is None:
            found.append(f"{module} belongs to no declared layer")
            continue
        for dep in sorted(graph[module]):
            there = placement(dep, layers)
            if there is None or there[0] > here[0] or (there[0] == here[0] and there != here):
                found.append(
                    f"{module} (layer {here[0]}) imports {dep} (layer {there and there[0]})"
                )
    return found
