"""FSDP2 (``fully_shard``) inside a context: the context holds FSDP2's reduce-scattered,
sharded gradients, keyed by the module's own (sharded) parameters; what cannot be made right
raises in backward, before any optimizer step.

torch's tutorial pattern with FSDP2 instead of DDP: worker0 is a parameter server (an
EmbeddingBag used through RPC); workers 1 and 2 are trainers, each an FSDP2 head (its first
layer and the whole head each ``fully_shard``-ed) over a gloo group of the two trainers.

The reference is FSDP2 without RPC (the same rows as plain inputs, a local backward, the
sharded ``.grad``): that is the gradient FSDP2 promises, and distgrad's context must hold it bit
for bit, in both modes, at every step of a training loop (``DistributedOptimizer`` against a
local SGD on the same values). torch's dist autograd stores instead the local gradients of
FSDP2's unsharded parameters, which no user code can reach: the test states that too, and takes
from torch's engine the server's gradient, which FSDP2 does not change.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.distributed.autograd as torch_autograd
from torch import nn
from torch.distributed import rpc as torch_rpc
from torch.distributed.fsdp import fully_shard

import distgrad.rpc as dgrpc
from distgrad.errors import RpcAutogradError
from distgrad.testing import run_on_ranks
from tests._support import seeded
from tests.rpc import _funcs as F
from tests.rpc import _helpers as H


class _Head(nn.Module):
    """Two layers on the looked-up rows; with ``rpc`` set, the hidden layer goes through
    worker0 and back between them (the module's own forward makes an RPC)."""

    def __init__(self, rpc: Any = None) -> None:
        super().__init__()
        self.rpc = rpc
        g = seeded(3)
        self.fc1 = nn.Linear(4, 8)
        self.fc2 = nn.Linear(8, 3)
        with torch.no_grad():
            for p in self.parameters():
                p.copy_(torch.randn(p.shape, generator=g))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.fc1(x))
        if self.rpc is not None:
            h = self.rpc.rpc_sync("worker0", torch.tanh, args=(h,))
        return self.fc2(h)  # type: ignore[no-any-return]


def _sharded(rpc: Any = None) -> nn.Module:
    head = _Head(rpc)
    fully_shard(head.fc1)
    fully_shard(head)
    return head


def _inputs(rank: int, step: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = seeded(100 * rank + step)
    indices = torch.randint(0, 16, (6,), generator=g)
    return indices, torch.tensor([0, 2, 4]), torch.randn(3, 3, generator=g)


def _local_step(head: nn.Module, opt: torch.optim.Optimizer, rank: int, step: int) -> Any:
    """FSDP2 without RPC: the reference gradients (sharded ``.grad``), then an SGD step."""
    indices, offsets, cot = _inputs(rank, step)
    rows = torch_rpc.rpc_sync("worker0", F.ps_lookup, args=(indices, offsets))
    (head(rows.detach().requires_grad_()) * cot).sum().backward()
    grads = {n: p.grad.full_tensor().clone() for n, p in head.named_parameters()}
    opt.step()
    opt.zero_grad(set_to_none=True)
    return grads


def _dist_step(mode: str | None, head: nn.Module, opt: Any, rank: int, step: int) -> Any:
    """One step under torch's engine (``mode`` None) or distgrad's: the head's gradients in
    the context (full tensors), the server's, and every ``.grad`` as it was before."""
    engine: Any = torch_autograd if mode is None else dgrpc
    rpc: Any = torch_rpc if mode is None else dgrpc
    indices, offsets, cot = _inputs(rank, step)
    before = {n: torch.full_like(p, 7.0) for n, p in head.named_parameters()}
    for n, p in head.named_parameters():  # a .grad the user has must stay as it was
        p.grad = before[n].clone()
    with engine.context() as cid:
        rows = rpc.rpc_sync("worker0", F.ps_lookup, args=(indices, offsets))
        loss = (head(rows) * cot).sum()
        if mode is None:
            engine.backward(cid, [loss])
        else:
            engine.backward(cid, [loss], mode=mode)
        got = engine.get_gradients(cid)
        grads = {n: got.get(p) for n, p in head.named_parameters()}
        table = H.query("worker0", F.ps_table_grad, cid, mode is None)
        if opt is not None:
            opt.step(cid)
    for n, p in head.named_parameters():
        H.assert_equal(p.grad.full_tensor(), before[n].full_tensor(), f"{mode}: {n}.grad")
        p.grad = None
    if mode is None:  # torch: only the unsharded parameters' local gradients, out of reach
        assert all(g is None for g in grads.values()), f"torch's context: {grads}"
        assert len(got) == len(grads), f"torch's context holds {len(got)} gradients"
        return {"head": None, "table": table}
    full = {n: None if g is None else g.full_tensor() for n, g in grads.items()}
    return {"head": full, "table": table}


def _trainers(rank: int, world_size: int, store_dir: str) -> None:
    if rank == 0:
        return
    store = dist.FileStore(str(Path(store_dir) / "fsdp"), 2)  # type: ignore[attr-defined]
    dist.init_process_group("gloo", store=store, rank=rank - 1, world_size=2)
    try:
        local = _sharded()
        local_opt = torch.optim.SGD(local.parameters(), lr=0.1)
        torchs = _sharded()
        heads = {mode: _sharded() for mode in H.MODES}
        opts = {
            mode: dgrpc.DistributedOptimizer(
                torch.optim.SGD, [dgrpc.RRef(p) for p in head.parameters()], lr=0.1
            )
            for mode, head in heads.items()
        }
        for step in range(3):
            with torch.no_grad():  # torch's engine steps nothing: give it the same values
                for p, q in zip(torchs.parameters(), local.parameters(), strict=True):
                    p.copy_(q)
            want_table = _dist_step(None, torchs, None, rank, step)["table"]
            want = _local_step(local, local_opt, rank, step)
            for mode in H.MODES:
                got = _dist_step(mode, heads[mode], opts[mode], rank, step)
                what = f"{mode}, step {step}"
                for name in want:
                    H.assert_equal(got["head"][name], want[name], f"{what}: {name}")
                H.assert_equal(got["table"], want_table, f"{what}: server table")
                for (name, p), q in zip(
                    heads[mode].named_parameters(), local.parameters(), strict=True
                ):
                    H.assert_equal(p.full_tensor(), q.full_tensor(), f"{what}: {name} stepped")
    finally:
        dist.destroy_process_group()


def test_fsdp2_gradients_in_the_context_are_its_reduce_scattered_ones(tmp_path: Path) -> None:
    """Three training steps, FAST and SMART, each gradient in the context equal bit for bit to
    FSDP2's own without RPC (sharded, averaged over the two trainers) and the server's to
    torch's engine's; ``.grad`` untouched; DistributedOptimizer steps as a local SGD."""
    run_on_ranks(_trainers, 3, args=(str(tmp_path),), init="rpc", timeout=90)


def _refusals(rank: int, world_size: int, store_dir: str) -> None:
    if rank == 0:
        return
    store = dist.FileStore(str(Path(store_dir) / "fsdp"), 2)  # type: ignore[attr-defined]
    dist.init_process_group("gloo", store=store, rank=rank - 1, world_size=2)
    try:
        rows = torch.randn(3, 4, generator=seeded(rank))
        again = "again after FSDP2 had reduce-scattered"
        for mode in H.MODES:
            # the module's own forward makes an RPC: FSDP2 reduces at the end of the engine
            # call reaching its outer layer, before the gradient reaches fc1 through worker0
            head = _sharded(dgrpc)
            with dgrpc.context() as cid, pytest.raises(RpcAutogradError, match=again):
                dgrpc.backward(cid, [head(rows).sum()], mode=mode)
            head = _sharded()
            with dgrpc.context() as cid:  # a second backward over one forward
                loss = head(rows).sum()
                dgrpc.backward(cid, [loss], retain_graph=True, mode=mode)
                with pytest.raises(RpcAutogradError, match=again):
                    dgrpc.backward(cid, [loss], mode=mode)
        head = _sharded()
        with dgrpc.context() as cid:  # FAST: the output reaches the loss twice
            out = head(rows)
            back = dgrpc.rpc_sync("worker0", torch.mul, args=(out, 2.0))
            with pytest.raises(RpcAutogradError, match=again):
                dgrpc.backward(cid, [(out + back).sum()], mode="fast")
        head.set_requires_gradient_sync(False)  # type: ignore[operator]
        with dgrpc.context(), pytest.raises(RpcAutogradError, match="gradient_sync"):
            head(rows)
    finally:
        dist.destroy_process_group()


def test_what_fsdp2_cannot_do_in_a_context_raises(tmp_path: Path) -> None:
    """A module whose forward makes RPCs, a second backward over one forward, and (FAST) an
    output that reaches the loss both locally and through RPC raise in backward;
    ``set_requires_gradient_sync(False)`` raises at the forward. Never a wrong gradient."""
    run_on_ranks(_refusals, 3, args=(str(tmp_path),), init="rpc", timeout=90)
