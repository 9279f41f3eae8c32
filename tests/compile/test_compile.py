"""torch.compile(fullgraph=True): every collective and every loss traces into one graph, with no
graph break and no recompilation, and gives eager's values and gradients.

Semantics asserted: the compiled step (gloo, CPU, float64) is the same function as the eager
step, so its loss and input gradients equal eager's to rounding (the
compiler fuses and reorders arithmetic: 1e-9 relative in float64). ``torch._dynamo.explain``
counts one graph and no break; ``error_on_recompile`` makes a second compilation an error, and
each step runs on fresh data three times.

Two backends: ``aot_eager`` in the default tier (dynamo's trace and AOT autograd's joint graph,
the fake kernels and the functionalization that inductor sees too, in seconds), and
``inductor`` in the slow tier (the generated C++ as well: 60-100 s per step on 2 cores; CI
runs it).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import Tensor

import distgrad as dg
from distgrad.testing import run_on_ranks
from tests._support import COMPILED, seeded

Step = Callable[[Tensor, Tensor], Tensor]


def _collectives(rank: int, n: int, async_op: bool = False) -> Step:
    """Every public collective with every size given, each output weighted differently; with
    ``async_op``, every call is made with ``async_op=True`` (traced as the blocking call)."""
    k = {"async_op": True} if async_op else {}
    ring = [(r + 1) % n for r in range(n)]
    to_first = [4] + [0] * (n - 1)  # every rank sends its rows to rank 0

    def step(x: Tensor, v: Tensor) -> Tensor:  # x: [4, 3] on every rank
        outs = [
            dg.all_gather(x, sizes=[4] * n, **k),
            dg.all_gather(x, dim=1, sizes=[3] * n, objective="replicated", **k),
            dg.all_reduce(x, **k),
            dg.all_reduce(x, "avg", **k),
            dg.all_reduce(x, "prod", **k),
            dg.all_reduce(x, "max", **k),
            dg.all_reduce(x, "min", **k),
            dg.reduce_scatter(x.repeat(n, 1), **k),
            dg.reduce_scatter(x.repeat(n, 1), "max", **k),
            dg.all_to_all(x.repeat(n, 1), **k),
            dg.all_to_all(x, input_sizes=to_first, output_sizes=[4 if rank == 0 else 0] * n, **k),
            dg.broadcast(x, n - 1, **k),
            dg.reduce(x, 0, **k),
            dg.gather(x, 0, sizes=[4] * n, **k),
            dg.scatter(x.repeat(n, 1) if rank == 0 else x, 0, sizes=[4] * n, **k),
            dg.permute(x, ring, recv_shape=(4, 3), **k),
        ]
        return sum((o * v[i, : o.shape[0], : o.shape[1]]).sum() for i, o in enumerate(outs))

    return step


def _losses(rank: int, n: int) -> Step:
    """Every loss: dense and ring paths, with sizes given and (even shards) without."""
    sizes = [4] * n
    clip = dg.losses.CLIPLoss()
    siglip = dg.losses.SigLIPLoss(block_size=3)

    def step(x: Tensor, v: Tensor) -> Tensor:  # x: [4, 8] on every rank
        a, b = x, x.flip(0) + v[0, :4, :8]
        hard = torch.stack([x.roll(1, 0), x.roll(2, 1) - v[1, :4, :8]], 1)
        both = ("query_to_key", "key_to_query")
        L = dg.losses
        terms = [
            L.info_nce(a, b, sizes=sizes),
            L.info_nce(a, b),  # even shards: the sizes are checked on the device
            L.nt_xent(a, b, temperature=0.3, sizes=sizes),
            L.nt_xent(a, b, sizes=sizes, block_size=3),
            L.clip_loss(a, b, 10.0, sizes=sizes),
            L.clip_loss(a, b, sizes=sizes, block_size=2),
            L.siglip_loss(a, b, sizes=sizes),
            L.info_nce(a, b, sizes=sizes, block_size=5),
            # hard negatives ([4, 2, 8]: two per query) and both directions, dense and ring
            # (two terms, one chunk each: each adds 10-15 s of tracing on a loaded machine)
            L.info_nce(a, b, negatives=hard, directions=both),
            L.info_nce(a, b, negatives=hard, sizes=sizes, block_size=8, directions=both),
            L.barlow_twins(a, b, sizes=sizes),
            clip(a, b, sizes=sizes),
            siglip(a, b),
        ]
        return sum(t * (i + 1) for i, t in enumerate(terms))

    return step


STEPS: dict[str, tuple[Callable[[int, int], Step], tuple[int, int]]] = {
    "collectives": (_collectives, (4, 3)),
    "losses": (_losses, (4, 8)),
    "collectives_async": (functools.partial(_collectives, async_op=True), (4, 3)),
}


BACKENDS = ["aot_eager", pytest.param("inductor", marks=pytest.mark.slow)]


def _compiled_matches_eager(rank: int, n: int, which: str, backend: str) -> list[Any]:
    # Two ranks on two cores: inductor's pool of compile workers costs more than it saves.
    torch._inductor.config.compile_threads = 1
    torch.set_default_dtype(torch.float64)
    build, shape = STEPS[which]
    step = build(rank, n)
    gen = seeded(1000 + rank)
    v = torch.randn(20, 4 * n, 3 * n + 8, generator=gen)  # a cotangent per output
    x = torch.randn(shape, generator=gen, requires_grad=True)
    explained = torch._dynamo.explain(step)(x, v)
    found = [explained.graph_count, explained.graph_break_count]
    found += [str(r.reason)[:300] for r in explained.break_reasons]
    torch._dynamo.reset()
    compiled = torch.compile(step, fullgraph=True, backend=backend)
    for i in range(3):
        x = torch.randn(shape, generator=gen, requires_grad=True)
        want = step(x, v)
        (want_grad,) = torch.autograd.grad(want, x)
        got = compiled(x, v)
        (got_grad,) = torch.autograd.grad(got, x)
        torch.testing.assert_close(got, want, **COMPILED, msg=lambda m, i=i: f"step {i}: loss: {m}")
        torch.testing.assert_close(got_grad, want_grad, **COMPILED, msg=lambda m: f"gradient: {m}")
        torch._dynamo.config.error_on_recompile = True  # a second compilation raises
    return found


# Inductor compiles C++ for each graph: about 60-100 s per step on 2 cores.
@pytest.mark.timeout(400)
@pytest.mark.parametrize("backend", BACKENDS)
def test_every_collective_compiles_to_one_graph_and_matches_eager(backend: str) -> None:
    for found in run_on_ranks(
        _compiled_matches_eager, 2, args=("collectives", backend), timeout=300
    ):
        assert found[:2] == [1, 0], found


# Every loss compiled is 15 s even with aot_eager: the whole case is in the slow tier (which CI
# runs), the compile area keeping the collectives' and async_op's cases by default.
@pytest.mark.slow
@pytest.mark.timeout(400)
@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
def test_every_loss_compiles_to_one_graph_and_matches_eager(backend: str) -> None:
    for found in run_on_ranks(_compiled_matches_eager, 2, args=("losses", backend), timeout=300):
        assert found[:2] == [1, 0], found


@pytest.mark.timeout(400)
@pytest.mark.parametrize("backend", BACKENDS)
def test_async_op_compiles_to_one_graph_and_matches_eager(backend: str) -> None:
    """The same collectives with ``async_op=True``: eager (tensors that wait on first use) and
    compiled (the blocking call, traced) agree, in one graph."""
    for found in run_on_ranks(
        _compiled_matches_eager, 2, args=("collectives_async", backend), timeout=300
    ):
        assert found[:2] == [1, 0], found


def _compiled_across_a_new_default_group(rank: int, n: int) -> list[float]:
    # Inside a trace the group's description is a constant of the graph (group.py,
    # _describe_traced): the same compiled function must still run on the default group made
    # after the first one is destroyed, and sum there.
    step = torch.compile(lambda x: dg.all_reduce(x), backend="aot_eager", fullgraph=True)
    x = torch.full((2,), float(rank + 1))
    first = float(step(x)[0])
    store = dist.distributed_c10d._get_default_store()  # type: ignore[attr-defined]
    dist.destroy_process_group()
    dist.init_process_group("gloo", store=store, rank=rank, world_size=n)
    second = float(step(2 * x)[0])
    return [first, second]


def test_a_compiled_step_runs_on_a_default_group_made_after_the_first_is_destroyed() -> None:
    """Semantics: sum over the ranks on each group: 1 + 2, then 2 + 4 on the new group."""
    assert run_on_ranks(_compiled_across_a_new_default_group, 2) == [[3.0, 6.0], [3.0, 6.0]]
