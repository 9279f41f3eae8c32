"""The rest of torch's RPC names, from distgrad.rpc: plain RPC names are torch's own; RRef
proxies, functions marked ``async_execution`` and ``RRef.backward`` are recorded in a context
like rpc_sync/rpc_async/remote, and their gradients equal local autograd's (both modes)."""

from __future__ import annotations

import contextlib
import io

import pytest
import torch
from torch.distributed import rpc as torch_rpc

import distgrad.rpc as dgrpc
from distgrad.errors import UnknownContextError
from distgrad.testing import run_on_ranks
from tests import _support as support
from tests.rpc import _funcs as F
from tests.rpc import _helpers as H


def _names(rank: int, world_size: int) -> None:
    if rank != 0:
        return
    info = dgrpc.get_worker_info("worker1")
    assert isinstance(info, dgrpc.WorkerInfo) and (info.name, info.id) == ("worker1", 1)
    assert dgrpc.get_worker_info().name == "worker0"
    assert dgrpc.BackendType.TENSORPIPE is torch_rpc.BackendType.TENSORPIPE
    assert dgrpc.TensorPipeRpcBackendOptions is torch_rpc.TensorPipeRpcBackendOptions
    _missing_attribute()
    for mode in H.MODES:
        _proxies(mode)
        _async_function(mode)
        _rref_backward(mode)
        _remote_module(mode)


def _proxies(mode: str) -> None:
    """[torch's test_rref_proxy_*] Each proxy kind, and a method marked async_execution."""
    x = support.leaf(1, 3, 3)
    v = support.cotangent(2, x)
    server = dgrpc.remote("worker1", F.ThreeByThree)
    scaler = dgrpc.remote("worker2", F.AsyncScaler)
    with dgrpc.context() as cid:
        x32 = x.float()  # the server's weight is float32
        a = server.rpc_sync().forward(x32)
        b = server.rpc_async().forward(x32).wait()
        c = server.remote().forward(x32).to_here()
        d = scaler.rpc_sync().scaled(x[0])
        dgrpc.backward(cid, [((a + b + c) * v).sum() + d.sum()], mode=mode)  # type: ignore[arg-type]
        got_x = dgrpc.get_gradients(cid)[x]
        got_w = H.query("worker1", F.leaf_grad_in, cid, server.torch_rref)
        got_s = H.query("worker2", F.leaf_grad_in_scaler, cid, scaler.torch_rref)
    w = H.query("worker1", F.call_method, F.ThreeByThree.get_w, server.torch_rref)
    w = w.detach().requires_grad_()
    s = torch.full((3,), 3.0, dtype=torch.float64, requires_grad=True)
    xx = x.detach().requires_grad_()
    loss = ((3 * torch.mm(w, xx.float())) * v).sum() + (xx[0] * s).sum()
    want_x, want_w, want_s = torch.autograd.grad(loss, [xx, w, s])
    tol = support.TORCH_FLOAT32  # float32 products
    H.assert_close(got_x, want_x, f"{mode}: x", **tol)
    H.assert_close(got_w, want_w, f"{mode}: server's w", **tol)
    H.assert_close(got_s, want_s, f"{mode}: scaler's w")


class _HoldsACallable:
    """A value whose callable is an attribute of the instance, not of its type."""

    def __init__(self) -> None:
        self.double = _double


def _double(x: torch.Tensor) -> torch.Tensor:
    return 2 * x


def _missing_attribute() -> None:
    """[torch's test_rref_proxy_non_exist] A name the value does not have raises torch's
    AttributeError: at the call for rpc_sync() and remote(), from the future's wait() for
    rpc_async(), inside a context too. distgrad's own: a callable the instance holds (torch's
    proxies look only at the type) is called."""
    rref = dgrpc.remote("worker1", torch.add, args=(torch.ones(2, 2), 1))
    message = "type object 'Tensor' has no attribute 'non_exist'"
    for cid in (None, 1):
        with dgrpc.context() if cid else contextlib.nullcontext():
            with pytest.raises(AttributeError, match=message):
                rref.rpc_sync().non_exist()
            with pytest.raises(AttributeError, match=message):
                rref.remote().non_exist()
            future = rref.rpc_async().non_exist()
            with pytest.raises(AttributeError, match=message):
                future.wait()
    holder = dgrpc.remote("worker1", _HoldsACallable)
    assert torch.equal(holder.rpc_sync().double(torch.ones(2)), torch.full((2,), 2.0))
    assert torch.equal(holder.rpc_async().double(torch.ones(2)).wait(), torch.full((2,), 2.0))


def _async_function(mode: str) -> None:
    """[torch's test_async_function_*] A function marked async_execution whose future's value
    requires grad (made by a nested call and a callback): the gradient reaches the caller."""
    x, y = support.leaf(3, 4), support.leaf(4, 4)
    v = support.cotangent(5, x)
    with dgrpc.context() as cid:
        out = dgrpc.rpc_sync("worker1", F.async_double_add, args=("worker2", x, y))
        dgrpc.backward(cid, [(out * v).sum()], mode=mode)  # type: ignore[arg-type]
        got = dgrpc.get_gradients(cid)
    torch.testing.assert_close(out.detach(), 2 * (x + y).detach())
    H.assert_close(got[x], 2 * v, f"{mode}: x through an async function")
    H.assert_close(got[y], 2 * v, f"{mode}: y through an async function")


def _rref_backward(mode: str) -> None:
    """[torch's test_owner_rref_backward, test_user_rref_backward] RRef.backward(cid) runs a
    distributed backward from the value on its owner: from a user RRef (the value made on
    worker1 from the caller's leaf; the caller's gradient is <v, x * x>'s, 2 * v * x, and a
    second backward after retain_graph=True adds it again) and from an owner RRef (a value
    computed here from an RPC result). With no context an owner RRef runs torch's local
    backward (.grad); a user RRef is refused in torch's words and nothing runs, as is a value
    that is not a tensor, and a context the owner never saw is unknown there."""
    x = support.leaf(6, 5)
    v = support.cotangent(9, x)
    want = 2 * v * x.detach()
    with dgrpc.context() as cid:
        rref = dgrpc.remote("worker1", F.weighted_squared_sum, args=(x, v))
        rref.backward(cid, retain_graph=True, mode=mode)
        rref.backward(cid, mode=mode)
        H.assert_close(dgrpc.get_gradients(cid)[x], 2 * want, f"{mode}: user RRef, twice")
    with dgrpc.context() as cid:
        own = dgrpc.RRef(dgrpc.rpc_sync("worker1", F.weighted_squared_sum, args=(x, v)))
        own.backward(cid, mode=mode)
        H.assert_close(dgrpc.get_gradients(cid)[x], want, f"{mode}: owner RRef")
    got = H.query("worker2", F.owner_rref_local_backward)
    H.assert_close(got, torch.full((3,), 3.0, dtype=torch.float64), f"{mode}: local backward")
    user = dgrpc.remote("worker2", F.local_leaf_sum)
    with pytest.raises(RuntimeError, match=r"^User RRefs require 'dist_autograd_ctx_id' to be"):
        user.backward()
    assert H.query("worker2", F.leaf_grad_under, user.torch_rref) is None
    text = dgrpc.remote("worker1", str, args=("foo",))
    with dgrpc.context() as cid:
        for not_a_tensor in (text, dgrpc.RRef("foo")):
            with pytest.raises(RuntimeError, match=r"RRef should contain a tensor for \.backward"):
                not_a_tensor.backward(cid, mode=mode)
        with pytest.raises(
            UnknownContextError, match=f"Could not find autograd context with id: {cid}"
        ):
            user.backward(cid, mode=mode)  # made outside the context, which worker2 never saw


def _remote_module(mode: str) -> None:
    """[torch's RemoteModule tests, the parts distgrad offers] forward and forward_async run
    on the module's worker, recorded; its parameters get local autograd's gradients."""
    layer = dgrpc.RemoteModule("worker1/cpu", F.seeded_linear, args=(9,))
    x = support.leaf(7, 3, 4)
    v = support.cotangent(8, torch.empty(3, 2, dtype=torch.float64))
    with dgrpc.context() as cid:
        y = layer(x) + layer.forward_async(x).wait()
        dgrpc.backward(cid, [(y * v).sum()], mode=mode)  # type: ignore[arg-type]
        got = H.query("worker1", F.module_grads, cid, layer.get_module_rref().torch_rref)
        got_x = dgrpc.get_gradients(cid)[x]
    local = F.seeded_linear(9)
    xx = x.detach().requires_grad_()
    want = torch.autograd.grad((2 * local(xx) * v).sum(), [*local.parameters(), xx])
    for i, (g, w) in enumerate(zip([*got, got_x], want, strict=True)):
        H.assert_close(g, w, f"{mode}: RemoteModule gradient {i}")
    params = layer.remote_parameters()
    assert len(params) == 2 and all(p.owner_name() == "worker1" for p in params)
    _remote_module_as_torch(layer)


class BadModule:
    """[torch's test_bad_module] module_cls returning something other than a Module."""

    def __init__(self, first_arg: int, first_kwarg: int = -1) -> None:
        pass


def _training(rref: torch_rpc.RRef[torch.nn.Module]) -> bool:
    return rref.local_value().training


def _remote_module_as_torch(layer: dgrpc.RemoteModule) -> None:
    """torch's RemoteModule behaviours, in torch's words: [test_train_eval] train() and eval()
    set the remote module's mode; [test_create_remote_module_from_module_rref] a RemoteModule
    from another's module RRef runs the same module; [test_remote_module_py_pickle_not_
    supported] torch.save refuses it; [test_bad_module] a module_cls that makes no Module."""
    rref = layer.get_module_rref().torch_rref
    assert layer.eval() is layer and not layer.training
    assert not torch_rpc.rpc_sync("worker1", _training, (rref,))
    layer.train()
    assert layer.training and torch_rpc.rpc_sync("worker1", _training, (rref,))
    again = dgrpc.RemoteModule.init_from_module_rref("worker1/cpu", layer.get_module_rref())
    x = torch.ones(2, 4, dtype=torch.float64)
    assert torch.equal(again(x), layer(x))
    with pytest.raises(RuntimeError, match="Cannot pickle RemoteModule in python pickler"):
        torch.save(layer, io.BytesIO())
    bad = dgrpc.RemoteModule("worker1/cpu", BadModule, (1,), {"first_kwarg": 2})  # type: ignore[arg-type]
    with pytest.raises(
        ValueError,
        match=r"Expect `module_cls\(\*args, \*\*kwargs\)` returns an instance of "
        r"<class nn.Module>,",
    ):
        bad.forward()


def test_torchs_other_rpc_names_work_from_distgrad_rpc() -> None:
    run_on_ranks(_names, 3, init="rpc")
