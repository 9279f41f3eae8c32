"""distgrad.pipeline's distributed backward equals one float64 process.

Every case builds the whole model on every rank from one seed, computes the single-process
reference there (the objective: the sum over ranks of the roots each rank passes, i.e. the
sum of every stage's losses over every microbatch, each weighted by a random cotangent), then
runs its own stage with dg.pipeline's send/recv and backward, and compares each gradient it
holds with the reference's. Real gloo ranks (run_on_ranks).
"""

from __future__ import annotations

from collections.abc import Sequence

import pytest
import torch
import torch.distributed as dist
from torch import Tensor

import distgrad.pipeline as dgp
from distgrad.testing import run_on_ranks
from tests._support import FLOAT64, seeded

WIDTH = 5


def _weights(n: int) -> list[Tensor]:
    g = seeded(7)
    return [torch.randn(WIDTH, WIDTH, dtype=torch.float64, generator=g) / 2 for _ in range(n)]


def _stage(h: Tensor, w: Tensor) -> Tensor:
    return torch.tanh(h @ w)


def _one_f_one_b(stage: int, stages: int, microbatches: int) -> list[tuple[str, int]]:
    """The order in which a 1F1B schedule runs one stage's forwards and backwards."""
    warmup = min(stages - stage - 1, microbatches)
    order = [("F", m) for m in range(warmup)]
    f, b = warmup, 0
    while b < microbatches:
        if f < microbatches:
            order.append(("F", f))
            f += 1
        order.append(("B", b))
        b += 1
    return order


def _chain(rank: int, world: int, sizes: Sequence[int], accumulate: str) -> float:
    """A chain of ``world`` stages, microbatches of ``sizes`` rows run in 1F1B order, the first
    stage's input a leaf too; returns the largest difference from the reference seen."""
    weights = _weights(world)
    g = seeded(11)
    xs = [torch.randn(n, WIDTH, dtype=torch.float64, generator=g) for n in sizes]
    vs = [torch.randn(n, WIDTH, dtype=torch.float64, generator=g) for n in sizes]
    # The reference: every stage in this process, every microbatch.
    ref_w = [w.clone().requires_grad_() for w in weights]
    ref_x = [x.clone().requires_grad_() for x in xs]
    total = torch.zeros((), dtype=torch.float64)
    for x, v in zip(ref_x, vs, strict=True):
        h = x
        for w in ref_w:
            h = _stage(h, w)
        total = total + (h * v).sum()
    total.backward()

    w = weights[rank].clone().requires_grad_()
    x_leaves = [x.clone().requires_grad_() for x in xs]
    worst = 0.0
    for _step in range(3):  # the first steps are checked, later ones send only data
        w.grad = None
        for x in x_leaves:
            x.grad = None
        with dgp.context() as cid:
            losses: dict[int, Tensor] = {}
            for kind, m in _one_f_one_b(rank, world, len(sizes)):
                if kind == "F":
                    # Rank 0's input is a leaf; the others' shape is learned, then reused.
                    h = x_leaves[m] if rank == 0 else dgp.recv(rank - 1, microbatch=m)
                    out = _stage(h, w)
                    if rank < world - 1:
                        dgp.isend(out, rank + 1, microbatch=m)
                    else:
                        losses[m] = (out * vs[m]).sum()
                else:
                    roots = [losses.pop(m)] if m in losses else []
                    dgp.backward(cid, roots, microbatch=m, accumulate=accumulate)  # type: ignore[arg-type]
            got = dgp.get_gradients(cid) if accumulate == "context" else {}
        if accumulate == "context":
            assert w.grad is None, "accumulate='context' must leave .grad untouched"
            w_grad = got[w]
            x_grads = [got.get(x) for x in x_leaves]
        else:
            w_grad = w.grad
            x_grads = [x.grad for x in x_leaves]
        assert w_grad is not None
        torch.testing.assert_close(w_grad, ref_w[rank].grad, **FLOAT64)
        worst = max(worst, (w_grad - ref_w[rank].grad).abs().max().item())  # type: ignore[operator]
        if rank == 0:
            for got_x, ref in zip(x_grads, ref_x, strict=True):
                assert got_x is not None
                torch.testing.assert_close(got_x, ref.grad, **FLOAT64)
    return worst


@pytest.mark.parametrize("world", [2, 3, 4])
def test_a_chain_of_stages_in_1f1b_order_equals_one_process(world: int) -> None:
    """Chains of 2-4 stages, three uneven microbatches (3, 1 and 2 rows) whose backwards
    interleave with forwards (1F1B), shapes learned from the checked calls: every stage's
    weight gradient and the first stage's input gradient equal one process's, over 3 steps."""
    worst = run_on_ranks(_chain, world, args=([3, 1, 2], "grad"))
    assert max(worst) < 1e-12


def test_gradients_can_accumulate_into_the_context_instead_of_grad() -> None:
    """accumulate='context': the same gradients, read with get_gradients; .grad untouched."""
    run_on_ranks(_chain, 2, args=([2, 2], "context"))


def _skip_and_two_sources(rank: int, world: int) -> None:
    """Rank 0 sends h to ranks 1 and 2 (a skip connection) and a tensor rank 2 never uses;
    rank 1 has a loss of its own and sends on; rank 2 receives from two ranks."""
    w0, w1, w2 = (w.clone().requires_grad_() for w in _weights(3))
    g = seeded(5)
    x = torch.randn(4, WIDTH, dtype=torch.float64, generator=g).requires_grad_()
    v1, v2 = (torch.randn(4, WIDTH, dtype=torch.float64, generator=g) for _ in range(2))

    def loss_1(a: Tensor) -> Tensor:
        return (a * v1).sum()

    def loss_2(b: Tensor, c: Tensor) -> Tensor:
        return (((b + c) @ w2) * v2).sum()

    # Reference, one process.
    h = _stage(x, w0)
    y = _stage(h, w1)
    (loss_1(h) + loss_2(y, h)).backward()
    reference = {"w0": w0.grad, "w1": w1.grad, "w2": w2.grad, "x": x.grad}
    for t in (w0, w1, w2, x):
        t.grad = None

    with dgp.context() as cid:
        if rank == 0:
            h = _stage(x, w0)
            dgp.send(h, 1)
            dgp.send(h, 2)
            dgp.send(h * 3, 2)  # never reaches a loss: its gradient is zeros, still sent
            dgp.backward(cid)
            got = {"w0": w0.grad, "x": x.grad}
        elif rank == 1:
            a = dgp.recv(0)
            dgp.send(_stage(a, w1), 2)
            dgp.backward(cid, [loss_1(a)])
            got = {"w1": w1.grad}
        else:
            b = dgp.recv(1)
            c = dgp.recv(0)
            dgp.recv(0)  # received, unused
            dgp.backward(cid, [loss_2(b, c)])
            got = {"w2": w2.grad}
    for name, grad in got.items():
        assert grad is not None, name
        torch.testing.assert_close(grad, reference[name], **FLOAT64)


def test_a_skip_connection_a_stage_fed_by_two_and_an_unused_output_equal_one_process() -> None:
    """One stage's output used by two later ones, a stage that receives from two, a stage with
    a loss of its own that also sends on, and a received tensor that reaches no loss: the
    backward completes on every rank and every gradient equals one process's."""
    run_on_ranks(_skip_and_two_sources, 3)


def _design_note_example(rank: int, world: int) -> None:
    """The design note's example, over point-to-point: rank 0 sends t1 and t2 to rank 1,
    which adds them and sends t3 back; rank 0 multiplies by t4 and sums."""
    g = seeded(3)
    t1, t2, t4 = (torch.rand(3, 3, dtype=torch.float64, generator=g) for _ in range(3))
    t1.requires_grad_()
    t2.requires_grad_()
    t4.requires_grad_()
    with dgp.context() as cid:
        if rank == 0:
            dgp.send(t1, 1)
            dgp.send(t2, 1)
            t3 = dgp.recv(1)
            t5 = t3 * t4
            dgp.backward(cid, [t5.sum()], accumulate="context")
            grads = dgp.get_gradients(cid)
            assert t1.grad is None and t4.grad is None
            torch.testing.assert_close(grads[t1], t4.detach(), **FLOAT64)
            torch.testing.assert_close(grads[t2], t4.detach(), **FLOAT64)
            torch.testing.assert_close(grads[t4], (t1 + t2).detach(), **FLOAT64)
        else:
            a = dgp.recv(0)
            b = dgp.recv(0)
            dgp.send(a + b, 0)
            dgp.backward(cid, accumulate="context")
            assert dgp.get_gradients(cid) == {}


def test_the_design_notes_worked_example_over_point_to_point() -> None:
    """get_gradients(cid) on rank 0 holds dt1 = dt2 = t4 and dt4 = t1 + t2, as the design
    note's FAST walk-through computes; rank 1, with no leaves, holds none."""
    run_on_ranks(_design_note_example, 2)


def _sub_groups_and_mesh(rank: int, world: int) -> None:
    """Two pipelines at once: one on each of two sub-groups, then one over a DeviceMesh dim."""
    from torch.distributed.device_mesh import init_device_mesh

    weights = _weights(2)
    x = torch.randn(3, WIDTH, dtype=torch.float64, generator=seeded(rank // 2))
    v = torch.randn(3, WIDTH, dtype=torch.float64, generator=seeded(10 + rank // 2))
    ref = [w.clone().requires_grad_() for w in weights]
    (_stage(_stage(x, ref[0]), ref[1]) * v).sum().backward()

    pairs = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "pp"))
    for group in (pairs[rank // 2], (mesh, "pp")):
        stage = rank % 2  # the group rank, in both layouts
        w = weights[stage].clone().requires_grad_()
        with dgp.context() as cid:
            if stage == 0:
                dgp.send(_stage(x, w), 1, group)  # type: ignore[arg-type]
                dgp.backward(cid)
            else:
                h = dgp.recv(0, group, shape=(3, WIDTH), dtype=torch.float64)  # type: ignore[arg-type]
                dgp.backward(cid, [(_stage(h, w) * v).sum()])
        torch.testing.assert_close(w.grad, ref[stage].grad, **FLOAT64)


def test_pipelines_on_sub_groups_and_on_a_mesh_dim_equal_one_process() -> None:
    """Ranks {0, 1} and {2, 3} run separate 2-stage pipelines (group ranks as peers), then
    the same over the 'pp' dim of a (dp, pp) DeviceMesh: each equals its own one process."""
    run_on_ranks(_sub_groups_and_mesh, 4)


def _split_backward(rank: int, world: int) -> None:
    """Zero-bubble order: each microbatch's input half (weights=False) first, its weight half
    later, on a 2-stage chain of two microbatches."""
    weights = _weights(2)
    g = seeded(2)
    xs = [torch.randn(3, WIDTH, dtype=torch.float64, generator=g) for _ in range(2)]
    vs = [torch.randn(3, WIDTH, dtype=torch.float64, generator=g) for _ in range(2)]
    ref = [w.clone().requires_grad_() for w in weights]
    torch.autograd.backward(
        [(_stage(_stage(x, ref[0]), ref[1]) * v).sum() for x, v in zip(xs, vs, strict=True)]
    )
    w = weights[rank].clone().requires_grad_()
    with dgp.context() as cid:
        losses = []
        for m in range(2):
            if rank == 0:
                dgp.send(_stage(xs[m], w), 1, microbatch=m)
            else:
                h = dgp.recv(0, microbatch=m)
                losses.append((_stage(h, w) * vs[m]).sum())
        for m in range(2):
            roots = [losses[m]] if rank == 1 else []
            dgp.backward(cid, roots, microbatch=m, weights=False)
            assert w.grad is None, "the input half must not touch a parameter's gradient"
        for m in (1, 0):  # weight halves in any order, later
            dgp.backward_weights(cid, microbatch=m)
    torch.testing.assert_close(w.grad, ref[rank].grad, **FLOAT64)


def test_a_split_backward_input_half_then_weight_half_equals_one_process() -> None:
    """backward(weights=False) sends the input gradients and leaves .grad alone;
    backward_weights then adds the parameters' gradients: the sum equals one process's."""
    run_on_ranks(_split_backward, 2)


def _compiled_stage(rank: int, world: int, backend: str) -> None:
    weights = _weights(2)
    x = torch.randn(4, WIDTH, dtype=torch.float64, generator=seeded(1))
    v = torch.randn(4, WIDTH, dtype=torch.float64, generator=seeded(2))
    ref = [w.clone().requires_grad_() for w in weights]
    (_stage(_stage(x, ref[0]), ref[1]) * v).sum().backward()
    w = weights[rank].clone().requires_grad_()
    compiled = torch.compile(_stage, backend=backend, fullgraph=True)
    for _ in range(2):
        w.grad = None
        with dgp.context() as cid:
            if rank == 0:
                dgp.send(compiled(x, w), 1)
                dgp.backward(cid)
            else:
                h = dgp.recv(0)
                dgp.backward(cid, [(compiled(h, w) * v).sum()])
        torch.testing.assert_close(w.grad, ref[rank].grad, **FLOAT64)


@pytest.mark.parametrize("backend", ["aot_eager", pytest.param("inductor", marks=pytest.mark.slow)])
def test_a_compiled_stage_between_transfers_equals_one_process(backend: str) -> None:
    """Each stage compiled (fullgraph) between eager transfers: its forward takes a received
    tensor, its backward sends the gradient on; equal to one process's."""
    run_on_ranks(_compiled_stage, 2, args=(backend,), timeout=240)
