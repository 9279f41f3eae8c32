"""The whole package's imports point one way: down the layers declared here, and no module
imports, even inside a function, a module that imports it back (directly or through others).
``distgrad.rpc`` is one area of one layer here; tests/rpc/test_layout.py keeps its inside in
order. Both read the graph with tests/_import_graph.py.
"""

from __future__ import annotations

from tests._import_graph import (
    Graph,
    Layers,
    find_cycle,
    import_graph,
    init_named,
    layer_violations,
    module_files,
    placement,
)

# Bottom first. A module imports only from lower layers or from its own area (the inner
# lists): the areas of one layer are independent of each other. Read from the real imports.
LAYERS: Layers = [
    # Standard library and torch only: the error tree, liveness sockets.
    [["distgrad.errors"], ["distgrad._exchange.alive"]],
    [["distgrad._mesh"]],  # groups from device meshes; DTensors refused at the door
    # Every exchange, its waits and its checks; its floors: EXCHANGE_FLOORS below.
    [["distgrad._exchange"]],
    [["distgrad.collectives"]],  # the differentiable ops, one file per adjoint pair
    # Built on the collectives; rpc stands beside them (it needs only the errors), and so does
    # pipeline (distributed autograd over c10d point-to-point: the exchange layer's pairs).
    [["distgrad.losses"], ["distgrad.parallel"], ["distgrad.rpc"], ["distgrad.pipeline"]],
    [["distgrad.integrations"]],  # drop-in losses with peer libraries' signatures
    [["distgrad.testing"]],  # run_on_ranks and the checker (run_on_ranks can start RPC)
    [["distgrad.__init__"]],  # the public surface: re-exports only
    [["distgrad._demo"]],  # the demo, a user of the public surface
    [["distgrad._cli", "distgrad.__main__"]],  # the command line, at the top
]

# The floors of the exchange layer, bottom first (docs/semantics.md, "Inside distgrad").
_X = "distgrad._exchange"
EXCHANGE_FLOORS: Layers = [
    [[f"{_X}.alive"]],  # liveness sockets and /proc: is a peer's process still there
    [[f"{_X}.group"]],  # groups, ranks, sizes; forgetting destroyed groups
    [[f"{_X}.wait"]],  # how a rank waits: ticks, dead peers, errors that say where
    # The data guard's tags in the data's own bytes; which c10d call each backend gets.
    [[f"{_X}.guard"], [f"{_X}.backend"]],
    # Starting and waiting for a c10d call, steps, staging; the functional collectives a
    # traced exchange emits (padding as the backend pads).
    [[f"{_X}.inflight"], [f"{_X}.functional"]],
    # Point-to-point pairs; the checked calls' metadata handshake; AsyncTensor.
    [[f"{_X}.pairs"], [f"{_X}.handshake"], [f"{_X}.async_op"]],
    [[f"{_X}.declare"]],  # one declaration -> its call forms, typed as its steps
    [[f"{_X}.ops"]],  # the exchanges, one file each
    [[f"{_X}.ring"]],  # the one ring driver, on the declared shift
    [[f"{_X}.__init__"]],
]

# What the layers above the collectives (losses/, parallel/) may import of the exchange layer:
# its public declarations, the exchanges (``ops``: one object each, with the ``InFlight`` type
# of a started one) and the group (``group``: ``Group``, ``ProcessGroup``, ``resolve``). The
# floors below (steps, pairs, waits, the functional collectives, backends) are the exchanges'
# own: a ring that moves blocks does it through a declared exchange (``ops.shift``), and every
# ring of losses/ and parallel/ through the one driver (``ring``: its plan type and loop order,
# on ``ops.shift``), which both need and neither may import from the other.
EXCHANGE_PUBLIC = {f"{_X}.ops", f"{_X}.group", f"{_X}.ring"}


def _graph() -> Graph:
    return init_named(import_graph("distgrad"), "distgrad")


def test_no_import_circle_anywhere_in_the_package() -> None:
    circle = find_cycle(import_graph("distgrad"))
    assert circle is None, "import circle: " + " -> ".join(circle or [])


def test_every_import_points_down_the_declared_layers() -> None:
    violations = layer_violations(_graph(), LAYERS)
    assert not violations, "\n".join(violations)


def test_the_exchange_layer_keeps_its_floors() -> None:
    graph = init_named(import_graph(_X), _X)
    violations = layer_violations(graph, EXCHANGE_FLOORS)
    assert not violations, "\n".join(violations)


def test_losses_and_parallel_use_only_the_exchange_layers_public_declarations() -> None:
    offenders = {
        name: sorted(d for d in deps if d.startswith(f"{_X}.") and d not in EXCHANGE_PUBLIC)
        for name, deps in import_graph("distgrad").items()
        if name.startswith(("distgrad.losses", "distgrad.parallel"))
    }
    assert not {k: v for k, v in offenders.items() if v}, offenders


# What distgrad.pipeline takes from the exchange layer: the groups, the point-to-point pairs
# its transfers are (a transfer is no collective: funcol has no traced point-to-point form to
# declare), and debug mode with the handshake's wording.
PIPELINE_USES = {f"{_X}.group", f"{_X}.pairs", f"{_X}.handshake"}


def test_pipeline_uses_only_groups_pairs_and_debug_mode_of_the_exchange_layer() -> None:
    offenders = {
        name: sorted(d for d in deps if d.startswith(f"{_X}.") and d not in PIPELINE_USES)
        for name, deps in import_graph("distgrad").items()
        if name.startswith("distgrad.pipeline")
    }
    assert not {k: v for k, v in offenders.items() if v}, offenders


def test_the_layer_check_refuses_an_import_upward_or_across() -> None:
    layers: Layers = [[["p.low"]], [["p.a"], ["p.b"]]]
    assert layer_violations({"p.a.x": {"p.low", "p.a.y"}, "p.a.y": set()}, layers) == []
    assert layer_violations({"p.low": {"p.a.x"}}, layers) == [
        "p.low (layer 0) imports p.a.x (layer 1)"
    ]
    assert layer_violations({"p.a": {"p.b"}}, layers) == ["p.a (layer 1) imports p.b (layer 1)"]
    assert layer_violations({"p.new": set()}, layers) == ["p.new belongs to no declared layer"]
    assert placement("p.a.x", layers) == (1, 0)


def test_the_layer_test_sees_every_module() -> None:
    names = module_files("distgrad")
    assert "distgrad._exchange.ops.all_gather" in names and "distgrad.rpc.fast" in names
    assert len(names) > 50


def test_the_circle_finder_finds_one() -> None:
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": set()}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None


def test_no_test_module_imports_another_test_module() -> None:
    """Shared test code lives in helper modules (tests/_support.py, ...), so that running
    one test file never runs or depends on another's."""
    graph = import_graph("tests")
    offenders = {
        name: sorted(dep for dep in deps if dep.rpartition(".")[2].startswith("test_"))
        for name, deps in graph.items()
    }
    assert not {k: v for k, v in offenders.items() if v}, offenders
