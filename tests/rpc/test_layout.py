"""The layout of ``distgrad.rpc``: every import points down the layers declared here, and
the layers stay apart.

Reads the package's imports with ``ast`` (imports inside functions count too) and fails on
any circle and on any import upward or across the areas of one layer. ``from distgrad.rpc
import name`` counts as importing submodule ``name`` when there is one, and the package itself
(whose ``__init__`` imports everything) otherwise.
"""

from __future__ import annotations

from pathlib import Path

import pytest

import distgrad.rpc
from tests._import_graph import (
    Graph,
    Layers,
    find_cycle,
    import_graph,
    init_named,
    layer_violations,
)

PACKAGE = "distgrad.rpc"
ROOT = Path(distgrad.rpc.__file__).parent


def _graph() -> Graph:
    return import_graph(PACKAGE)


def _cycle(graph: Graph) -> list[str] | None:
    return find_cycle(graph)


# Bottom first; a module imports only from lower layers or its own area (the inner lists).
# docs/rpc.md's table "Inside distgrad.rpc" says what each module holds.
LAYERS: Layers = [
    # Pure: who this worker is, the records, how gradients are stored; torch's RPC names;
    # replacing a function of torch's once.
    [
        [f"{PACKAGE}._identity"],
        [f"{PACKAGE}._records"],
        [f"{PACKAGE}._storage"],
        [f"{PACKAGE}.functions"],
        [f"{PACKAGE}._patch"],
    ],
    # One dataclass per message; the one door to torch's RPC; DDP/FSDP2 bookkeeping.
    [[f"{PACKAGE}._wire"], [f"{PACKAGE}._transport"], [f"{PACKAGE}._reductions"]],
    [[f"{PACKAGE}._context"]],  # the context object and the registry
    # What uses a context: recording sends and recvs, a worker's part of a pass, releases,
    # the watchdog, the DDP and FSDP2 hooks.
    [
        [f"{PACKAGE}.send_recv"],
        [f"{PACKAGE}._pass"],
        [f"{PACKAGE}._release"],
        [f"{PACKAGE}._liveness"],
        [f"{PACKAGE}._ddp"],
        [f"{PACKAGE}._fsdp"],
    ],
    # Calling torch's engine; init_rpc and shutdown; the public with-block.
    [[f"{PACKAGE}._local"], [f"{PACKAGE}._lifecycle"], [f"{PACKAGE}.scope"]],
    [[f"{PACKAGE}.fast"], [f"{PACKAGE}._lineage", f"{PACKAGE}.smart"]],  # the two modes
    [[f"{PACKAGE}.backward"]],  # picks the mode
    [[f"{PACKAGE}.calls"]],  # rpc_sync, rpc_async, remote, RRef
    [[f"{PACKAGE}.optimizer"], [f"{PACKAGE}.remote_module"]],
    [[f"{PACKAGE}.__init__"]],  # the public surface
]


def test_every_import_points_down_the_declared_layers() -> None:
    violations = layer_violations(init_named(_graph(), PACKAGE), LAYERS)
    assert not violations, "\n".join(violations)


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
