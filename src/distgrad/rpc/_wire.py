"""The messages distgrad's workers send each other: one dataclass per message.

Each travels as the single argument (or the answer) of an RPC through torch's RPC pickler,
which carries the tensors inside them. Every message pickles as its class and a tuple of its
fields (about 3 us less per message than a dataclass's default state dict on this machine).
"""

from __future__ import annotations

import operator
from dataclasses import dataclass, fields
from typing import Any, TypeVar

from torch import Tensor

from distgrad.rpc._records import Lineage

__all__ = [
    "AbortPass",
    "Envelope",
    "GradientMessage",
    "Lineage",
    "LineageQuery",
    "RRefBackward",
    "Release",
    "Reply",
]

M = TypeVar("M")


def _pickled_as_tuple(cls: type[M]) -> type[M]:
    get = operator.attrgetter(*(f.name for f in fields(cls)))  # type: ignore[arg-type]

    def reduce(self: M) -> tuple[type[M], tuple[Any, ...]]:
        return (cls, get(self))

    cls.__reduce__ = reduce  # type: ignore[assignment,method-assign]
    return cls


@_pickled_as_tuple
@dataclass
class Envelope:
    """A call's request or answer made inside a context: a payload plus its autograd ids.

    ``message_id`` is ``None`` when no tensor in the payload required grad; ``positions``
    lists, in traversal order of the payload's tensors, those that did; ``lineage`` is the
    send's lineage (see ``SendRecord``). A request may carry ``releases``: ids of contexts the
    sender released, which the receiver drops before serving it (see ``_release``).
    """

    context_id: int
    sender: str
    payload: Any
    message_id: int | None
    positions: list[int]
    lineage: Lineage | None = None
    releases: list[int] | None = None


@_pickled_as_tuple
@dataclass
class GradientMessage:
    """Gradients for the tensors of ``sends[message_id]`` on the receiving worker.

    ``budget`` is the time (seconds) the receiver has for its part, ``sender`` the worker
    waiting for the answer. SMART messages carry the pass's ``lineage`` (FAST: ``None``) and
    whether the graph is kept.
    """

    context_id: int
    message_id: int
    grads: list[Tensor | None]
    pass_id: int
    budget: float
    sender: str
    lineage: Lineage | None = None
    retain_graph: bool = True


@_pickled_as_tuple
@dataclass
class Reply:
    """Gradients for the tensors of ``sends[message_id]`` of the worker a gradient message is
    answered to: they ride back in the answer instead of travelling as a message of their own.
    The answer to a :class:`GradientMessage` is a list of these."""

    message_id: int
    grads: list[Tensor | None]


@_pickled_as_tuple
@dataclass
class LineageQuery:
    """SMART: which recvs do these sends of the receiver reach? Answer: ``(recv id, sender)``."""

    context_id: int
    send_ids: list[int]


@_pickled_as_tuple
@dataclass
class Release:
    """Drop these contexts and tell the workers they touched (except ``sender``).

    Answer: one line per worker that could not be reached."""

    context_ids: list[int]
    sender: str


@_pickled_as_tuple
@dataclass
class AbortPass:
    """SMART: a backward pass failed; drop its state."""

    context_id: int
    pass_id: int


@_pickled_as_tuple
@dataclass
class RRefBackward:
    """Run a distributed backward from the value of ``rref`` (torch's RRef) on its owner, the
    receiver, in context ``context_id``, with ``budget`` seconds. Answer, once the pass is
    over: ``None``, or the exception it raised there."""

    rref: Any
    context_id: int
    retain_graph: bool
    mode: str
    budget: float
