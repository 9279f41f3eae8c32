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

from distgrad.rpc._lifecycle import init_rpc, shutdown
from distgrad.rpc.backward import backward
from distgrad.rpc.calls import RRef, remote, rpc_async, rpc_sync
from distgrad.rpc.context import (
    DistAutogradContext,
    context,
    current_context_id,
    debug_state,
    get_gradients,
)
from distgrad.rpc.optimizer import DistributedOptimizer

__all__ = [
    "DistAutogradContext",
    "DistributedOptimizer",
    "RRef",
    "backward",
    "context",
    "current_context_id",
    "debug_state",
    "get_gradients",
    "init_rpc",
    "remote",
    "rpc_async",
    "rpc_sync",
    "shutdown",
]
