"""Property test: random multi-worker programs give local autograd's gradients in both modes.

Each program (``_graphs``) runs on 4 workers with nested calls up to 3 deep: tensors reused
after they were sent, sent to several workers, sent back along the call chain (cycles), and
results never used. For each program the test compares, against local float64 autograd of
the same program with random cotangents: FAST; SMART with ``retain_graph=False``; SMART twice
in one context with ``retain_graph=True`` (twice the gradients). SMART finds its lineage from
what the sends carried for half the programs, by asking the workers for the other half.
Gradients are compared for the root's inputs and for every leaf the program made on any
worker. Some tensors carry a hook that halves their gradient and counts its calls: under
SMART every hook is called with a gradient exactly as often as locally (each node runs once,
on its whole gradient); a node run twice on partial gradients would halve one share twice.
"""

from __future__ import annotations

import collections
import random

import torch
from torch import Tensor

import distgrad.rpc as dgrpc
from distgrad.testing import run_on_ranks
from tests import _support as support
from tests.rpc import _funcs as F
from tests.rpc import _graphs as G
from tests.rpc import _helpers as H

WORKERS = 4
PROGRAMS = 30


def _roots(program: G.Program, xs: list[Tensor], run: str, local: bool) -> list[Tensor]:
    outs = G.run_program(program, xs, f"{run}|r", local)
    return [o * 1.0 for o in outs]  # a root must not be a leaf (a program may return a param)


def _local(program: G.Program, xs: list[Tensor], seed: int) -> dict[str, Tensor | None]:
    run = f"{seed}.local"
    roots = _roots(program, xs, run, local=True)
    made = {k: p for k, p in G.params.items() if k.startswith(run)}
    wanted = [*xs, *made.values()]
    got = torch.autograd.grad(roots, wanted, support.cotangents(seed, roots), allow_unused=True)
    names = [f"x{i}" for i in range(len(xs))] + [k.split("|")[1] for k in made]
    return dict(zip(names, got, strict=True))


def _distributed(
    program: G.Program, xs: list[Tensor], seed: int, mode: str, passes: int
) -> tuple[dict[str, Tensor | None], dict[str, int]]:
    run = f"{seed}.{mode}.{passes}"
    grads: dict[str, Tensor | None] = {}
    with dgrpc.context() as cid:
        roots = _roots(program, xs, run, local=False)
        for i in range(passes):
            retain = i < passes - 1
            dgrpc.backward(
                cid, roots, retain, grad_tensors=support.cotangents(seed, roots), mode=mode
            )
        mine = dgrpc.get_gradients(cid)
        grads.update({f"x{i}": mine.get(x) for i, x in enumerate(xs)})
        calls: collections.Counter[str] = collections.Counter()
        for w in range(WORKERS):
            found = H.query(f"worker{w}", G.param_grads, cid, run)
            grads.update({k.split("|")[1]: g for k, g in found.items()})
            calls.update(
                {k.split("|")[1]: c for k, c in H.query(f"worker{w}", G.counts, run).items()}
            )
    return grads, dict(calls)


def _check(rank: int, world_size: int, seeds: list[int]) -> dict[str, int]:
    if rank != 0:
        return {}
    workers = [f"worker{w}" for w in range(world_size)]
    seen: collections.Counter[str] = collections.Counter()
    for seed in seeds:
        program = G.make_program(random.Random(seed), workers, depth=3, n_inputs=3)
        xs = [support.leaf(seed * 10 + i, *G.SHAPE) for i in range(3)]
        want = _local(program, xs, seed)
        local_calls = {k.split("|")[1]: c for k, c in G.counts(f"{seed}.local").items()}
        # Every other program: no send carries its lineage, so SMART asks for all of it.
        walk = 0 if seed % 2 else 64
        for w in range(world_size):
            H.query(f"worker{w}", F.set_lineage_walk, walk)
        for mode, passes in (("fast", 1), ("smart", 1), ("smart", 2)):
            got, calls = _distributed(program, xs, seed, mode, passes)
            for name, w in want.items():
                expected = None if w is None else passes * w
                H.assert_close(got.get(name), expected, f"program {seed}, {mode} x{passes}: {name}")
            if mode == "smart":
                expected_calls = {k: passes * c for k, c in local_calls.items()}
                assert calls == expected_calls, (
                    f"program {seed}: hook calls {calls} != {expected_calls}"
                )
        seen["programs"] += 1
        seen["calls"] += str(program).count("'call'")
    seen["hook_nones"] = sum(G.hook_nones.values())
    H.no_state_left(world_size)
    return dict(seen)


def test_random_programs_match_local_autograd_in_both_modes() -> None:
    """30 random programs on 4 workers; FAST, SMART, SMART twice with retain_graph=True."""
    seen = run_on_ranks(_check, WORKERS, args=(list(range(PROGRAMS)),), init="rpc", timeout=120)[0]
    assert seen["programs"] == PROGRAMS
    assert seen["calls"] >= PROGRAMS, f"too few nested calls to mean anything: {seen}"
