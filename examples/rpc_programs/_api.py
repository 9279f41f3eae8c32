"""The one switch: torch's RPC modules, or distgrad's in their place."""

from __future__ import annotations

import contextlib
import functools
import os
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

import torch


@dataclass
class Api:
    """What a program imports: ``rpc``, ``dist_autograd`` and ``DistributedOptimizer``."""

    rpc: Any
    dist_autograd: Any
    DistributedOptimizer: Any


def api(name: str) -> Api:
    """``"torch"``: ``torch.distributed.rpc`` / ``.autograd`` / ``.optim``; ``"fast"`` and
    ``"smart"``: ``distgrad.rpc`` for all three (SMART: ``backward(..., mode="smart")``)."""
    if name == "torch":
        import torch.distributed.autograd as dist_autograd
        import torch.distributed.rpc as rpc
        from torch.distributed.optim import DistributedOptimizer

        return Api(rpc, dist_autograd, DistributedOptimizer)
    import distgrad.rpc as dgrpc

    if name == "fast":
        return Api(dgrpc, dgrpc, dgrpc.DistributedOptimizer)
    if name == "smart":
        smart = SimpleNamespace(
            context=dgrpc.context,
            get_gradients=dgrpc.get_gradients,
            backward=functools.partial(dgrpc.backward, mode="smart"),
        )
        return Api(dgrpc, smart, dgrpc.DistributedOptimizer)
    raise ValueError(f"api must be 'torch', 'fast' or 'smart', got {name!r}")


def join(api: Api, rank: int, world_size: int, folder: str, threads: int = 16) -> None:
    """``init_rpc`` as a program calls it, with torch's options object (both accept it)."""
    torch.set_num_threads(1)  # before the first op: one intra-op thread per process
    options = api.rpc.TensorPipeRpcBackendOptions(
        init_method=f"file://{os.path.join(folder, 'rpc')}",
        rpc_timeout=30,
        num_worker_threads=threads,
    )
    api.rpc.init_rpc(f"worker{rank}", rank=rank, world_size=world_size, rpc_backend_options=options)


@dataclass
class Result:
    """What one rank computed: ``steps[i]`` holds step i's values (tensors, floats), and
    ``times[i]`` the wall time of its training step in seconds."""

    steps: list[dict[str, Any]] = field(default_factory=list)
    times: list[float] = field(default_factory=list)

    @contextlib.contextmanager
    def timed(self) -> Iterator[None]:
        start = time.perf_counter()
        yield
        self.times.append(time.perf_counter() - start)

    def record(self, **values: Any) -> None:
        self.steps.append({k: _detached(v) for k, v in values.items()})


def _detached(v: Any) -> Any:
    if isinstance(v, torch.Tensor):
        return v.detach().clone()
    if isinstance(v, list | tuple):
        return [_detached(x) for x in v]
    return v
