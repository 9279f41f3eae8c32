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


class _Module:
    """One DDP module's reduction in a context, from its forward until DDP has averaged."""

    def __init__(self, module: Any) -> None:
        self.module = module
        self.params = [p for p in module.parameters() if p.requires_grad]
        self.ids = {id(p) for p in self.params}
        self.reached: set[int] = set()  # parameters whose AccumulateGrad ran (or will run)
        self.saved: list[Tensor | None] | None = None  # each .grad, put aside meanwhile
        # Without find_unused_parameters DDP waits for every parameter, so its reduction may
        # span engine calls (the module's own forward made an RPC); with it, DDP decides at
        # forward time what is unused, which distgrad cannot see: one engine call only.
        self.spans_calls = not module.find_unused_parameters

    def put_aside(self) -> None:
        if self.saved is None:
            self.saved = [p.grad for p in self.params]
            for p in self.params:
                p.grad = None

    def restore(self) -> None:
        """Give every ``.grad`` its value from before (once; later calls do nothing)."""
        if self.saved is not None:
            for p, old in zip(self.params, self.saved, strict=True):
                p.grad = old
            self.saved = None


class Reductions:
    """The DDP modules of one context whose forward expects a gradient reduction."""

    def __init__(self) -> None:
        self.pending: list[_Module] = []  # noted, not yet averaged
        self.reduced: dict[int, str] = {}  # id(parameter) -> the module's name, once averaged

    def note(self, module: Any) -> None:
        for r in self.pending:
            if r.module is module:  # a second forward before a backward: start again
                r.restore()
                self.pending.remove(r)
                break
        self.pending.append(_Module(module))
        for p in module.parameters():
            self.reduced.pop(id(p), None)  # a new forward: a new reduction

    def begin(self, leaves: Sequence[tuple[Tensor, Any]], *, capturing: bool) -> _Reduction:
        """The reductions the engine call over ``leaves`` takes part in (none if it reaches
        no DDP parameter); raises if it reaches a parameter twice or cannot run DDP."""
        ids = {id(leaf) for leaf, _ in leaves}
        for leaf, _ in leaves:
            if id(leaf) in self.reduced:
                raise RpcAutogradError(_twice(self.reduced[id(leaf)]))
        touched = [r for r in self.pending if r.ids & ids]
        if touched and capturing:
            raise RpcAutogradError(
                f"distgrad.rpc.backward(mode='smart') reached the parameters of "
                f"{_name(touched[0].module)} in a step that stops at held gradients, where "
                "DDP's hooks do not run, so its averaged gradients cannot be put in the "
                "context; use mode='fast', or keep the module's output off RPC until the loss"
            )
        for r in touched:
            if r.reached & ids:
                raise RpcAutogradError(_twice(_name(r.module)))
            r.reached |= r.ids & ids
        return _Reduction(self, touched)

    def done(self, r: _Module) -> None:
        self.pending.remove(r)
        for p in r.params:
            self.reduced[id(p)] = _name(r.module)


class _Reduction:
    """The DDP reductions one engine call takes part in."""

    def __init__(self, owner: Reductions, touched: list[_Module]) -> None:
        self.owner = owner
        self.touched = touched
        self.through = {i for r in touched for i in r.ids}  # AccumulateGrad writes their .grad

    def __enter__(self) -> None:
        for r in self.touched:
            r.put_aside()

    def finish(self) -> list[tuple[Tensor, Tensor]]:
        """After the engine call: the averaged gradients of the reductions DDP completed in
        it (each ``.grad`` restored); the others keep collecting in later calls."""
        found: list[tuple[Tensor, Tensor]] = []
        for r in self.touched:
            if r.reached == r.ids or not r.spans_calls:
                found += [(p, p.grad) for p in r.params if p.grad is not None]
                r.restore()
                self.owner.done(r)
        return found

    def abort(self) -> None:
        """The engine call failed: every ``.grad`` gets its old value; no reduction goes on."""
        for r in self.touched:
            r.restore()
            if r in self.owner.pending:
                self.owner.done(r)


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
