"""torch's own distributed-autograd behaviours, held against distgrad in both modes.

The cases are those of torch 2.13's ``dist_autograd_test.py`` that apply to distgrad (torch's
test name in brackets), rewritten: hooks and how gradients are stored, accumulation and
``retain_graph``, arguments refused without harm, gradients that land on other workers
(RRefs, return values), trainers and parameter servers running at once, and errors. Each test
loops over its cases and both modes inside one RPC group.
"""

from __future__ import annotations

import threading
from typing import Any, ClassVar

import pytest
import torch
import torch.nn.functional as nnf
from torch import Tensor
from torch.distributed import rpc as torch_rpc

import distgrad.rpc as dgrpc
from distgrad.errors import RpcAutogradError, UnknownContextError
from distgrad.testing import run_on_ranks
from tests import _support as support
from tests.rpc import _funcs as F
from tests.rpc import _helpers as H


class _SameGrad(torch.autograd.Function):
    """x1 + x2; backward hands the one incoming buffer to both inputs (and records it)."""

    seen: ClassVar[list[int]] = []

    @staticmethod
    def forward(ctx: Any, x1: Tensor, x2: Tensor) -> Tensor:
        return x1 + x2

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, Tensor]:
        _SameGrad.seen.append(grad.data_ptr())
        return grad, grad


class _PassGrad(torch.autograd.Function):
    """Identity; records the buffer (values buffer, if sparse) its backward returns."""

    seen: ClassVar[list[int]] = []

    @staticmethod
    def forward(ctx: Any, x: Tensor) -> Tensor:
        return x.clone()

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> Tensor:
        _PassGrad.seen.append((grad._values() if grad.is_sparse else grad).data_ptr())
        return grad


class _ExpandedGrad(torch.autograd.Function):
    """A scalar from x; backward returns an expanded (stride 0) gradient."""

    @staticmethod
    def forward(ctx: Any, x: Tensor) -> Tensor:
        ctx.shape = x.shape
        return x.sum() * 0 + 1

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> Tensor:
        return torch.ones(1, dtype=grad.dtype).expand(ctx.shape)


class _SharedSparseGrad(torch.autograd.Function):
    """x1 + x2; backward returns one sparse gradient with expanded indices and values for
    both inputs."""

    @staticmethod
    def forward(ctx: Any, x1: Tensor, x2: Tensor) -> Tensor:
        return x1 + x2

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, Tensor]:
        values = torch.rand(1, 3, dtype=grad.dtype).expand(8, 3)
        indices = torch.ones(1, 1, dtype=torch.long).expand(1, 8)
        shared = torch.sparse_coo_tensor(indices, values, (10, 3))
        return shared, shared


def _hooks_and_storage(rank: int, world_size: int) -> None:
    if rank != 0:
        return
    for mode in H.MODES:
        _tensor_hooks(mode)
        _post_hooks(mode)
        _no_copy_where_torch_copies_none(mode)
        _no_copy_sparse(mode)
        _user_gradients_are_not_aliased(mode)


def _tensor_hooks(mode: str) -> None:  # [test_backward_verify_hooks]
    t1, t2 = support.leaf(1, 3, 3), support.leaf(2, 3, 3)
    t1.register_hook(lambda g: g * 2)
    want = torch.autograd.grad(torch.matmul(t1, t2).sum(), [t1, t2])
    for call in (F.remote_call, F.remote_ref_call):
        with dgrpc.context() as cid:
            dgrpc.backward(cid, [call("worker1", torch.matmul, (t1, t2)).sum()], mode=mode)
            got = dgrpc.get_gradients(cid)
        H.assert_close(got[t1], want[0], f"{mode}: hooked t1")
        H.assert_close(got[t2], want[1], f"{mode}: t2")


def _post_hooks(mode: str) -> None:  # [test_post_hooks]
    calls = [0]

    def add(n: int) -> Any:
        def hook(grad_inputs: Any, grad_outputs: Any) -> Any:
            calls[0] += n
            return grad_inputs

        return hook

    t = support.leaf(3, 10, 10)
    a = t + t
    a.grad_fn.next_functions[0][0].register_hook(add(1))  # type: ignore[union-attr]
    a.grad_fn.next_functions[0][0].register_hook(add(2))  # type: ignore[union-attr]
    a.grad_fn.next_functions[1][0].register_hook(add(2))  # type: ignore[union-attr]
    with dgrpc.context() as cid:
        dgrpc.backward(cid, [a.sum()], mode=mode)
        assert calls[0] == 5, f"{mode}: post-hooks ran {calls[0]} times, 5 expected"
        assert list(dgrpc.get_gradients(cid)) == [t]
    # A leaf that was sent: its gradient comes back over RPC, and its post-hook runs once.
    calls[0] = 0
    u = support.leaf(4, 3)
    node = (u * 1).grad_fn.next_functions[0][0]  # type: ignore[union-attr]
    node.register_hook(add(1))
    with dgrpc.context() as cid:
        dgrpc.backward(cid, [dgrpc.rpc_sync("worker1", torch.exp, args=(u,)).sum()], mode=mode)
        assert calls[0] == 1, f"{mode}: a sent leaf's post-hook ran {calls[0]} times"


def _no_copy_where_torch_copies_none(mode: str) -> None:  # [test_no_grad_copy]
    a, b = support.leaf(5, 5, 6), support.leaf(6, 5, 6)
    # An expanded gradient is copied, one buffer handed to two leaves is copied for both.
    with dgrpc.context() as cid:
        dgrpc.backward(cid, [_ExpandedGrad.apply(_SameGrad.apply(a, b))], mode=mode)
        grads = dgrpc.get_gradients(cid)
        assert _SameGrad.seen[-1] not in (grads[a].data_ptr(), grads[b].data_ptr()), mode
    # A gradient that is a tensor of its own is kept as it is.
    with dgrpc.context() as cid:
        dgrpc.backward(cid, [_PassGrad.apply(a)[1][0]], mode=mode)
        assert dgrpc.get_gradients(cid)[a].data_ptr() == _PassGrad.seen[-1], mode
    with dgrpc.context() as cid:
        dgrpc.backward(cid, [_SameGrad.apply(a, b)[1][0]], mode=mode)
        grads = dgrpc.get_gradients(cid)
        ptrs = {grads[a].data_ptr(), grads[b].data_ptr(), _SameGrad.seen[-1]}
        assert len(ptrs) == 3, f"{mode}: a, b and the shared buffer must all differ"


def _no_copy_sparse(mode: str) -> None:  # [test_no_grad_copy_sparse, ..._indices_extra_ref]
    a, b = support.leaf(7, 10, 3), support.leaf(8, 10, 3)
    inputs, offsets = torch.tensor([1, 2, 4, 5, 4, 3, 2, 9]), torch.tensor([0, 4])
    with dgrpc.context() as cid:
        loss = nnf.embedding_bag(_PassGrad.apply(a), inputs, offsets, sparse=True).sum()
        dgrpc.backward(cid, [loss], True, mode=mode)
        first = dgrpc.get_gradients(cid)[a]
        assert first.is_sparse and first._values().data_ptr() == _PassGrad.seen[-1], mode
        for _ in range(10):
            dgrpc.backward(cid, [loss], True, mode=mode)
        H.assert_close(dgrpc.get_gradients(cid)[a], 11 * first, f"{mode}: 11 passes")
    with dgrpc.context() as cid:
        loss = nnf.embedding_bag(_SharedSparseGrad.apply(a, b), inputs, offsets, sparse=True)
        dgrpc.backward(cid, [loss.sum()], mode=mode)
        grads = dgrpc.get_gradients(cid)
        ga, gb = grads[a], grads[b]
        assert ga._values().data_ptr() != gb._values().data_ptr(), mode
        assert ga._values().is_contiguous() and ga._indices().is_contiguous(), mode


def _user_gradients_are_not_aliased(mode: str) -> None:  # distgrad's own
    x, z = support.leaf(9, 3, 3), support.leaf(10, 3)
    v = support.cotangent(11, x)
    with dgrpc.context() as cid:
        y = dgrpc.rpc_sync("worker1", torch.neg, args=(z,))
        # x.view's backward hands back a view of the gradient the user passed in.
        dgrpc.backward(cid, [x.view(9), y], grad_tensors=[v.view(9), z.detach()], mode=mode)
        g = dgrpc.get_gradients(cid)[x]
        assert g.untyped_storage().data_ptr() != v.untyped_storage().data_ptr(), mode
        H.assert_close(g, v, f"{mode}: x")


def test_hooks_post_hooks_and_gradient_storage_follow_torch() -> None:
    run_on_ranks(_hooks_and_storage, 2, init="rpc")


def _accumulation_and_arguments(rank: int, world_size: int) -> None:
    if rank != 0:
        return
    for mode in H.MODES:
        _accumulate(mode)
        _dot_grad_untouched(mode)
        _embedding_bag_twice(mode)
        _refused_arguments_leave_the_context_usable(mode)


def _accumulate(mode: str) -> None:  # [test_backward_accumulate_grads, ..._multiple_backward]
    t1, t2 = support.leaf(11, 3, 3), support.leaf(12, 3, 3)
    want = torch.autograd.grad(torch.matmul(t1, t2).sum(), [t1, t2])
    with dgrpc.context() as cid:
        loss = dgrpc.rpc_sync("worker1", torch.matmul, args=(t1, t2)).sum()
        dgrpc.backward(cid, [loss], retain_graph=True, mode=mode)
        dgrpc.backward(cid, [loss], mode=mode)
        got = dgrpc.get_gradients(cid)
        assert len(got) == 2
        H.assert_close(got[t1], 2 * want[0], f"{mode}: t1 twice")
    with dgrpc.context() as cid:  # [test_nested_backward_accumulate_grads]
        loss = dgrpc.rpc_sync("worker1", F.remote_call, args=("worker2", torch.add, (t1, t2)))
        dgrpc.backward(cid, [loss.sum()], True, mode=mode)
        dgrpc.backward(cid, [loss.sum()], mode=mode)
        H.assert_close(
            dgrpc.get_gradients(cid)[t2], torch.full((3, 3), 2.0, dtype=torch.float64), mode
        )
    with dgrpc.context() as cid:  # torch runs 1,000 passes; 100 show the same
        loss = dgrpc.rpc_sync("worker1", torch.add, args=(t1, t2)).sum()
        for _ in range(100):
            dgrpc.backward(cid, [loss], True, mode=mode)
        H.assert_close(
            dgrpc.get_gradients(cid)[t1], torch.full((3, 3), 100.0, dtype=torch.float64), mode
        )


def _full(value: float) -> Tensor:
    return torch.full((3, 3), value, dtype=torch.float64)


def _dot_grad_untouched(mode: str) -> None:  # [test_backward_no_grad_on_tensor]
    t1, t2 = support.leaf(13, 3, 3), support.leaf(14, 3, 3)
    with dgrpc.context() as cid:
        loss = dgrpc.rpc_sync("worker1", torch.add, args=(t1, t2)).sum()
        dgrpc.backward(cid, [loss], True, mode=mode)
        assert t1.grad is None and t2.grad is None, mode
        torch.add(t1, t2).sum().backward()
        before = (t1.grad.clone(), t2.grad.clone())  # type: ignore[union-attr]
        dgrpc.backward(cid, [loss], mode=mode)
        assert torch.equal(t1.grad, before[0]) and torch.equal(t2.grad, before[1]), mode  # type: ignore[arg-type]


def _embedding_bag_twice(mode: str) -> None:  # [test_embedding_bag_with_no_grad_tensors]
    remote_bag = dgrpc.remote("worker1", F.embedding_bag, args=(0,))
    local_bag = F.embedding_bag(0)
    inputs, offsets = torch.tensor([1, 2, 4, 5, 4, 3, 2, 9]), torch.tensor([0, 4])
    weights = torch.rand(8, generator=support.seeded(15), requires_grad=True)
    local = local_bag(inputs, offsets, weights).sum()
    local.backward(retain_graph=True)
    local.backward()
    with dgrpc.context() as cid:
        res = dgrpc.rpc_sync(
            "worker1", F.embedding_forward, args=(remote_bag, inputs, offsets, weights)
        )
        dgrpc.backward(cid, [res.sum()], True, mode=mode)
        dgrpc.backward(cid, [res.sum()], mode=mode)
        got = H.query("worker1", F.embedding_grad, remote_bag.torch_rref, cid)
    H.assert_close(got, local_bag.weight.grad, f"{mode}: embedding weight", rtol=1e-6, atol=1e-6)


def _refused_arguments_leave_the_context_usable(mode: str) -> None:  # [..._invalid_args]
    t1, t2 = support.leaf(16, 3, 3), support.leaf(17, 3, 3)
    with dgrpc.context() as cid:
        out = dgrpc.rpc_sync("worker1", torch.add, args=(t1, t2)).sum()
        with pytest.raises(
            TypeError, match=r"^incompatible function arguments: backward: roots must be a list"
        ):
            dgrpc.backward(cid, None, mode=mode)  # type: ignore[arg-type]
        with pytest.raises(
            TypeError,
            match=r"^incompatible function arguments: "
            r"backward: context_id must be an int",
        ):
            dgrpc.backward(None, None, mode=mode)  # type: ignore[arg-type]
        with pytest.raises(TypeError, match="retain_graph must be a bool"):
            dgrpc.backward(cid, [out], [torch.ones(())], mode=mode)  # type: ignore[arg-type]
        refusals = [
            ([], "no tensors provided for gradient computation"),
            ([torch.rand(3, 3)], "requires_grad not set"),
            ([torch.rand(3, 3, requires_grad=True) * 2], r"not a scalar"),
            ([torch.rand(1, requires_grad=True)], "does not have a valid gradient function"),
        ]
        for roots, message in refusals:
            with pytest.raises(RuntimeError, match=message) as info:
                dgrpc.backward(cid, roots, mode=mode)
            assert isinstance(info.value, RpcAutogradError)
        dgrpc.backward(cid, [out], mode=mode)  # the context is untouched by the refusals
        H.assert_close(dgrpc.get_gradients(cid)[t1], torch.ones(3, 3, dtype=torch.float64), mode)


def test_accumulation_retain_graph_and_refused_arguments_follow_torch() -> None:
    run_on_ranks(_accumulation_and_arguments, 3, init="rpc")


def _owner_side(rank: int, world_size: int) -> None:
    if rank != 0:
        return
    for mode in H.MODES:
        for sparse in (False, True):
            _rref_paths(mode, sparse)
        _return_value_and_thread_local(mode)


def _rref_paths(mode: str, sparse: bool) -> None:  # [test_backward_rref, ..._nested]
    t2 = support.sparse_leaf(21) if sparse else support.leaf(21, 4, 4)
    for callee, owner in (("worker1", "worker1"), ("worker1", "worker2")):
        t1 = F.owned_leaf(20, sparse)  # the owner makes the same leaf
        ret = torch.add(t1, t2)
        want = torch.autograd.grad(torch.sparse.sum(ret) if sparse else ret.sum(), [t1, t2])
        with dgrpc.context() as cid:
            rref = dgrpc.remote(owner, F.owned_leaf, args=(20, sparse))
            if callee == owner:
                out = dgrpc.remote(callee, F.rref_add, args=(rref, t2)).to_here()
            else:
                out = dgrpc.remote(callee, F.nested_rref_add, args=(owner, rref, t2)).to_here()
            dgrpc.backward(cid, [torch.sparse.sum(out) if sparse else out.sum()], mode=mode)
            what = f"{mode}, sparse={sparse}, callee {callee}, owner {owner}"
            H.assert_close(dgrpc.get_gradients(cid)[t2], want[1], f"{what}: t2")
            got = H.query(owner, F.owner_grad, cid, rref.torch_rref)
            H.assert_close(got, want[0], f"{what}: the owner's t1")


def _return_value_and_thread_local(mode: str) -> None:
    for call in (F.remote_call, F.remote_ref_call):  # [test_grad_only_on_return_value]
        with dgrpc.context() as cid:
            ret = call("worker1", F.ret_requires_grad, ())
            dgrpc.backward(cid, [ret.sum()], mode=mode)
            assert dgrpc.get_gradients(cid) == {}
            got = H.query("worker1", F.returned_grad, cid)
            H.assert_close(got, torch.ones(3, 3, dtype=torch.float64), mode)
    # [test_thread_local_context_id]: the RRef is made outside the context; its value on the
    # owner is a leaf; the fetch inside the context records it.
    t1, t2 = (
        support.leaf(22, 3, 3, requires_grad=False),
        support.leaf(23, 3, 3, requires_grad=False),
    )
    rref = dgrpc.remote("worker1", F.slow_add, args=(t1, t2))
    with dgrpc.context() as cid:
        dgrpc.backward(cid, [rref.to_here().sum()], mode=mode)
        got = H.query("worker1", F.owner_grad, cid, rref.torch_rref)
        H.assert_close(got, torch.ones(3, 3, dtype=torch.float64), f"{mode}: slow_add")


def test_gradients_reach_owners_through_rrefs_and_return_values() -> None:
    run_on_ranks(_owner_side, 3, init="rpc")


def _servers_and_trainers(rank: int, world_size: int) -> None:
    """Every worker is a parameter server for the three others, all at once (torch's
    test_trainer_ps); then workers 1-3 each run 6 threads of forward and backward against
    worker0 (test_async_dist_autograd)."""
    me = f"worker{rank}"
    for mode in H.MODES:
        for sparse in (False, True):
            rref = dgrpc.RRef(F.owned_leaf(30 + rank, sparse))
            t2 = support.sparse_leaf(40) if sparse else support.leaf(40, 4, 4)
            trainers = [f"worker{(rank + d) % world_size}" for d in (1, 2, 3)]
            futures = [
                torch_rpc.rpc_async(t, F.trainer, args=(rref.torch_rref, t2, me, mode, sparse))
                for t in trainers
            ]
            assert all(f.wait() for f in futures), f"{me} as server, {mode}, sparse={sparse}"
        if rank != 0:
            errors: list[BaseException] = []
            threads = [threading.Thread(target=_hammer, args=(mode, errors)) for _ in range(6)]
            for t in threads:
                t.start()
            for t in threads:
                t.join(60)
            assert not errors, errors


def _hammer(mode: str, errors: list[BaseException]) -> None:
    try:
        F.hammer(mode)
    except BaseException as exc:
        errors.append(exc)


def test_trainers_and_parameter_servers_run_at_once() -> None:
    run_on_ranks(_servers_and_trainers, 4, init="rpc", timeout=90)


def _errors(rank: int, world_size: int) -> None:
    if rank != 0:
        return
    for mode in H.MODES:
        _error_deep_in_the_chain(mode)
        _error_in_a_nested_udf_then_recovery(mode)
    _forward_errors_keep_their_type()
    _torch_rpc_refused_inside_a_context()
    with pytest.raises(RuntimeError, match="Could not find autograd context with id: 100") as info:
        dgrpc.backward(100, [support.leaf(1, 1) * 2])  # [test_backward_without_context]
    assert isinstance(info.value, UnknownContextError)
    for w, state in enumerate(H.states(world_size)):
        assert state["passes_in_flight"] == state["smart_passes"] == 0, (w, state)


def _error_deep_in_the_chain(mode: str) -> None:  # [test_backward_autograd_engine_error]
    t1, t2 = support.leaf(50, 3, 3), support.leaf(51, 3, 3)
    with dgrpc.context() as cid:
        t3 = F.SimulateBackwardError.apply((t1 + t2) * (t1 + t2))
        val = dgrpc.rpc_sync("worker1", torch.add, args=(t2, t3))
        val = dgrpc.rpc_sync("worker2", torch.mul, args=(val, t2))
        val = dgrpc.rpc_sync("worker3", torch.matmul, args=(val, t2))
        val = dgrpc.rpc_sync("worker1", torch.div, args=(val, t2))
        with pytest.raises(
            RuntimeError,
            match=r"^Error on Node 0: RuntimeError: simulated"
            r".*\(distributed backward failed on worker0\)",
        ):
            dgrpc.backward(cid, [val.sum()], mode=mode)


def _error_in_a_nested_udf_then_recovery(mode: str) -> None:  # [..._python_udf_error,
    t1, t2 = support.leaf(52, 3, 3), support.leaf(53, 3, 3)  #  ..._multiple_backward_with_errors]
    with dgrpc.context() as cid:
        loss = dgrpc.rpc_sync(
            "worker1", F.nested_udf_with_backward_error, args=(t1, t2, "worker2")
        ).sum()
        for _ in range(3):
            with pytest.raises(
                RpcAutogradError,
                match=r"^Error on Node 2: RuntimeError: sim"
                r".*\(distributed backward failed on worker2\)",
            ):
                dgrpc.backward(cid, [loss], True, mode=mode)
        H.query("worker2", F.set_backward_error, False)
        try:
            for _ in range(3):
                dgrpc.backward(cid, [loss], True, mode=mode)
        finally:
            H.query("worker2", F.set_backward_error, True)


def _forward_errors_keep_their_type() -> None:  # [test_error_in_context]
    with dgrpc.context():
        with pytest.raises(RuntimeError):
            dgrpc.rpc_sync(
                "worker1", torch.matmul, args=(support.leaf(1, 3, 3), support.leaf(2, 6, 6))
            )
        with pytest.raises(ValueError, match="told to fail"):
            dgrpc.rpc_sync("worker1", F.raise_value_error, args=("told to fail",))
        with pytest.raises(ValueError, match="told to fail"):
            dgrpc.rpc_async("worker1", F.raise_value_error, args=("told to fail",)).wait()
        with pytest.raises(ValueError, match="told to fail"):
            dgrpc.remote("worker1", F.raise_value_error, args=("told to fail",)).to_here()


def _torch_rpc_refused_inside_a_context() -> None:
    one = torch.ones(1)
    with dgrpc.context():
        for name, call in (
            ("rpc_sync", lambda: torch_rpc.rpc_sync("worker1", torch.add, args=(one, 1))),
            ("rpc_async", lambda: torch_rpc.rpc_async("worker1", torch.add, args=(one, 1))),
            ("remote", lambda: torch_rpc.remote("worker1", torch.add, args=(one, 1))),
        ):
            with pytest.raises(RpcAutogradError, match=rf"rpc\.{name} was called on worker0 in"):
                call()
        # Inside a function that a distgrad call runs on another worker, too.
        with pytest.raises(RuntimeError, match=r"rpc\.rpc_sync was called on worker1 inside"):
            dgrpc.rpc_sync("worker1", F.call_torch_rpc, args=("worker2",))
    assert torch_rpc.rpc_sync("worker1", torch.add, args=(one, 1)).item() == 2.0  # outside


def test_errors_reach_the_caller_with_torch_types_and_the_worker_named() -> None:
    run_on_ranks(_errors, 4, init="rpc")
