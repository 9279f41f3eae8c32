"""The bookkeeping of reducing wrappers (DDP, FSDP2) inside a context: which leaves an engine
call reaches, whose ``.grad`` is put aside meanwhile, and when a wrapper has reduced.

A wrapper whose forward ran inside a context expects its hooks to reduce the gradients of its
parameters in the backward that follows; distgrad runs the engine calls that reach them the
wrapper's way (``_ddp`` says how for DDP, ``_fsdp`` for FSDP2) and keeps one
:class:`Reduction` per wrapper and forward in the context's :class:`Reductions`. Reaching a
wrapper's leaves twice for one forward, or in an engine call that captures (SMART's held
edges), raises :class:`RpcAutogradError`: the wrapper reduces once per forward.

Pure bookkeeping: it knows the records' ``Leaf``, never a context or an engine, so the
context can name its reductions.
"""

from __future__ import annotations

from collections.abc import Sequence

from torch import Tensor, nn

from distgrad.errors import RpcAutogradError
from distgrad.rpc._records import Leaf

__all__ = ["EngineCall", "Reduction", "Reductions"]


class Reduction:
    """What a reducing wrapper (DDP in ``_ddp``, FSDP2 in ``_fsdp``) does in one context, from its
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
