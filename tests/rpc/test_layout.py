"""The layout of ``distgrad.rpc``: every import points down, and the layers stay apart.

Reads the package's imports with ``ast`` (imports inside functions count too) and fails on
any circle. ``from distgrad.rpc import name`` counts as importing submodule ``name`` when there
is one, and the package itself (whose ``__init__`` imports everything) otherwise.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

import distgrad.rpc

PACKAGE = "distgrad.rpc"
ROOT = Path(distgrad.rpc.__file__).parent


def _module_names() -> dict[str, Path]:
    names = {}
    for path in sorted(ROOT.glob("*.py")):
        name = PACKAGE if path.stem == "__init__" else f"{PACKAGE}.{path.stem}"
        names[name] = path
    return names


def _imports(name: str, path: Path, modules: set[str]) -> set[str]:
    """The modules of the package that ``name`` imports, anywhere in its file."""
    found: set[str] = set()
    package = name if name == PACKAGE else name.rsplit(".", 1)[0]
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(
                    [*package.split(".")[: len(package.split(".")) - node.level + 1], base]
                ).rstrip(".")
            targets = []
            for alias in node.names:
                sub = f"{base}.{alias.name}"
                targets.append(sub if sub in modules else base)
        else:
            continue
        for target in targets:
            while target and target not in modules:  # import distgrad.rpc.x.y -> distgrad.rpc.x
                target = target.rpartition(".")[0]
            if target and target != name:
                found.add(target)
    return found


def _graph() -> dict[str, set[str]]:
    modules = _module_names()
    return {name: _imports(name, path, set(modules)) for name, path in modules.items()}


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph[node]):
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


def test_no_import_circle_in_distgrad_rpc() -> None:
    cycle = _cycle(_graph())
    assert cycle is None, "import circle: " + " -> ".join(cycle or [])


def test_the_cycle_check_finds_a_circle() -> None:
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": set()}
    assert _cycle(graph) == ["a", "b", "c", "a"]


def test_fast_and_smart_are_siblings_and_the_recv_node_knows_no_engine() -> None:
    graph = _graph()
    engines = {f"{PACKAGE}.fast", f"{PACKAGE}.smart"}
    assert f"{PACKAGE}.smart" not in graph[f"{PACKAGE}.fast"]
    assert f"{PACKAGE}.fast" not in graph[f"{PACKAGE}.smart"]
    below_recv = graph[f"{PACKAGE}.send_recv"]
    assert not below_recv & (engines | {f"{PACKAGE}._pass", f"{PACKAGE}.backward"}), below_recv
    # Only the public backward chooses between the engines.
    users = {name for name, deps in graph.items() if deps & engines}
    assert users <= {f"{PACKAGE}.backward"}, users


def test_only_the_transport_and_lifecycle_talk_to_torch_rpc_directly() -> None:
    """distgrad's own messages go through _transport (which marks them for the guard on
    torch's calls); calls.py passes calls made outside contexts straight to torch."""
    allowed = {"_transport.py", "_lifecycle.py", "_identity.py", "calls.py"}
    for path in ROOT.glob("*.py"):
        if path.name in allowed:
            continue
        text = path.read_text()
        assert "torch_rpc.rpc_async" not in text and "torch_rpc.rpc_sync" not in text, path.name


PUBLIC = [
    "BackendType",
    "DistAutogradContext",
    "DistributedOptimizer",
    "RRef",
    "RemoteModule",
    "TensorPipeRpcBackendOptions",
    "WorkerInfo",
    "backward",
    "context",
    "current_context_id",
    "debug_state",
    "functions",
    "get_gradients",
    "get_worker_info",
    "init_rpc",
    "remote",
    "rpc_async",
    "rpc_sync",
    "shutdown",
]


# Plain RPC names, torch's own objects (a porting program imports them from distgrad.rpc).
TORCHS = ["BackendType", "TensorPipeRpcBackendOptions", "WorkerInfo", "get_worker_info"]


def test_the_public_surface_is_pinned_sorted_and_documented() -> None:
    from torch.distributed import rpc as torch_rpc

    assert distgrad.rpc.__all__ == PUBLIC
    for name in PUBLIC:
        if name in TORCHS:
            assert getattr(distgrad.rpc, name) is getattr(torch_rpc, name), name
        else:
            assert getattr(distgrad.rpc, name).__doc__, f"distgrad.rpc.{name} has no docstring"


def test_a_name_distgrad_does_not_offer_says_what_to_use() -> None:
    with pytest.raises(AttributeError, match=r"use distgrad\.rpc\.RRef"):
        distgrad.rpc.PyRRef  # noqa: B018
    with pytest.raises(AttributeError, match="has no attribute 'nonsense'"):
        distgrad.rpc.nonsense  # type: ignore[attr-defined]  # noqa: B018
