"""DistributedOptimizer gives exactly the local optimizer's result."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import Tensor

import distgrad.rpc as dgrpc
from distgrad.errors import RpcAutogradError
from distgrad.testing import run_on_ranks
from tests.rpc import _funcs as F

OPTIMIZERS: list[tuple[type[torch.optim.Optimizer], dict[str, Any]]] = [
    (torch.optim.SGD, {"lr": 0.1, "momentum": 0.9}),
    (torch.optim.Adam, {"lr": 0.05}),
    (torch.optim.AdamW, {"lr": 0.05, "weight_decay": 0.1}),
    (torch.optim.Adagrad, {"lr": 0.1}),
    (torch.optim.RMSprop, {"lr": 0.01}),
]


def _init(seed: int, *shape: int) -> Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, dtype=torch.float64, generator=g, requires_grad=True)


def _loss(x: Tensor, hidden: Tensor, w_local: Tensor, v: Tensor) -> Tensor:
    return ((hidden @ w_local) * v).sum() + (x * 0).sum()


def _optimizers(rank: int, world_size: int) -> None:
    if rank != 0:
        return
    x = _init(10, 4, 3).detach()
    v = _init(11, 4, 2).detach()
    for i, (cls, kwargs) in enumerate(OPTIMIZERS):
        # Reference: one process, the same parameters and steps.
        p_remote, w_local, unused = _init(1, 3, 5), _init(2, 5, 2), _init(3, 2)
        ref_opt = cls([p_remote, w_local, unused], **kwargs)
        for _ in range(3):
            ref_opt.zero_grad()
            _loss(x, torch.tanh(x @ p_remote), w_local, v).backward()
            ref_opt.step()
        # Distributed: p on worker1, w and an unused parameter here.
        rref = dgrpc.rpc_sync("worker1", F.make_param, args=(f"p{i}", 1, (3, 5)))
        w, u = _init(2, 5, 2), _init(3, 2)
        u0 = u.detach().clone()
        opt = dgrpc.DistributedOptimizer(cls, [rref, dgrpc.RRef(w), dgrpc.RRef(u)], **kwargs)
        for _ in range(3):
            with dgrpc.context() as cid:
                hidden = dgrpc.rpc_sync("worker1", F.apply_param, args=(rref, x))
                dgrpc.backward(cid, [_loss(x, hidden, w, v)])
                opt.step(cid)
        name = cls.__name__
        torch.testing.assert_close(rref.to_here(), p_remote, msg=lambda m, n=name: f"{n}: {m}")
        torch.testing.assert_close(w, w_local, msg=lambda m, n=name: f"{n}: {m}")
        assert torch.equal(u, u0), f"{name} changed a parameter that had no gradient"
        assert w.grad is None and u.grad is None

    # A remote optimizer's exception reaches the caller, naming the worker.
    rref = dgrpc.rpc_sync("worker1", F.make_param, args=("bad", 1, (3, 5)))
    opt = dgrpc.DistributedOptimizer(F.FailingSGD, [rref], lr=0.1)
    with dgrpc.context() as cid:
        hidden = dgrpc.rpc_sync("worker1", F.apply_param, args=(rref, x))
        dgrpc.backward(cid, [hidden.sum()])
        with pytest.raises(RpcAutogradError, match=r"step failed on worker1: .*always fails"):
            opt.step(cid)


def test_distributed_optimizer_equals_the_local_optimizer() -> None:
    """SGD with momentum, Adam, AdamW, Adagrad, RMSprop; three steps; one parameter unused."""
    run_on_ranks(_optimizers, 2, init="rpc")
