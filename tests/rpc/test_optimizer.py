"""DistributedOptimizer gives exactly the local optimizer's result, in both backward modes.

The cases of torch 2.13's ``dist_optimizer_test.py`` (a module on each of two other workers,
nine optimizers, a parameter without gradient, failing optimizers), rewritten, plus several
steps with an unused parameter, and a sparse EmbeddingBag parameter server.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

import distgrad.rpc as dgrpc
from distgrad.errors import RpcAutogradError
from distgrad.testing import run_on_ranks
from tests import _support as support
from tests.rpc import _funcs as F
from tests.rpc import _helpers as H

TORCH_CASES: list[tuple[type[torch.optim.Optimizer], dict[str, Any]]] = [
    (torch.optim.Adagrad, {"lr": 0.05}),
    (torch.optim.Adam, {"lr": 1e-2, "amsgrad": True}),
    (torch.optim.AdamW, {"lr": 0.05, "amsgrad": True}),
    (torch.optim.SGD, {"lr": 0.05}),
    (torch.optim.SGD, {"lr": 1e-3, "momentum": 1, "weight_decay": 1, "nesterov": True}),
    (torch.optim.Adadelta, {"rho": 0.95}),
    (torch.optim.RMSprop, {"lr": 0.05}),
    (torch.optim.Adamax, {"lr": 0.05}),
    (torch.optim.Rprop, {"lr": 0.05}),
]

STEPPED_CASES: list[tuple[type[torch.optim.Optimizer], dict[str, Any]]] = [
    (torch.optim.SGD, {"lr": 0.1, "momentum": 0.9}),
    (torch.optim.Adam, {"lr": 0.05}),
]


def _remote_param(owner: str, requires_grad: bool = True) -> tuple[Any, Any]:
    module = dgrpc.remote(owner, F.ThreeByThree, args=(requires_grad,))
    return module, dgrpc.remote(owner, F.call_method, args=(F.ThreeByThree.get_w, module))


def _torch_case(cls: type[torch.optim.Optimizer], kwargs: dict[str, Any], mode: str) -> None:
    """[test_dist_optim, test_dist_optim_none_grads]: two modules on two other workers."""
    for second_requires_grad in (True, False):
        local1, local2 = F.ThreeByThree(), F.ThreeByThree(second_requires_grad)
        params = [p for p in (local1.w, local2.w) if p.requires_grad]
        local_optim = cls(params, **kwargs)
        g = support.seeded(0)
        t1 = torch.rand((3, 3), requires_grad=True, generator=g)
        t2 = torch.rand((3, 3), requires_grad=True, generator=g)
        torch.add(local2.forward(local1.forward(t2)), t1).sum().backward()
        local_optim.step()

        module1, w1 = _remote_param("worker1")
        module2, w2 = _remote_param("worker2", second_requires_grad)
        old2 = w2.to_here().clone()
        refs = [w1, w2] if second_requires_grad else [w1]
        optim = dgrpc.DistributedOptimizer(cls, refs, **kwargs)
        with dgrpc.context() as cid:
            g.manual_seed(0)
            t1 = torch.rand((3, 3), requires_grad=True, generator=g)
            t2 = torch.rand((3, 3), requires_grad=True, generator=g)
            method = F.ThreeByThree.forward
            out1 = dgrpc.rpc_async("worker1", F.call_method, args=(method, module1, t2))
            out2 = dgrpc.rpc_async("worker2", F.call_method, args=(method, module2, out1.wait()))
            dgrpc.backward(cid, [torch.add(out2.wait(), t1).sum()], mode=mode)  # type: ignore[arg-type]
            optim.step(cid)
        what = f"{cls.__name__} {kwargs}, {mode}, w2 requires grad: {second_requires_grad}"
        torch.testing.assert_close(w1.to_here(), local1.w, msg=lambda m, s=what: f"{s}: {m}")
        torch.testing.assert_close(w2.to_here(), local2.w, msg=lambda m, s=what: f"{s}: {m}")
        if not second_requires_grad:
            assert torch.equal(w2.to_here(), old2), what


def _several_steps(cls: type[torch.optim.Optimizer], kwargs: dict[str, Any], mode: str) -> None:
    """Three steps; a local parameter that gets no gradient stays untouched."""
    x, v = support.leaf(10, 4, 3, requires_grad=False), support.leaf(11, 4, 2, requires_grad=False)
    p_remote, w_local, unused = support.leaf(1, 3, 5), support.leaf(2, 5, 2), support.leaf(3, 2)
    ref_opt = cls([p_remote, w_local, unused], **kwargs)
    for _ in range(3):
        ref_opt.zero_grad()
        (((torch.tanh(x @ p_remote)) @ w_local) * v).sum().backward()
        ref_opt.step()
    name = f"p_{cls.__name__}_{mode}"
    rref = dgrpc.rpc_sync("worker1", F.make_param, args=(name, 1, (3, 5)))
    w, u = support.leaf(2, 5, 2), support.leaf(3, 2)
    u0 = u.detach().clone()
    opt = dgrpc.DistributedOptimizer(cls, [rref, dgrpc.RRef(w), dgrpc.RRef(u)], **kwargs)
    for _ in range(3):
        with dgrpc.context() as cid:
            hidden = dgrpc.rpc_sync("worker1", F.apply_param, args=(rref, x))
            dgrpc.backward(cid, [((hidden @ w) * v).sum()], mode=mode)  # type: ignore[arg-type]
            opt.step(cid)
    torch.testing.assert_close(rref.to_here(), p_remote, msg=lambda m: f"{name}: {m}")
    torch.testing.assert_close(w, w_local, msg=lambda m: f"{name}: {m}")
    assert torch.equal(u, u0), f"{name}: a parameter without gradient changed"
    assert w.grad is None and u.grad is None


def _sparse_parameter_server(cls: type[torch.optim.Optimizer], mode: str) -> None:
    """An EmbeddingBag(sparse=True) on worker1 trained from here: the sparse gradients reach
    its owner and its optimizer as a local training loop's would."""
    inputs, offsets = torch.tensor([1, 2, 4, 5, 4, 3, 2, 9]), torch.tensor([0, 4])
    target = support.leaf(12, 2, 4, requires_grad=False).float()
    local = F.embedding_bag(0)
    local_opt = cls(local.parameters(), lr=0.1)
    for _ in range(3):
        local_opt.zero_grad()
        ((local(inputs, offsets) - target) ** 2).sum().backward()
        local_opt.step()
    bag = dgrpc.remote("worker1", F.embedding_bag, args=(0,))
    opt = dgrpc.DistributedOptimizer(
        cls, dgrpc.rpc_sync("worker1", F.bag_parameters, args=(bag,)), lr=0.1
    )
    weights = torch.ones(8)
    for _ in range(3):
        with dgrpc.context() as cid:
            out = dgrpc.rpc_sync(
                "worker1", F.embedding_forward, args=(bag, inputs, offsets, weights)
            )
            dgrpc.backward(cid, [((out - target) ** 2).sum()], mode=mode)  # type: ignore[arg-type]
            opt.step(cid)
    got = dgrpc.rpc_sync("worker1", F.bag_weight, args=(bag,))
    torch.testing.assert_close(got, local.weight.detach(), msg=lambda m: f"{cls.__name__}: {m}")


def _optimizers(rank: int, world_size: int) -> None:
    if rank != 0:
        return
    for mode in H.MODES:
        for cls, kwargs in TORCH_CASES:
            _torch_case(cls, kwargs, mode)
        for cls, kwargs in (
            (torch.optim.SGD, {"lr": 0.1, "momentum": 0.9}),
            (torch.optim.Adam, {"lr": 0.05}),
        ):
            _several_steps(cls, kwargs, mode)
        for cls in (torch.optim.SGD, torch.optim.Adagrad):
            _sparse_parameter_server(cls, mode)
    _failures()


def _failures() -> None:
    """[test_dist_optim_exception, ..._on_constructor]: the caller gets the owners' errors."""
    _, w1 = _remote_param("worker1")
    _, w2 = _remote_param("worker2")
    optim = dgrpc.DistributedOptimizer(F.FailingOptimizer, [w1, w2])
    module, _ = _remote_param("worker1")
    forward = F.ThreeByThree.forward
    with dgrpc.context() as cid:
        out = dgrpc.rpc_sync("worker1", F.call_method, args=(forward, module, torch.ones(3, 3)))
        dgrpc.backward(cid, [out.sum()])
        with pytest.raises(RpcAutogradError, match=r"step failed on worker1: ValueError.*running"):
            optim.step(cid)
    with pytest.raises(RpcAutogradError, match="Error creating optimizer"):
        dgrpc.DistributedOptimizer(F.OptimizerFailingOnConstructor, [w1, w2])


def test_distributed_optimizer_equals_the_local_optimizer() -> None:
    """torch's nine optimizer cases with and without a gradient-less parameter, three steps of
    two optimizers, a sparse parameter server with SGD and Adagrad; in both modes."""
    run_on_ranks(_optimizers, 3, init="rpc", timeout=90)
