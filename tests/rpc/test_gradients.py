"""A distributed backward equals local autograd of the same computation, in both modes.

Each case builds a computation from ``call(worker, fn, args)``; the reference runs it in one
process with ``call`` a plain function call, the distributed run with distgrad's
``rpc_sync``, ``remote(...).to_here()`` or ``rpc_async(...).wait()`` inside a context. Inputs
are float64 (float32 where a case converts), outputs are reduced with random cotangents, and
every leaf's gradient is compared, including which leaves get none and, for sparse leaves,
that the gradient is sparse. Most cases are torch's own (``dist_autograd_test.py`` in torch
2.13: the name in brackets), rewritten here.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import pytest
import torch
from torch import Tensor

import distgrad.rpc as dgrpc
from distgrad.testing import run_on_ranks
from tests import _support as support
from tests.rpc import _funcs as F
from tests.rpc import _helpers as H
from tests.rpc import _scripted as S

Body = Callable[[F.Call, list[Tensor]], list[Tensor]]
CALLS: dict[str, F.Call] = {
    "sync": F.remote_call,
    "remote": F.remote_ref_call,
    "async": F.async_call,
}


@dataclass
class Case:
    body: Body
    leaves: Callable[[int], list[Tensor]]
    calls: tuple[str, ...] = ("sync",)
    tol: dict[str, float] = field(default_factory=dict)


def _dense(*grad: bool, shape: tuple[int, ...] = (3, 3)) -> Callable[[int], list[Tensor]]:
    return lambda seed: support.leaves(seed, [shape] * len(grad), grad)


def _sparse(*grad: bool) -> Callable[[int], list[Tensor]]:
    return lambda seed: [support.sparse_leaf(seed + i, requires_grad=g) for i, g in enumerate(grad)]


def _ssum(t: Tensor) -> Tensor:
    return torch.sparse.sum(t) if t.is_sparse else t.sum()


# --- torch's cases ----------------------------------------------------------------------------


def simple(call: F.Call, x: list[Tensor]) -> list[Tensor]:  # [test_backward_simple]
    return [_ssum(call("worker1", torch.add, (x[0], x[1])))]


def simple_self(call: F.Call, x: list[Tensor]) -> list[Tensor]:  # [test_backward_simple_self]
    return [_ssum(call("worker0", torch.add, (x[0], x[1])))]


def python_udf(call: F.Call, x: list[Tensor]) -> list[Tensor]:  # [..._simple_python_udf]
    return [_ssum(call("worker1", F.py_add, (x[0], x[1])))]


def script(call: F.Call, x: list[Tensor]) -> list[Tensor]:  # [..._simple_script_call]
    return [_ssum(call("worker1", S.script_add, (x[0], x[1])))]


def round_trips(call: F.Call, x: list[Tensor]) -> list[Tensor]:  # [..._multiple_round_trips]
    val = call("worker1", torch.add, (x[0], x[1]))
    val = call("worker2", torch.mul, (x[2], val))
    s1 = call("worker1", torch.stack, ((x[3], val),))
    s2 = call("worker2", torch.stack, ((x[4], val),))
    if s1.is_sparse:
        val = call("worker1", torch.mul, (s1, s2))
        return [_ssum(call("worker2", torch.mul, (val, val)))]
    val = call("worker1", torch.bmm, (s1, s2))
    return [call("worker2", torch.matmul, (val, val))]


def tensor_dims(call: F.Call, x: list[Tensor]) -> list[Tensor]:  # [..._different_tensor_dims]
    val = call("worker1", torch.matmul, (x[0], x[1]))
    return [call("worker2", torch.linalg.multi_dot, ([val, x[2], x[3]],))]


def unused_tensors(call: F.Call, x: list[Tensor]) -> list[Tensor]:  # [..._unused_tensors]
    s = call("worker1", torch.stack, ((x[0], x[1], x[2]),))
    return [call("worker2", torch.matmul, (torch.narrow(s, 0, 0, 1), torch.narrow(s, 0, 2, 1)))]


def output_tensors(call: F.Call, x: list[Tensor]) -> list[Tensor]:  # [..._multiple_output_tensors]
    parts = call("worker1", torch.split, (x[0], 2))
    return [call("worker2", torch.linalg.multi_dot, ([parts[0], parts[2], parts[4]],))]


def multiple_roots(call: F.Call, x: list[Tensor]) -> list[Tensor]:  # [..._multiple_roots]
    return [
        call("worker1", torch.add, (x[0], x[1])).sum(),
        call("worker1", torch.mul, (x[0], x[1])).sum(),
        call("worker1", torch.cos, (x[0],)).sum(),
        call("worker1", torch.div, (x[0], x[1])).sum(),
    ]


def dtypes(call: F.Call, x: list[Tensor]) -> list[Tensor]:  # [..._different_dtypes]
    return [_ssum(call("worker1", torch.add, (x[0].float(), x[1])))]


def complex_udf(call: F.Call, x: list[Tensor]) -> list[Tensor]:  # [..._complex_python_udf]
    return [call("worker1", F.complex_python_udf, (x[0], x[1]))]


def nested_udf(call: F.Call, x: list[Tensor]) -> list[Tensor]:  # [test_backwards_nested_python_udf]
    local = call is F.local_call
    return [_ssum(call("worker1", F.nested_python_udf, (x[0], x[1], "worker2", local)))]


def mixed(call: F.Call, x: list[Tensor]) -> list[Tensor]:  # [test_mixed_requires_grad]
    return [_ssum(call("worker1", F.mixed_requires_grad_op, (x[0], x[1])))]


def without_rpc(call: F.Call, x: list[Tensor]) -> list[Tensor]:  # [..._without_rpc]
    return [torch.add(x[0], x[1]).sum()]


# --- distgrad's own cases ---------------------------------------------------------------------


def split_unused(call: F.Call, x: list[Tensor]) -> list[Tensor]:
    parts = call("worker1", torch.split, (x[0] * x[1], 1))
    return [parts[0] * 2.0, parts[2]]  # parts[1] is never used


def multiple_outputs(call: F.Call, x: list[Tensor]) -> list[Tensor]:
    mm, th, seven = call("worker1", F.two_outputs, (x[0], x[1]))
    assert seven == 7
    return [mm * seven, th]


def shared_input(call: F.Call, x: list[Tensor]) -> list[Tensor]:
    h = x[0] * x[1]  # reached both locally and through worker1
    return [call("worker1", torch.exp, (h,)) * h + x[2]]


def loop(call: F.Call, x: list[Tensor]) -> list[Tensor]:
    local = call is F.local_call
    return [call("worker1", F.scale_then_call_back, (x[0] * x[1], "worker0", local)) + x[2]]


def chain3(call: F.Call, x: list[Tensor]) -> list[Tensor]:
    return [F.chain(x[0] + x[1], ["worker1", "worker2", "worker1"], call is F.local_call) * x[2]]


def modified_after_send(call: F.Call, x: list[Tensor]) -> list[Tensor]:
    # The gradient of what was sent enters the graph where h was when it was sent, not
    # after the in-place change (add saves nothing, so local autograd allows it too).
    h = x[0] * 1.0
    y = call("worker1", torch.add, (h, x[1]))
    h.mul_(3.0)
    return [y, h * x[2]]


TOL32 = support.TORCH_FLOAT32
CASES: dict[str, Case] = {
    "simple": Case(simple, _dense(True, True), ("sync", "remote", "async")),
    "simple_self": Case(simple_self, _dense(True, True), ("sync", "remote")),
    "python_udf": Case(python_udf, _dense(True, True), ("remote",)),
    "script": Case(script, _dense(True, True), ("sync", "remote", "async")),
    "round_trips": Case(round_trips, _dense(True, False, True, False, True), ("sync", "remote")),
    "tensor_dims": Case(
        tensor_dims,
        lambda s: support.leaves(s, [(4, 6), (6, 5), (5, 7), (7, 9)], [True, False, True, False]),
        ("sync", "remote"),
    ),
    "unused_tensors": Case(unused_tensors, _dense(True, True, True), ("sync", "remote")),
    "output_tensors": Case(
        output_tensors, lambda s: support.leaves(s, [(10, 2)], [True]), ("sync", "remote")
    ),
    "multiple_roots": Case(multiple_roots, _dense(True, True)),
    "dtypes": Case(
        dtypes,
        lambda s: [support.leaf(s, 3, 3, dtype=torch.float32), support.leaf(s + 1, 3, 3)],
        ("sync", "remote"),
        TOL32,
    ),
    "complex_udf": Case(complex_udf, _dense(True, True), ("remote",)),
    "nested_udf": Case(nested_udf, _dense(True, True)),
    "mixed": Case(mixed, _dense(True, False), ("sync", "remote")),
    "without_rpc": Case(without_rpc, _dense(True, True)),
    "simple_sparse": Case(simple, _sparse(True, True), ("sync", "remote")),
    "simple_self_sparse": Case(simple_self, _sparse(True, True)),
    "python_udf_sparse": Case(python_udf, _sparse(True, True), ("remote",)),
    "script_sparse": Case(script, _sparse(True, True)),
    "round_trips_sparse": Case(round_trips, _sparse(True, False, True, False, True)),
    "dtypes_sparse": Case(
        dtypes,
        lambda s: [support.sparse_leaf(s, dtype=torch.float32), support.sparse_leaf(s + 1)],
        ("remote",),
        TOL32,
    ),
    "nested_udf_sparse": Case(nested_udf, _sparse(True, True)),
    "mixed_sparse": Case(mixed, _sparse(True, False)),
    "split_unused": Case(split_unused, _dense(True, True)),
    "multiple_outputs": Case(multiple_outputs, _dense(True, True)),
    "shared_input": Case(shared_input, _dense(True, True, True)),
    "loop": Case(loop, _dense(True, True, True)),
    "chain3": Case(chain3, _dense(True, True, True)),
    "modified_after_send": Case(modified_after_send, _dense(True, True, True)),
}


def _reference(case: Case, xs: list[Tensor], seed: int) -> list[Tensor | None]:
    outs = case.body(F.local_call, xs)
    wanted = [x for x in xs if x.requires_grad]
    got = iter(torch.autograd.grad(outs, wanted, support.cotangents(seed, outs), allow_unused=True))
    return [next(got) if x.requires_grad else None for x in xs]


def _distributed(
    case: Case, call: F.Call, xs: list[Tensor], seed: int, mode: str, retain: bool
) -> list[Tensor | None]:
    with dgrpc.context() as context_id:
        outs = case.body(call, xs)
        v = support.cotangents(seed, outs)
        dgrpc.backward(context_id, outs, retain, grad_tensors=v, mode=mode)  # type: ignore[arg-type]
        if retain:  # a second pass accumulates
            dgrpc.backward(context_id, outs, grad_tensors=v, mode=mode)  # type: ignore[arg-type]
        grads = dgrpc.get_gradients(context_id)
    assert all(x.grad is None for x in xs), ".grad was written by a distributed backward"
    return [grads.get(x) for x in xs]


def _check_cases(rank: int, world_size: int, mode: str) -> list[str]:
    if rank != 0:
        return []
    done = []
    for i, (name, case) in enumerate(CASES.items()):
        ref = _reference(case, case.leaves(i), seed=100 + i)
        for style in case.calls:
            retain = style == "sync"  # sync runs twice with retain_graph=True: twice the gradients
            xs = case.leaves(i)
            got = _distributed(case, CALLS[style], xs, 100 + i, mode, retain)
            for j, (r, d) in enumerate(zip(ref, got, strict=True)):
                want = None if r is None else (2 * r if retain else r)
                H.assert_close(d, want, f"{name} ({style}) input {j}", **case.tol)
            _check_storage(name, xs, got)
            done.append(f"{name}/{style}")
    return done


def _check_storage(name: str, xs: list[Tensor], got: list[Tensor | None]) -> None:
    """Like .grad: a dense gradient is laid out like its tensor and shares memory with no other
    gradient (an add's backward hands one tensor to both inputs; a sum's is an expanded view)."""
    dense = [(x, d) for x, d in zip(xs, got, strict=True) if d is not None and not d.is_sparse]
    storages = {d.untyped_storage().data_ptr() for _, d in dense}
    assert len(storages) == len(dense), f"{name}: gradients share memory"
    for x, d in dense:
        assert d.stride() == x.stride(), f"{name}: gradient strides {d.stride()}"


@pytest.mark.parametrize("mode", ["fast", "smart"])
def test_backward_matches_local_autograd(mode: str) -> None:
    """Every case on 3 workers, by rpc_sync (twice, retain_graph=True) and where torch's test
    does so by remote and rpc_async; float32 cases at float32 tolerances."""
    done = run_on_ranks(_check_cases, 3, args=(mode,), init="rpc", timeout=90)[0]
    assert len(done) == sum(len(c.calls) for c in CASES.values())
