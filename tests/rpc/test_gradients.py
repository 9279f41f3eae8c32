"""FAST-mode distributed backward equals local autograd of the same computation.

Each case builds a computation from ``call(worker, fn, args)``; the reference runs it in one
process with ``call`` a plain function call, the distributed run with ``distgrad.rpc.rpc_sync``
inside a context. Inputs are float64, the objective is ``sum(out * v)`` with ``v`` from a
seeded generator (random cotangents), and every leaf's gradient is compared, including which
leaves get none.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import Tensor

import distgrad.rpc as dgrpc
from distgrad.testing import run_on_ranks
from tests.rpc import _funcs as F

Case = Callable[[F.Call, list[Tensor], bool], list[Tensor]]


def _leaves(seed: int, shapes: list[tuple[int, ...]], grad: list[bool]) -> list[Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [
        torch.randn(*s, dtype=torch.float64, generator=g).requires_grad_(r)
        for s, r in zip(shapes, grad, strict=True)
    ]


def _cotangents(outs: list[Tensor], seed: int) -> list[Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(o.shape, dtype=o.dtype, generator=g) for o in outs]


def _case_add(call: F.Call, x: list[Tensor], local: bool) -> list[Tensor]:
    t3 = call("worker1", torch.add, (x[0], x[1]))
    return [t3 * x[2]]


def _case_matmul(call: F.Call, x: list[Tensor], local: bool) -> list[Tensor]:
    return [call("worker1", torch.matmul, (x[0], x[1])) + x[2]]


def _case_split_unused(call: F.Call, x: list[Tensor], local: bool) -> list[Tensor]:
    parts = call("worker1", torch.split, (x[0] * x[1], 1))
    return [parts[0] * 2.0, parts[2]]  # parts[1] is never used


def _case_multiple_outputs(call: F.Call, x: list[Tensor], local: bool) -> list[Tensor]:
    mm, th, seven = call("worker1", F.two_outputs, (x[0], x[1]))
    assert seven == 7
    return [mm * seven, th]


def _case_round_trips(call: F.Call, x: list[Tensor], local: bool) -> list[Tensor]:
    y = x[0]
    for _ in range(3):
        y = call("worker1", torch.mul, (y, x[1]))
        y = torch.sin(y) + x[2]
    return [y]


def _case_mixed_requires_grad(call: F.Call, x: list[Tensor], local: bool) -> list[Tensor]:
    return [call("worker1", torch.addcmul, (x[0], x[1], x[2]))]


def _case_dtypes(call: F.Call, x: list[Tensor], local: bool) -> list[Tensor]:
    y = call("worker1", torch.mul, (x[0].float(), x[1].float()))
    return [y.double() + x[2]]


def _case_shared_input(call: F.Call, x: list[Tensor], local: bool) -> list[Tensor]:
    h = x[0] * x[1]  # reached both locally and through worker1
    y = call("worker1", torch.exp, (h,))
    return [y * h + x[2]]


def _case_loop(call: F.Call, x: list[Tensor], local: bool) -> list[Tensor]:
    return [call("worker1", F.scale_then_call_back, (x[0] * x[1], "worker0", local)) + x[2]]


def _case_chain3(call: F.Call, x: list[Tensor], local: bool) -> list[Tensor]:
    return [F.chain(x[0] + x[1], ["worker1", "worker2", "worker1"], local) * x[2]]


def _case_no_rpc(call: F.Call, x: list[Tensor], local: bool) -> list[Tensor]:
    return [x[0] * x[1] + x[2]]


def _case_remote_rref(call: F.Call, x: list[Tensor], local: bool) -> list[Tensor]:
    if local:
        return [torch.mul(x[0], x[1]) + x[2]]
    rref = dgrpc.remote("worker1", torch.mul, args=(x[0], x[1]))
    return [rref.to_here() + x[2]]


def _case_rpc_async(call: F.Call, x: list[Tensor], local: bool) -> list[Tensor]:
    if local:
        return [torch.sub(x[0], x[1]) * x[2], torch.mul(x[0], x[2])]
    f1 = dgrpc.rpc_async("worker1", torch.sub, args=(x[0], x[1]))
    f2 = dgrpc.rpc_async("worker1", torch.mul, args=(x[0], x[2]))
    return [f1.wait() * x[2], f2.wait()]


def _case_modified_after_send(call: F.Call, x: list[Tensor], local: bool) -> list[Tensor]:
    # The gradient of what was sent enters the graph where h was when it was sent, not
    # after the in-place change (add saves nothing, so local autograd allows it too).
    h = x[0] * 1.0
    y = call("worker1", torch.add, (h, x[1]))
    h.mul_(3.0)
    return [y, h * x[2]]


SHAPE = [(3, 3), (3, 3), (3, 3)]
CASES: dict[str, tuple[Case, list[bool]]] = {
    "add": (_case_add, [True, True, True]),
    "matmul": (_case_matmul, [True, True, True]),
    "split_unused": (_case_split_unused, [True, True, False]),
    "multiple_outputs": (_case_multiple_outputs, [True, True, True]),
    "round_trips": (_case_round_trips, [True, True, True]),
    "mixed_requires_grad": (_case_mixed_requires_grad, [True, False, True]),
    "dtypes": (_case_dtypes, [True, True, True]),
    "shared_input": (_case_shared_input, [True, True, True]),
    "loop": (_case_loop, [True, True, True]),
    "chain3": (_case_chain3, [True, True, True]),
    "no_rpc": (_case_no_rpc, [True, True, True]),
    "remote_rref": (_case_remote_rref, [True, True, True]),
    "rpc_async": (_case_rpc_async, [True, False, True]),
    "modified_after_send": (_case_modified_after_send, [True, True, True]),
}


def _reference(case: Case, xs: list[Tensor], seed: int) -> list[Tensor | None]:
    outs = case(F.local_call, xs, True)
    wanted = [x for x in xs if x.requires_grad]
    got = iter(torch.autograd.grad(outs, wanted, _cotangents(outs, seed), allow_unused=True))
    return [next(got) if x.requires_grad else None for x in xs]


def _distributed(case: Case, xs: list[Tensor], seed: int, mode: str) -> list[Tensor | None]:
    with dgrpc.context() as context_id:
        outs = case(F.remote_call, xs, False)
        dgrpc.backward(context_id, outs, grad_tensors=_cotangents(outs, seed), mode=mode)
        grads = dgrpc.get_gradients(context_id)
    assert all(x.grad is None for x in xs), ".grad was written by a distributed backward"
    return [grads.get(x) for x in xs]


def _check_cases(rank: int, world_size: int, names: list[str], mode: str) -> list[str]:
    if rank != 0:
        return []
    done = []
    for i, name in enumerate(names):
        case, grad = CASES[name]
        ref = _reference(case, _leaves(i, SHAPE, grad), seed=100 + i)
        got = _distributed(case, _leaves(i, SHAPE, grad), seed=100 + i, mode=mode)
        for j, (r, d) in enumerate(zip(ref, got, strict=True)):
            if r is None:
                assert d is None, f"{name}: input {j} got a gradient, local autograd gives none"
            else:
                assert d is not None, f"{name}: input {j} got no gradient"
                tol: dict[str, Any] = {"rtol": 1e-5, "atol": 1e-6} if name == "dtypes" else {}
                torch.testing.assert_close(d, r, msg=lambda m, n=name, j=j: f"{n}[{j}]: {m}", **tol)
        # Like .grad: each gradient is laid out like its tensor and shares memory with no other
        # gradient (an add's backward hands one tensor to both inputs; a sum's is an expanded
        # view), so changing one in place cannot change another.
        grads = [d for d in got if d is not None]
        storages = {d.untyped_storage().data_ptr() for d in grads}
        assert len(storages) == len(grads), f"{name}: gradients share memory"
        for x, d in zip(_leaves(i, SHAPE, grad), got, strict=True):
            if d is not None:
                assert d.stride() == x.stride(), f"{name}: gradient strides {d.stride()}"
        done.append(name)
    return done


@pytest.mark.parametrize("mode", ["fast", "smart"])
def test_backward_matches_local_autograd(mode: str) -> None:
    """Every case on 3 workers (the chain needs a third); float32 case compared at 1e-5."""
    names = list(CASES)
    assert run_on_ranks(_check_cases, 3, args=(names, mode), init="rpc")[0] == names
