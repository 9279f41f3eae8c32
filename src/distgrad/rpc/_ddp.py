"""DistributedDataParallel inside a context: the context gets DDP's averaged gradients.

torch's DDP reducer, after each parameter's AccumulateGrad has run, copies the gradient into
a bucket, averages the buckets across its process group (or runs the registered comm hook),
and writes the result back; under torch's dist autograd it reads and writes the gradient in
torch's (C++) context instead of ``.grad``. distgrad's contexts are Python, so the reducer
would read an empty ``.grad`` and the context would keep the local, unreduced gradient.

So a DDP module whose forward runs inside a distgrad context with gradient sync expected
(not under ``no_sync()``) is noted in the context, and the engine calls that reach its
parameters run DDP's way: each parameter's ``.grad`` is put aside and set to ``None``, the
parameters' AccumulateGrad nodes write ``.grad``, DDP's hooks average it there, DDP's
end-of-backward callback runs at the end of the engine call in which its last bucket became
ready (on the same thread), and after that call the averaged gradients go into the context and
every ``.grad`` gets its old value back. When the module's own forward makes RPCs, its
parameters are reached in several engine calls, and DDP finishes in the one that reaches the
last of them (without ``find_unused_parameters``; with it, one engine call only).

DDP reduces once per forward, in one backward. A parameter reached twice (FAST runs a local
subgraph once per message that reaches it; a second backward over one forward), or a SMART
step that stops at held edges over them, cannot be right and raises
:class:`RpcAutogradError`.

The bookkeeping (``_reductions``) serves FSDP2 too (``_fsdp``), whose hooks reduce-scatter
into other tensors than the leaves they read.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor
from torch.nn.parallel import DistributedDataParallel

from distgrad.rpc import _identity
from distgrad.rpc._context import lookup
from distgrad.rpc._patch import Patch
from distgrad.rpc._reductions import Reduction, Reductions

__all__ = ["DDPReduction", "install"]


class DDPReduction(Reduction):
    """One DDP module's reduction: its parameters are the leaves and get the averages."""

    def __init__(self, module: DistributedDataParallel) -> None:
        params: list[Tensor] = [p for p in module.parameters() if p.requires_grad]
        super().__init__(module, params, params)
        # Without find_unused_parameters DDP waits for every parameter, so its reduction may
        # span engine calls (the module's own forward made an RPC); with it, DDP decides at
        # forward time what is unused, which distgrad cannot see: one engine call only.
        self.spans_calls = not module.find_unused_parameters


_FORWARD: Patch[Callable[..., Any]] = Patch()  # DDP's own forward, once wrapped


def install() -> None:
    """Note DDP forwards made inside distgrad contexts (idempotent; one check per forward)."""
    _FORWARD.install(DistributedDataParallel, "forward", _forward)


def _forward(self: DistributedDataParallel, *args: Any, **kwargs: Any) -> Any:
    original = _FORWARD.original
    assert original is not None
    out = original(self, *args, **kwargs)
    context_id = _identity.current_context_id()
    if context_id is not None and torch.is_grad_enabled() and self.require_backward_grad_sync:
        ctx = lookup(context_id)
        with ctx.lock:
            if ctx.ddp is None:
                ctx.ddp = Reductions()
            ctx.ddp.note(DDPReduction(self))
    return out
