"""One family of collectives in a compiled graph: distgrad's exchanges beside torch's own.

Inside ``torch.compile`` every distgrad exchange is emitted as torch's functional collectives
(``torch.ops._c10d_functional``: the collective, then its ``wait_tensor``), so the compiler
orders, buckets and overlaps them together with funcol, DTensor and FSDP2's (docs/semantics.md,
"Inside ``torch.compile``"). Semantics asserted, on real gloo ranks, float64:

* safe beside torch's collectives: a step that mixes funcol all_reduces with a distgrad
  permute whose sizes differ between ranks, compiled with inductor (default settings,
  ``reorder_for_compute_comm_overlap``, the overlap scheduler), gives eager's loss and
  gradient on 2 and 3 ranks (before, it deadlocked: each rank in a different exchange);
  a DTensor redistribution and distgrad exchanges with rank-dependent sizes in one graph,
  forward and backward, equal eager;
* the reasons an order token once existed stay fixed: a gather whose result the other ranks
  drop still runs on them (dead-code elimination would hang its destination), and
  independent exchanges with rank-dependent buffer sizes run in one order on every rank;
* scheduled by the compiler: with torch's all_reduce bucketing, 16 small ``dg.all_reduce``
  calls become as many collectives as the same step written with funcol; with overlap
  scheduling, a distgrad all_reduce's wait is placed after compute that does not need it.

Inductor compiles C++ for each graph (10-30 s a step on 2 cores): those cases are in the slow
tier (CI runs this file's slow part); the default tier keeps the mixed step under
``aot_eager``, which traces the same nodes.
"""

from __future__ import annotations

import re
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
from torch import Tensor

import distgrad as dg
from distgrad.testing import run_on_ranks
from tests._support import COMPILED, seeded

SETTINGS = ["default", "reorder", "overlap"]


def _cpu_estimate(node: Any, size: int | None = None) -> float:
    """Every node one unit: torch's own estimators time GPU kernels (they need triton)."""
    return 1.0


def _configure(setting: str) -> None:
    config = torch._inductor.config
    config.compile_threads = 1  # two ranks on two cores: a pool of workers costs more
    if setting == "reorder":
        config.reorder_for_compute_comm_overlap = True
    elif setting == "overlap":
        aten = config.aten_distributed_optimizations
        aten.enable_overlap_scheduling = True
        # On a CPU without triton torch's estimators cannot run (a torch limit, the same for a
        # step of funcol alone): the scheduler takes a given estimate and no fusion regions,
        # and its roofline model of a matmul, which it computes first whatever the estimate,
        # gets rough figures for this CPU instead of asking triton for a GPU's.
        aten.custom_runtime_estimation = _cpu_estimate
        aten.enable_fusion_regions = False
        import torch.utils._runtime_estimation as roofline

        roofline.get_gpu_dram_gbps = lambda: 20  # type: ignore[attr-defined]
        roofline.get_device_tflops = lambda dtype: 0.1  # type: ignore[attr-defined]


def _eager_and_compiled(step: Any, inputs: list[Tensor], backend: str) -> list[float]:
    """Run ``step`` eagerly and compiled on the same inputs; assert the loss and every input
    gradient agree; return the compiled loss."""
    leaves = [t for t in inputs if t.requires_grad]
    want = step(*inputs)
    want_grads = torch.autograd.grad(want, leaves)
    compiled = torch.compile(step, backend=backend, fullgraph=True)
    got = compiled(*inputs)
    got_grads = torch.autograd.grad(got, leaves)
    torch.testing.assert_close(got, want, **COMPILED)
    for g, w in zip(got_grads, want_grads, strict=True):
        torch.testing.assert_close(g, w, **COMPILED)
    return [float(got)]


def _mixed_step(rank: int, n: int, setting: str, backend: str) -> list[float]:
    """The step that deadlocked: funcol all_reduce, a distgrad permute whose row counts
    differ between ranks (2, 40, 7), funcol all_reduce again."""
    _configure(setting)
    group = dist.group.WORLD
    rows = [2, 40, 7][:n]
    perm = [(r + 1) % n for r in range(n)]
    source = perm.index(rank)

    def step(x: Tensor, y: Tensor) -> Tensor:
        a = funcol.all_reduce(y, "sum", group)
        b = dg.permute(x, perm, recv_shape=(rows[source], x.shape[1]))
        d = funcol.all_reduce(a * 3, "sum", group)
        return (b * b).sum() + d.sum()

    gen = seeded(rank)
    x = torch.randn(rows[rank], 5, dtype=torch.float64, generator=gen, requires_grad=True)
    y = torch.randn(6, dtype=torch.float64, generator=gen)
    return _eager_and_compiled(step, [x, y], backend)


def test_a_step_mixing_funcol_and_distgrad_compiles_with_aot_eager() -> None:
    run_on_ranks(_mixed_step, 2, args=("default", "aot_eager"), timeout=120)


@pytest.mark.slow  # inductor: 15-30 s a case on 2 cores; CI runs it
@pytest.mark.timeout(300)
@pytest.mark.parametrize("world_size", [2, 3])
@pytest.mark.parametrize("setting", SETTINGS)
def test_a_step_mixing_funcol_and_distgrad_equals_eager_under_inductor(
    setting: str, world_size: int
) -> None:
    run_on_ranks(_mixed_step, world_size, args=(setting, "inductor"), timeout=240)


def _dtensor_beside_distgrad(rank: int, n: int, backend: str) -> list[float]:
    """A DTensor all_gather (Shard -> Replicate) and distgrad exchanges whose sizes differ
    between ranks (an uneven all_gather, a gather to rank 0), in one graph with a backward."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Replicate, Shard

    torch._inductor.config.compile_threads = 1
    mesh = init_device_mesh("cpu", (n,))
    sizes = [r + 2 for r in range(n)]  # 2, 3, ... rows

    def step(w: Tensor, x: Tensor) -> Tensor:
        dw = DTensor.from_local(w, mesh, [Shard(0)], run_check=False)
        full = dw.redistribute(mesh, [Replicate()]).to_local()  # [4 n, 3]
        rows = dg.all_gather(x, sizes=sizes)  # [sum(sizes), 3]
        at_root = dg.gather(x * 2, 0, sizes=sizes)
        return (rows @ full.T).square().sum() + at_root.sum() + full.sum()

    gen = seeded(10 + rank)
    w = torch.randn(4, 3, dtype=torch.float64, generator=gen, requires_grad=True)
    x = torch.randn(sizes[rank], 3, dtype=torch.float64, generator=gen, requires_grad=True)
    return _eager_and_compiled(step, [w, x], backend)


@pytest.mark.parametrize(
    ("backend", "world_size"),
    [
        ("aot_eager", 2),
        pytest.param("aot_eager", 3, marks=pytest.mark.slow),
        pytest.param("inductor", 2, marks=pytest.mark.slow),
        pytest.param("inductor", 3, marks=pytest.mark.slow),
    ],
)
@pytest.mark.timeout(300)
def test_dtensor_and_distgrad_exchanges_with_rank_dependent_sizes_in_one_graph(
    backend: str, world_size: int
) -> None:
    run_on_ranks(_dtensor_beside_distgrad, world_size, args=(backend,), timeout=240)


def _dropped_gather_and_independent_exchanges(rank: int, n: int, setting: str) -> list[float]:
    """Two reasons the order token existed. (1) Off the destination a gather's result is an
    empty slice, so no node uses the exchange's output there: dead-code elimination must not
    remove the exchange, or the destination waits forever. (2) Independent exchanges whose
    buffers have rank-dependent sizes: a scheduler that ordered them by size would order them
    differently on each rank."""
    _configure(setting)
    sizes = [1, 30, 5][:n]
    ring = [(r + 1) % n for r in range(n)]
    back = ring.index(rank)

    def step(x: Tensor, y: Tensor) -> Tensor:
        # Off rank 0 the result has no rows: made from nothing, the exchange's own output
        # is used by no node there (every rank still back-propagates through the call).
        loss = dg.gather(y, 0, sizes=sizes).square().sum()
        a = dg.all_gather(y, sizes=sizes)  # [36, 4]
        b = dg.permute(y, ring, recv_shape=(sizes[back], 4))
        c = dg.all_reduce(x)
        return loss + a.sum() + (b * b).sum() + c.sum()

    gen = seeded(20 + rank)
    x = torch.randn(40, 4, dtype=torch.float64, generator=gen, requires_grad=True)
    y = torch.randn(sizes[rank], 4, dtype=torch.float64, generator=gen, requires_grad=True)
    return _eager_and_compiled(step, [x, y], "inductor")


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize("setting", ["default", "reorder"])
def test_a_dropped_gather_still_runs_and_independent_exchanges_keep_one_order(
    setting: str,
) -> None:
    run_on_ranks(_dropped_gather_and_independent_exchanges, 3, args=(setting,), timeout=240)


def _collective_calls(code: str, op: str) -> int:
    return len(re.findall(rf"torch\.ops\._c10d_functional\.{op}\w*\.default\(", code))


def _bucketed(rank: int, n: int) -> dict[str, int]:
    """16 small all_reduces (64 floats each) in one step, with torch's bucketing on: the
    generated code's all_reduce calls, written with distgrad and with funcol."""
    from torch._inductor.utils import run_and_get_code

    config = torch._inductor.config
    config.compile_threads = 1
    config.bucket_all_reduces_fx = "all"
    group = dist.group.WORLD
    xs = [torch.full((64,), float(i + rank)) for i in range(16)]

    def with_distgrad(*xs: Tensor) -> list[Tensor]:
        return [dg.all_reduce(x * 2) for x in xs]

    def with_funcol(*xs: Tensor) -> list[Tensor]:
        return [funcol.all_reduce(x * 2, "sum", group) for x in xs]

    counts = {}
    for name, fn in (("distgrad", with_distgrad), ("funcol", with_funcol)):
        torch._dynamo.reset()
        outs, codes = run_and_get_code(torch.compile(fn, fullgraph=True), *xs)
        want = [sum(2 * (i + r) for r in range(n)) for i in range(16)]
        assert [float(o[0]) for o in outs] == want, name
        counts[name] = sum(_collective_calls(code, "all_reduce") for code in codes)
    return counts


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_torch_bucketing_merges_distgrad_all_reduces_as_it_merges_funcol() -> None:
    for counts in run_on_ranks(_bucketed, 2, timeout=240):
        assert counts["distgrad"] == counts["funcol"] < 16, counts


def _overlapped(rank: int, n: int) -> list[int]:
    """With the overlap scheduler, where the generated code waits for a distgrad all_reduce:
    the positions of the collective, of the matmul it does not need, and of its wait."""
    from torch._inductor.utils import run_and_get_code

    _configure("overlap")

    def step(x: Tensor, w: Tensor) -> Tensor:
        reduced = dg.all_reduce(x)  # independent of the matmul below
        y = (w @ w).tanh()
        return reduced.sum() + y.sum()

    gen = seeded(rank)
    x = torch.randn(256, generator=gen)
    w = torch.randn(64, 64, generator=gen)
    _, (code,) = run_and_get_code(torch.compile(step, fullgraph=True), x, w)
    body = code[code.index("def call(") :]
    start = body.index("_c10d_functional.all_reduce")
    wait = body.index("_c10d_functional.wait_tensor")
    matmul = min(i for i in (body.find("extern_kernels.mm("), body.find("aten.mm")) if i >= 0)
    return [start, matmul, wait]


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_the_overlap_scheduler_places_a_distgrad_wait_after_independent_compute() -> None:
    for start, matmul, wait in run_on_ranks(_overlapped, 2, timeout=240):
        assert start < matmul < wait, (start, matmul, wait)


def _exchanges_in(fn: Any, *args: Tensor) -> int:
    """The c10d collectives one call of ``fn`` starts, from the profiler's events."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        fn(*args)
    return sum(1 for e in prof.events() if e.name.startswith("c10d::"))


def _forward_exchanges(rank: int, n: int) -> dict[str, int]:
    """Each compiled forward alone (no backward), counted: a backward exchange computed from
    the inputs alone would be hoisted into the forward by AOTAutograd's partitioner, and kept
    there beside its copy in the backward."""
    gen = seeded(30 + rank)
    rows = [6] * n
    a = torch.randn(6, 4, dtype=torch.float64, generator=gen, requires_grad=True)
    b = torch.randn(6, 4, dtype=torch.float64, generator=gen, requires_grad=True)
    steps = {
        "siglip_loss, ring": lambda a, b: dg.losses.siglip_loss(a, b, sizes=rows, block_size=2),
        "clip_loss, ring": lambda a, b: dg.losses.clip_loss(a, b, sizes=rows, block_size=2),
        "gather": lambda a, b: dg.gather(a, 0, sizes=[6] * n).sum() + b.sum(),
    }
    found = {}
    for name, step in steps.items():
        torch._dynamo.reset()
        compiled = torch.compile(step, backend="aot_eager", fullgraph=True)
        compiled(a, b).backward()  # compiled, forward and backward
        found[name] = _exchanges_in(compiled, a, b)
    return found


def test_a_compiled_forward_runs_no_exchange_of_its_backward() -> None:
    """Semantics: the exchanges of a compiled forward are its own. On 2 ranks, sizes given:
    SigLIP's ring shifts its keys once (W - 1) and all_reduces its loss; CLIP's ring makes
    W + 1 = 3 exchanges (the texts ahead of their column logsumexps, which come home) and
    all_reduces; a gather is one all_to_all. (The backward's first exchange carries the keys
    alone and is still not hoisted into the forward.)"""
    for found in run_on_ranks(_forward_exchanges, 2, timeout=120):
        assert found == {"siglip_loss, ring": 2, "clip_loss, ring": 4, "gather": 1}, found


def _collective_then_loss(rank: int, n: int) -> list[float]:
    """A collective, then a loss that resolves the same default group, in one graph: the group
    must stay guardable however its first use in the trace was checked."""
    rows = [4] * n

    def step(x: Tensor, y: Tensor) -> Tensor:
        total = dg.all_reduce(x)
        return dg.losses.info_nce(total, y, sizes=rows) + dg.all_gather(y, sizes=rows).sum()

    gen = seeded(40 + rank)
    x = torch.randn(4, 6, dtype=torch.float64, generator=gen, requires_grad=True)
    y = torch.randn(4, 6, dtype=torch.float64, generator=gen, requires_grad=True)
    return _eager_and_compiled(step, [x, y], "aot_eager")


def test_a_collective_then_a_loss_on_the_same_group_compile_in_one_graph() -> None:
    run_on_ranks(_collective_then_loss, 2, timeout=120)
