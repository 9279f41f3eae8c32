"""FSDP2 (``fully_shard``) inside a context: the context gets FSDP2's reduced, sharded gradients.

FSDP2's forward runs on *unsharded* parameters (leaf tensors it all-gathers into, and frees
after backward), not on the module's registered, sharded ones (DTensors). In a plain backward,
AccumulateGrad writes each unsharded parameter's ``.grad`` and FSDP2's post-backward hooks
(on the module's inputs, and a callback queued on the engine at the end of the backward)
reduce-scatter them into the sharded parameters' ``.grad``, averaged over the shard group.
torch's dist autograd, and distgrad's engine left alone, store instead the *local* gradients
of the unsharded parameters, which no user code can reach (``model.parameters()`` and a
``DistributedOptimizer`` see the sharded ones, and step nothing): measured on torch 2.13.

So a call of an FSDP2 module inside a distgrad context is noted (distgrad wraps
``FSDPModule.__call__``: one check per call), and the engine call that reaches its unsharded
parameters lets their AccumulateGrad write ``.grad``; FSDP2's hooks reduce-scatter inside that
call, and the sharded gradients go into the context, keyed by the sharded parameters, while
their ``.grad`` gets its old value back (see ``_ddp``; both keep their books with
``_reductions``). One FSDP2 tree (a root and the modules ``fully_shard`` was applied to
below it) reduces at the end of the first engine call that reaches any of it, so the tree's
forward must reach the loss in one engine call: a second one raises :class:`RpcAutogradError`
before any gradient of it is used, as does ``set_requires_gradient_sync(False)`` (FSDP2
would accumulate unsharded gradients that distgrad's engine does not write).
"""

from __future__ import annotations

import threading
from typing import TYPE_CHECKING, Any, cast

import torch
from torch import Tensor, nn

from distgrad.errors import RpcAutogradError
from distgrad.rpc import _identity
from distgrad.rpc._context import lookup
from distgrad.rpc._reductions import Reduction, Reductions

if TYPE_CHECKING:  # imported when installed: a torch without FSDP2 has none
    from torch.distributed.fsdp import FSDPModule

__all__ = ["FSDPReduction", "install"]


class FSDPReduction(Reduction):
    """One FSDP2 tree's reduction: its unsharded parameters are the leaves, its sharded
    parameters get the reduce-scattered gradients."""

    kind = "FSDP2"
    verb = "reduce-scattered"
    also = (
        ", or when the module's own forward makes RPCs (FSDP2 reduces at the end of the "
        "first engine call that reaches it)"
    )

    def __init__(self, module: FSDPModule, fsdp_params: list[Any]) -> None:
        unsharded = [fp._unsharded_param for fp in fsdp_params]
        # An FSDP2 module is an nn.Module too (fully_shard makes a class deriving from both).
        super().__init__(
            cast(nn.Module, module), unsharded, [fp.sharded_param for fp in fsdp_params]
        )
        self.key = module._get_fsdp_state()._state_ctx  # shared by the whole tree
        self.unsharded: list[Tensor] = unsharded

    @property
    def name(self) -> str:
        return f"the FSDP2 module {type(self.module).__name__}"

    def merge(self, later: Reduction) -> Reduction:
        """Another module of the tree (or another forward of it): one reduction for all."""
        assert isinstance(later, FSDPReduction)
        known = {id(p) for p in self.params}
        for leaf, param in zip(later.unsharded, later.params, strict=True):
            if id(param) not in known:
                self.unsharded.append(leaf)
                self.params.append(param)
                self.ids.add(id(leaf))
        self.module = later.module  # the outermost module called last: name it
        return self

    def collect(self) -> list[tuple[Tensor, Tensor]]:
        left = [p for p in self.unsharded if p.grad is not None]
        for p in left:
            p.grad = None
        if left:  # FSDP2's post-backward did not read them: its hooks did not run
            raise RpcAutogradError(
                f"distgrad.rpc.backward: {self.name}'s post-backward hooks did not run in the "
                "engine call that reached its parameters, so its gradients were not "
                "reduce-scattered; run the module's forward once per backward, with its "
                "output reaching the loss locally"
            )
        return super().collect()


def _fsdp_params(module: FSDPModule) -> list[Any]:
    state = module._get_fsdp_state()
    found = []
    for group in state._fsdp_param_groups:
        if not group.reduce_grads:
            raise RpcAutogradError(
                f"{type(module).__name__} runs inside a distgrad.rpc context with "
                "set_requires_gradient_sync(False): FSDP2 would accumulate unsharded gradients "
                "across backward passes, which distgrad's engine keeps in the context instead, "
                "so they would be lost; accumulate with separate contexts and sync every step"
            )
        found += [
            fp
            for fp in group.fsdp_params
            if fp.sharded_param.requires_grad and hasattr(fp, "_unsharded_param")
        ]
    return found


_fsdp_module: type[FSDPModule] | None = None  # torch's FSDPModule, once wrapped
_install_lock = threading.Lock()


def install() -> None:
    """Note FSDP2 module calls made inside distgrad contexts (idempotent)."""
    global _fsdp_module
    if _fsdp_module is not None:
        return
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:  # a torch without FSDP2
        return
    with _install_lock:
        if _fsdp_module is None:
            # FSDPModule defines no __call__: the one after it in an FSDP2 class's MRO is the
            # module's own (nn.Module's), which _call calls.
            FSDPModule.__call__ = _call  # type: ignore[attr-defined,method-assign]
            _fsdp_module = FSDPModule


def _call(self: FSDPModule, *args: Any, **kwargs: Any) -> Any:
    assert _fsdp_module is not None
    out = super(_fsdp_module, self).__call__(*args, **kwargs)  # type: ignore[misc]  # nn.Module's
    context_id = _identity.current_context_id()
    if context_id is not None and torch.is_grad_enabled():
        record = FSDPReduction(self, _fsdp_params(self))
        ctx = lookup(context_id)
        with ctx.lock:
            if ctx.ddp is None:
                ctx.ddp = Reductions()
            ctx.ddp.note(record)
    return out
