"""What travels with a forward RPC made inside a context (pickled by torch's RPC layer)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

__all__ = ["Envelope"]


@dataclass(frozen=True)
class Envelope:
    """A payload plus its autograd bookkeeping.

    ``message_id`` is ``None`` when no tensor in the payload required grad; ``positions`` lists,
    in traversal order of the payload's tensors, those that did.
    """

    context_id: int
    sender: str
    payload: Any
    message_id: int | None
    positions: list[int]
