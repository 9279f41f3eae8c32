"""DistributedDataParallel inside a context: the context holds DDP's averaged gradients, as
torch's engine does; what cannot be made right raises before the first step.

torch's tutorial pattern: worker0 is a parameter server (an EmbeddingBag used through RPC);
workers 1 and 2 are trainers, each a DDP-wrapped head over a gloo group of the two trainers.
Each step runs once under torch's dist autograd and once under distgrad's, in the same
processes, with DDP modules made alike; every gradient in both contexts must be equal bit for
bit (the trainers' heads and the server's table), on every step and every DDP option.
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
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.nn.parallel import DistributedDataParallel as DDP

import distgrad.rpc as dgrpc
from distgrad.errors import RpcAutogradError
from distgrad.testing import run_on_ranks
from tests._support import seeded
from tests.rpc import _funcs as F
from tests.rpc import _helpers as H

OPTIONS: dict[str, dict[str, Any]] = {
    "default": {},
    "small buckets": {"bucket_cap_mb": 1e-5},
    "find_unused_parameters": {"find_unused_parameters": True},
    "find_unused_parameters, unused": {"find_unused_parameters": True, "unused": True},
    "gradient_as_bucket_view": {"gradient_as_bucket_view": True},
    "static_graph": {"static_graph": True},
    "comm hook": {"comm_hook": default_hooks.fp16_compress_hook},
    "no_sync": {"no_sync": True},
    "RPC inside the module": {"rpc_inside": True},
}


class _Head(nn.Module):
    """Two layers on the looked-up rows, and ``spare``; with ``rpc`` set, the hidden layer
    goes through worker0 and back between them (the module's own forward makes an RPC)."""

    def __init__(self, rpc: Any = None) -> None:
        super().__init__()
        self.rpc = rpc
        g = seeded(3)
        self.fc1 = nn.Linear(4, 8)
        self.fc2 = nn.Linear(8, 3)
        self.spare = nn.Linear(8, 3)
        with torch.no_grad():
            for p in self.parameters():
                p.copy_(torch.randn(p.shape, generator=g))

    def forward(self, x: torch.Tensor, use_spare: bool) -> torch.Tensor:
        h = torch.relu(self.fc1(x))
        if self.rpc is not None:
            h = self.rpc.rpc_sync("worker0", torch.tanh, args=(h,))
        return self.fc2(h) + (self.spare(h) if use_spare else 0)


def _wrap(options: dict[str, Any], group: Any, mode: str | None) -> DDP:
    ours = ("comm_hook", "no_sync", "unused", "rpc_inside")
    kwargs = {k: v for k, v in options.items() if k not in ours}
    rpc = (torch_rpc if mode is None else dgrpc) if options.get("rpc_inside") else None
    ddp = DDP(_Head(rpc), process_group=group, **kwargs)
    if "comm_hook" in options:
        ddp.register_comm_hook(group, options["comm_hook"])
    return ddp


def _step(
    mode: str | None, ddp: DDP, rank: int, step: int, options: dict[str, Any]
) -> dict[str, Any]:
    """One step of the trainer under torch's engine (``mode`` None) or distgrad's; returns the
    head's gradients in the context, the server's, and whether .grad stayed untouched."""
    engine: Any = torch_autograd if mode is None else dgrpc
    rpc: Any = torch_rpc if mode is None else dgrpc
    g = seeded(100 * rank + step)
    indices = torch.randint(0, 16, (6,), generator=g)
    offsets = torch.tensor([0, 2, 4])
    cot = torch.randn(3, 3, generator=g)
    # "unused": trainer 1 uses spare, trainer 2 does not (DDP averages it all the same)
    use_spare = rank == 1 or not options.get("unused", False)
    # a .grad the user has (from a local step) must end as under torch's engine: unchanged,
    # except that with gradient_as_bucket_view DDP's forward moves it into a bucket, which
    # the reduction then writes (under torch's engine too)
    ddp.module.fc1.bias.grad = torch.full_like(ddp.module.fc1.bias, 7.0)
    if mode == "local":
        ddp.module.fc1.bias.grad = None  # DDP without RPC: the rows as plain inputs, DDP's .grad
        rows = torch_rpc.rpc_sync("worker0", F.ps_lookup, args=(indices, offsets)).detach()
        (ddp(rows, use_spare) * cot).sum().backward()
        head = {name: p.grad for name, p in ddp.module.named_parameters()}
        ddp.zero_grad(set_to_none=True)
        return {"head": head, "table": None, "kept": None}
    with engine.context() as cid:
        rows = rpc.rpc_sync("worker0", F.ps_lookup, args=(indices, offsets))
        loss = (ddp(rows, use_spare) * cot).sum()
        if mode is None:
            engine.backward(cid, [loss])
        else:
            engine.backward(cid, [loss], mode=mode)
        got = engine.get_gradients(cid)
        head = {name: got.get(p) for name, p in ddp.module.named_parameters()}
        table = H.query("worker0", F.ps_table_grad, cid, mode is None)
    grads = [p.grad for name, p in ddp.module.named_parameters() if name != "fc1.bias"]
    kept = ddp.module.fc1.bias.grad
    assert kept is not None and all(g is None for g in grads), f"{mode}: .grad written"
    ddp.module.fc1.bias.grad = None
    return {"head": head, "table": table, "kept": kept.clone()}


def _trainers(rank: int, world_size: int, store_dir: str, name: str) -> None:
    if rank == 0:
        return
    options = OPTIONS[name]
    store = dist.FileStore(str(Path(store_dir) / "ddp"), 2)  # type: ignore[attr-defined]
    dist.init_process_group("gloo", store=store, rank=rank - 1, world_size=2)
    try:
        group = dist.group.WORLD
        # torch's engine, then distgrad's. torch's engine fails an internal assert ("The grad
        # for the variable should exist in dist_autograd context") when a parameter is unused
        # on one trainer, so there DDP's own .grad, without RPC, is the reference.
        reference = "local" if options.get("unused") else None
        modes: list[str | None] = [reference, *H.MODES]
        modules = [_wrap(options, group, mode) for mode in modes]
        for step in range(3):
            steps = []
            for mode, ddp in zip(modes, modules, strict=True):
                if options.get("no_sync") and step == 0:
                    with ddp.no_sync():
                        steps.append(_step(mode, ddp, rank, step, options))
                else:
                    steps.append(_step(mode, ddp, rank, step, options))
            want = steps[0]
            for mode, got in zip(H.MODES, steps[1:], strict=True):
                what = f"{name}, {mode}, step {step}"
                if reference is None:  # a .grad set before the step ends as under torch
                    H.assert_equal(got["kept"], want["kept"], f"{what}: fc1.bias.grad")
                for key in want["head"]:
                    H.assert_equal(got["head"][key], want["head"][key], f"{what}: {key}")
                if reference is None:
                    H.assert_equal(got["table"], want["table"], f"{what}: server table")
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("name", list(OPTIONS))
def test_ddp_gradients_in_the_context_are_torchs_averaged_ones(name: str, tmp_path: Path) -> None:
    """Three steps, FAST and SMART against torch's engine, bit for bit. (With an RPC inside
    the module, DDP's reduction spans two engine calls on each trainer.)"""
    run_on_ranks(_trainers, 3, args=(str(tmp_path), name), init="rpc", timeout=90)


def _refusals(rank: int, world_size: int, store_dir: str) -> None:
    if rank == 0:
        return
    store = dist.FileStore(str(Path(store_dir) / "ddp"), 2)  # type: ignore[attr-defined]
    dist.init_process_group("gloo", store=store, rank=rank - 1, world_size=2)
    try:
        ddp = _wrap({}, dist.group.WORLD, "fast")
        rows = torch.randn(3, 4, generator=seeded(rank))
        for mode in H.MODES:
            # a second backward over one forward: DDP reduces once per forward
            with dgrpc.context() as cid:
                loss = ddp(rows, True).sum()
                dgrpc.backward(cid, [loss], retain_graph=True, mode=mode)
                with pytest.raises(RpcAutogradError, match="again after DDP had averaged"):
                    dgrpc.backward(cid, [loss], mode=mode)
        # FAST: the output reaches the loss both locally and through RPC, so the module's
        # graph runs in two engine calls; refused in the second, before any optimizer step
        with dgrpc.context() as cid:
            out = ddp(rows, True)
            back = dgrpc.rpc_sync("worker0", torch.mul, args=(out, 2.0))
            with pytest.raises(RpcAutogradError, match="again after DDP had averaged"):
                dgrpc.backward(cid, [(out + back).sum()], mode="fast")
    finally:
        dist.destroy_process_group()


def test_what_ddp_cannot_do_in_a_context_raises_in_backward(tmp_path: Path) -> None:
    """A second backward over one DDP forward, and (FAST) a DDP output that reaches the loss
    both locally and through RPC, raise a clear error instead of leaving wrong gradients."""
    run_on_ranks(_refusals, 3, args=(str(tmp_path),), init="rpc", timeout=90)
