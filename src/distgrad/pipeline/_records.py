"""What a context records: every transfer of the forward pass, in program order.

A :class:`Record` is one forward transfer as this rank saw it: a send (the tensor sent, whose
gradient will arrive from the receiver) or a receive (the tensor received, whose gradient this
rank will send back). Its ``slot`` numbers it among this context's transfers between the same two
ranks in the same direction, so that both ranks name a transfer the same way: rank 0's third
send to rank 1 is rank 1's third receive from rank 0. The backward's messages are tagged with
the slot, which is how a gradient finds its transfer whatever order the ranks' backwards take.
"""

from __future__ import annotations

import itertools
import threading
from collections import deque
from dataclasses import dataclass, field
from typing import Literal

from torch import Tensor

from distgrad._exchange.group import Group
from distgrad._exchange.pairs import Pairs
from distgrad.errors import PipelineError

__all__ = ["Context", "Record", "current", "lookup", "open_context", "release"]

Kind = Literal["send", "recv"]


class Record:
    """One forward transfer of a context, as this rank made it. A receive's tensor is a leaf
    of this rank's graph (as torch's ``PipelineStage`` makes it): autograd accumulates into
    its ``.grad`` what reaches it, phase after phase, and the backward sends that on."""

    __slots__ = ("group", "index", "kind", "microbatch", "peer", "slot", "state", "tensor")

    def __init__(
        self,
        kind: Kind,
        group: Group,
        peer: int,
        slot: int,
        microbatch: int | None,
        tensor: Tensor | None,
        index: int,
    ) -> None:
        self.kind = kind
        self.group = group
        self.peer = peer  # group rank of the other side
        self.slot = slot  # index among the context's transfers with ``peer`` this way
        self.microbatch = microbatch
        self.tensor = tensor  # a send: the tensor sent; a receive: the tensor received
        self.index = index  # position in the context's program order
        self.state: Literal["recorded", "done"] = "recorded"

    def describe(self) -> str:
        way = f"send to rank {self.peer}" if self.kind == "send" else f"recv from rank {self.peer}"
        mb = "" if self.microbatch is None else f", microbatch {self.microbatch}"
        return f"{way} (transfer {self.slot} between the two ranks{mb})"


@dataclass(eq=False)
class Context:
    """One distributed autograd context over point-to-point: its transfers and gradients."""

    context_id: int
    check: bool = False  # every message of this context carries its header
    records: list[Record] = field(default_factory=list)
    # (group key, peer, kind) -> how many transfers of that kind with that peer so far
    slots: dict[tuple[tuple[int, str], int, Kind], int] = field(default_factory=dict)
    # accumulate="context": gradients of the leaves, by identity (the tensor kept beside its
    # gradient, so that the id cannot be reused while the entry lives)
    gradients: dict[int, tuple[Tensor, Tensor]] = field(default_factory=dict)
    # sends still in flight: forward sends started with isend, the backward's gradients
    in_flight: deque[Pairs] = field(default_factory=deque)
    # split backwards whose weight step is still to run: microbatch -> its starts, their
    # gradients and the received tensors of the transfers it covered
    weight_steps: dict[int | None, list[tuple[list[Tensor], list[Tensor], list[Tensor]]]] = field(
        default_factory=dict
    )

    def next_slot(self, kind: Kind, group: Group, peer: int) -> int:
        """Number a transfer (with or without gradient) among this context's transfers of
        ``kind`` with ``peer``: the sender's k-th send is the receiver's k-th receive."""
        key = (group.key, peer, kind)
        slot = self.slots.get(key, 0)
        self.slots[key] = slot + 1
        return slot

    def record(
        self,
        kind: Kind,
        group: Group,
        peer: int,
        slot: int,
        tensor: Tensor | None,
        microbatch: int | None,
    ) -> Record:
        """Record a transfer whose gradient the backward carries, at its place in program
        order: a send when it starts, a receive when its data is there (its wait)."""
        rec = Record(kind, group, peer, slot, microbatch, tensor, len(self.records))
        self.records.append(rec)
        return rec

    def pending(self, microbatch: int | None, everything: bool) -> list[Record]:
        """The transfers a backward over ``microbatch`` takes (all not yet run if
        ``everything``), in program order."""
        return [
            r
            for r in self.records
            if r.state == "recorded" and (everything or r.microbatch == microbatch)
        ]

    def keep(self, pairs: Pairs) -> None:
        """Hold a send in flight until it completes (its buffer must live until then), and let
        go of the oldest ones that have, so that a step's gradients do not all stay alive to
        its end (measured: no change in time at 1 MB per microbatch; it is for memory)."""
        flight = self.in_flight
        while flight and flight[0].done():
            flight.popleft()
        flight.append(pairs)

    def wait_in_flight(self) -> None:
        while self.in_flight:
            self.in_flight.popleft().wait()

    def accumulate(self, leaf: Tensor, grad: Tensor) -> None:
        held = self.gradients.get(id(leaf))
        total = grad if held is None else held[1] + grad
        self.gradients[id(leaf)] = (leaf, total)


_ids = itertools.count(1)
_lock = threading.Lock()
_contexts: dict[int, Context] = {}
_current = threading.local()


def open_context(check: bool) -> Context:
    if getattr(_current, "ctx", None) is not None:
        raise PipelineError(
            "dg.pipeline.context() entered inside another dg.pipeline context on this thread; "
            "contexts do not nest: leave the first one, or record both steps in one context "
            "with microbatch= labels"
        )
    ctx = Context(next(_ids), check)
    with _lock:
        _contexts[ctx.context_id] = ctx
    _current.ctx = ctx
    return ctx


def release(ctx: Context) -> None:
    _current.ctx = None
    with _lock:
        _contexts.pop(ctx.context_id, None)


def current(op: str) -> Context:
    ctx: Context | None = getattr(_current, "ctx", None)
    if ctx is None:
        raise PipelineError(
            f"dg.pipeline.{op} was called outside a dg.pipeline.context(): its transfer would "
            "have no backward. Record the step inside `with dg.pipeline.context() as cid:` on "
            "every rank, or use torch.distributed.send/recv for a transfer without gradients"
        )
    return ctx


def lookup(context_id: int) -> Context:
    with _lock:
        ctx = _contexts.get(context_id)
    if ctx is None:
        raise PipelineError(
            f"no dg.pipeline context with id {context_id} on this rank (never made here, or "
            "already left): run the backward inside the `with dg.pipeline.context()` block"
        )
    return ctx
