"""``distgrad.rpc.functions``: torch's ``torch.distributed.rpc.functions``, for distgrad calls.

``async_execution`` marks a function that returns a ``torch.futures.Future``: the callee
answers when that future completes, not when the function returns. Called through
``distgrad.rpc.rpc_sync``/``rpc_async``/``remote`` or an RRef proxy inside a context, the
tensors of the future's value that require grad are recorded like any call's result, so the
backward reaches the graph that produced them.
"""

from __future__ import annotations

from torch.distributed.rpc.functions import async_execution

__all__ = ["async_execution"]
