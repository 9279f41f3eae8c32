"""Distributed autograd over RPC: contexts, recorded sends and recvs, a distributed backward.

Usage::

    import distgrad.rpc as dgrpc

    with dgrpc.context() as context_id:
        y = dgrpc.rpc_sync("worker1", torch.add, args=(a, b))
        loss = (y * w).sum()
        dgrpc.backward(context_id, [loss])        # or mode="smart"
        grads = dgrpc.get_gradients(context_id)   # {a: da, b: db, w: dw}; .grad untouched

The engine is distgrad's own, in Python: ``torch.autograd`` runs each worker's local part and
``torch.distributed.rpc`` (TensorPipe) carries the messages. See docs/rpc.md.
"""

from __future__ import annotations

from typing import Any

from torch._C._distributed_rpc import WorkerInfo
from torch.distributed.rpc import BackendType, TensorPipeRpcBackendOptions, get_worker_info

from distgrad.rpc import functions
from distgrad.rpc._lifecycle import init_rpc, shutdown
from distgrad.rpc.backward import backward
from distgrad.rpc.calls import RRef, remote, rpc_async, rpc_sync
from distgrad.rpc.optimizer import DistributedOptimizer
from distgrad.rpc.remote_module import RemoteModule
from distgrad.rpc.scope import (
    DistAutogradContext,
    context,
    current_context_id,
    debug_state,
    get_gradients,
)

__all__ = [
    "BackendType",
    "DistAutogradContext",
    "DistributedOptimizer",
    "RRef",
    "RemoteModule",
    "TensorPipeRpcBackendOptions",
    "WorkerInfo",
    "backward",
    "context",
    "current_context_id",
    "debug_state",
    "functions",
    "get_gradients",
    "get_worker_info",
    "init_rpc",
    "remote",
    "rpc_async",
    "rpc_sync",
    "shutdown",
]

# Names of torch.distributed.rpc (and its neighbours) that distgrad does not offer, with what
# to use instead: a porting program gets this instead of a bare AttributeError.
_NOT_OFFERED = {
    "PyRRef": (
        "distgrad.rpc does not offer PyRRef (torch's internal RRef type): use distgrad.rpc.RRef, "
        "whose .torch_rref is torch's"
    ),
    "get_rpc_timeout": (
        "distgrad.rpc does not offer get_rpc_timeout: it is plain RPC, use "
        "torch.distributed.rpc.get_rpc_timeout (same agent)"
    ),
}


def __getattr__(name: str) -> Any:
    if name in _NOT_OFFERED:
        raise AttributeError(_NOT_OFFERED[name])
    raise AttributeError(f"module 'distgrad.rpc' has no attribute {name!r}")
