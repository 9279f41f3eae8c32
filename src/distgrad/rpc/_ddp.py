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

The bookkeeping (:class:`Reduction`, :class:`Reductions`) serves FSDP2 too (``_fsdp``), whose
hooks reduce-scatter into other tensors than the leaves they read.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import Tensor, nn
from torch.nn.parallel import DistributedDataParallel

from distgrad.errors import RpcAutogradError
from distgrad.rpc import _identity
from distgrad.rpc._context import lookup
from distgrad.rpc._records import Leaf

__all__ = ["DDPReduction", "EngineCall", "Reduction", "Reductions", "install"]


class Reduction:
    """What a reducing wrapper (DDP here, FSDP2 in ``_fsdp``) does in one context, from its
    forward until it has reduced: the leaves whose AccumulateGrad must write ``.grad`` for
    the wrapper's hooks (``ids``), and the parameters whose ``.grad`` then holds the reduced
    gradient (``params``; the same tensors for DDP, FSDP2's sharded ones for FSDP2)."""

    kind = "DDP"
    verb = "averaged"
    also = ""  # more causes of a second reach, for the error

    def __init__(self, module: nn.Module, leaves: list[Tensor], params: list[Tensor]) -> None:
        self.module = module
        self.key: object = module  # a second forward with the same key: see ``merge``
        self.ids = {id(p) for p in leaves}
        self.params = params
        self.reached: set[int] = set()  # leaves whose AccumulateGrad ran (or will run)
        self.saved: list[Tensor | None] | None = None  # each .grad, put aside meanwhile
        # Whether the wrapper waits for every leaf, so that its reduction may span engine
        # calls (see DDPReduction); otherwise it reduces in the first engine call reaching it.
        self.spans_calls = False

    @property
    def name(self) -> str:
        return f"{type(self.module).__name__}({type(self.module.module).__name__})"

    def merge(self, later: Reduction) -> Reduction:
        """The record to keep when ``later`` (same key) comes before a backward."""
        self.restore()
        return later

    def put_aside(self) -> None:
        if self.saved is None:
            self.saved = [p.grad for p in self.params]
            for p in self.params:
                p.grad = None

    def collect(self) -> list[tuple[Tensor, Tensor]]:
        """After the wrapper reduced: the reduced gradients (before ``restore``)."""
        return [(p, p.grad) for p in self.params if p.grad is not None]

    def restore(self) -> None:
        """Give every ``.grad`` its value from before (once; later calls do nothing)."""
        if self.saved is not None:
            for p, old in zip(self.params, self.saved, strict=True):
                p.grad = old
            self.saved = None


class DDPReduction(Reduction):
    """One DDP module's reduction: its parameters are the leaves and get the averages."""

    def __init__(self, module: DistributedDataParallel) -> None:
        params: list[Tensor] = [p for p in module.parameters() if p.requires_grad]
        super().__init__(module, params, params)
        # Without find_unused_parameters DDP waits for every parameter, so its reduction may
        # span engine calls (the module's own forward made an RPC); with it, DDP decides at
        # forward time what is unused, which distgrad cannot see: one engine call only.
        self.spans_calls = not module.find_unused_parameters


class Reductions:
    """The reducing wrappers (DDP, FSDP2) of one context whose forward expects a reduction."""

    def __init__(self) -> None:
        self.pending: list[Reduction] = []  # noted, not yet reduced
        self.reduced: dict[int, Reduction] = {}  # id(leaf) -> its reduction, once reduced

    def note(self, record: Reduction) -> None:
        for i, r in enumerate(self.pending):
            if r.key is record.key:  # a second forward before a backward
                record = self.pending.pop(i).merge(record)
                break
        self.pending.append(record)
        for i in record.ids:
            self.reduced.pop(i, None)  # a new forward: a new reduction

    def begin(self, leaves: Sequence[Leaf], *, capturing: bool) -> EngineCall:
        """The reductions the engine call over ``leaves`` takes part in (none if it reaches
        no wrapper's leaf); raises if it reaches a leaf twice or cannot run the hooks."""
        ids = {id(leaf) for leaf, _ in leaves}
        for leaf, _ in leaves:
            if id(leaf) in self.reduced:
                raise RpcAutogradError(_twice(self.reduced[id(leaf)]))
        touched = [r for r in self.pending if r.ids & ids]
        if touched and capturing:
            r = touched[0]
            raise RpcAutogradError(
                f"distgrad.rpc.backward(mode='smart') reached the parameters of {r.name} in a "
                f"step that stops at held gradients, where {r.kind}'s hooks do not run, so its "
                "reduced gradients cannot be put in the context; use mode='fast', or keep the "
                "module's output off RPC until the loss"
            )
        for r in touched:
            if r.reached & ids:
                raise RpcAutogradError(_twice(r))
            r.reached |= r.ids & ids
        return EngineCall(self, touched)

    def done(self, r: Reduction) -> None:
        self.pending.remove(r)
        for i in r.ids:
            self.reduced[i] = r


class EngineCall:
    """The reductions one engine call takes part in."""

    def __init__(self, owner: Reductions, touched: list[Reduction]) -> None:
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
                found += r.collect()
                r.restore()
                self.owner.done(r)
        return found

    def abort(self) -> None:
        """The engine call failed: every ``.grad`` gets its old value; no reduction goes on."""
        for r in self.touched:
            r.restore()
            if r in self.owner.pending:
                self.owner.done(r)


def _twice(r: Reduction) -> str:
    return (
        f"distgrad.rpc.backward reached the parameters of {r.name} again after {r.kind} had "
        f"{r.verb} their gradients for this forward: {r.kind} reduces once per forward, in "
        "one backward. This happens when the module's output reaches the loss through RPC "
        "(FAST runs a local subgraph once per message that reaches it), when backward runs "
        f"twice over one forward{r.also}; run the {r.kind} module's forward once per "
        "backward, with its output reaching the loss locally"
    )


_original_forward: Callable[..., Any] | None = None  # DDP's own forward, once wrapped
_install_lock = threading.Lock()


def install() -> None:
    """Note DDP forwards made inside distgrad contexts (idempotent; one check per forward)."""
    global _original_forward
    if _original_forward is not None:
        return
    with _install_lock:
        if _original_forward is None:
            _original_forward = DistributedDataParallel.forward
            DistributedDataParallel.forward = _forward  # type: ignore[method-assign]


def _forward(self: DistributedDataParallel, *args: Any, **kwargs: Any) -> Any:
    assert _original_forward is not None
    out = _original_forward(self, *args, **kwargs)
    context_id = _identity.current_context_id()
    if context_id is not None and torch.is_grad_enabled() and self.require_backward_grad_sync:
        ctx = lookup(context_id)
        with ctx.lock:
            if ctx.ddp is None:
                ctx.ddp = Reductions()
            ctx.ddp.note(DDPReduction(self))
    return out
