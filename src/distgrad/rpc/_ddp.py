"""DistributedDataParallel inside a context: the context gets DDP's averaged gradients.

torch's DDP reducer, after each parameter's AccumulateGrad has run, copies the gradient into
a bucket, averages the buckets across its process group (or runs the registered comm hook),
and writes the result back; under torch's dist autograd it reads and writes the gradient in
torch's (C++) context instead of ``.grad``. distgrad's contexts are Python, so the reducer
would read an empty ``.grad`` and the context would keep the local, unreduced gradient.

So a DDP module whose forward runs inside a distgrad context with gradient sync expected
(not under ``no_sync()``) is noted in the context, and the engine call that reaches its
parameters runs DDP's way: each parameter's ``.grad`` is put aside and set to ``None``, the
parameters' AccumulateGrad nodes write ``.grad``, DDP's hooks and its end-of-backward
callback average it there (on the same thread, before the engine call returns), and then the
averaged gradients go into the context and every ``.grad`` gets its old value back.

DDP reduces once per forward, in one backward. A backward that reaches the module's
parameters in two engine calls (FAST runs a local subgraph once per message that reaches it;
SMART stops at held edges) cannot be right and raises :class:`RpcAutogradError`, as does a
second backward over the same forward.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor

from distgrad.errors import RpcAutogradError
from distgrad.rpc import _identity
from distgrad.rpc._context import lookup

__all__ = ["Reductions", "install"]


class Reductions:
    """The DDP modules of one context whose forward expects a gradient reduction."""

    def __init__(self) -> None:
        self.pending: list[Any] = []  # DDP modules not yet reduced
        self.reduced: dict[int, str] = {}  # id(parameter) -> the module's name, once reduced

    def note(self, module: Any) -> None:
        if all(m is not module for m in self.pending):
            self.pending.append(module)
        for p in module.parameters():
            self.reduced.pop(id(p), None)  # a new forward: a new reduction

    def begin(self, leaves: Sequence[tuple[Tensor, Any]], *, capturing: bool) -> _Reduction:
        """The reduction the engine call over ``leaves`` runs (empty if it reaches no DDP
        parameter); raises if it reaches parameters already reduced or cannot run DDP."""
        ids = {id(leaf) for leaf, _ in leaves}
        for leaf, _ in leaves:
            if id(leaf) in self.reduced:
                raise RpcAutogradError(_twice(self.reduced[id(leaf)]))
        modules = [m for m in self.pending if any(id(p) in ids for p in m.parameters())]
        if modules and capturing:
            raise RpcAutogradError(
                f"distgrad.rpc.backward(mode='smart') reached the parameters of "
                f"{_name(modules[0])} in a step that stops at held gradients, where DDP's hooks "
                "do not run, so its averaged gradients cannot be put in the context; use "
                "mode='fast', or keep the module's output off RPC until the loss"
            )
        for m in modules:
            self.pending.remove(m)
            for p in m.parameters():
                self.reduced[id(p)] = _name(m)
        return _Reduction(modules)


class _Reduction:
    """One engine call's DDP modules: their parameters' ``.grad`` put aside, then restored."""

    def __init__(self, modules: list[Any]) -> None:
        self.params = [p for m in modules for p in m.parameters() if p.requires_grad]
        self.through = {id(p) for p in self.params}  # leaves whose AccumulateGrad writes .grad
        self.saved: list[Tensor | None] | None = None  # the .grad values put aside

    def __enter__(self) -> None:
        self.saved = [p.grad for p in self.params]
        for p in self.params:
            p.grad = None

    def collect(self) -> list[tuple[Tensor, Tensor]]:
        """The averaged gradients DDP left in ``.grad``; every ``.grad`` is restored."""
        found = [(p, p.grad) for p in self.params if p.grad is not None]
        self.restore()
        return found  # type: ignore[return-value]

    def restore(self) -> None:
        """Give every ``.grad`` its value from before (once; later calls do nothing)."""
        if self.saved is not None:
            for p, old in zip(self.params, self.saved, strict=True):
                p.grad = old
            self.saved = None


def _name(module: Any) -> str:
    return f"DistributedDataParallel({type(module.module).__name__})"


def _twice(name: str) -> str:
    return (
        f"distgrad.rpc.backward reached the parameters of {name} again after DDP had "
        "averaged their gradients for this forward: DDP reduces once per forward, in one "
        "backward. This happens when the module's output reaches the loss through RPC "
        "(FAST runs a local subgraph once per message that reaches it) or when backward "
        "runs twice over one forward; run the DDP module's forward once per backward, with "
        "its output reaching the loss locally"
    )


_original_forward: Any = None
_install_lock = threading.Lock()


def install() -> None:
    """Note DDP forwards made inside distgrad contexts (idempotent; one check per forward)."""
    global _original_forward
    if _original_forward is not None:
        return
    from torch.nn.parallel import DistributedDataParallel as DDP

    with _install_lock:
        if _original_forward is None:
            _original_forward = DDP.forward
            DDP.forward = _forward  # type: ignore[method-assign]


def _forward(self: Any, *args: Any, **kwargs: Any) -> Any:
    out = _original_forward(self, *args, **kwargs)
    context_id = _identity.current_context_id()
    if context_id is not None and torch.is_grad_enabled() and self.require_backward_grad_sync:
        ctx = lookup(context_id)
        with ctx.lock:
            if ctx.ddp is None:
                ctx.ddp = Reductions()
            ctx.ddp.note(self)
    return out
