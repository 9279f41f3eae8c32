"""A checked call: what :meth:`Signature.bind <distgrad.collectives._signature.Signature.bind>`
returns, and what the lean path keeps per call shape (``_lean``)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, TypeVar

from distgrad._exchange.group import Group
from distgrad._exchange.handshake import RankCall
from distgrad.errors import CollectiveArgumentError

__all__ = ["Bound"]

_T = TypeVar("_T")


@dataclass(slots=True)
class Bound:
    """A checked call: its group (marked with the call in debug mode), its description, every
    rank's call when it exchanged metadata, and each argument as its field made it
    (``bound["dim"]`` non-negative, ``bound["op"]`` a name, ``bound["sizes"]`` split)."""

    group: Group
    desc: str
    calls: list[RankCall] | None
    values: Mapping[str, Any]
    # The op's plan for this call, kept by the op (``call.plan or call.keep(make())``): a call
    # on the lean path gets the Bound its call shape's checks made, so a plan kept here is made
    # once per call shape.
    plan: Any = None

    def __getitem__(self, name: str) -> Any:
        return self.values[name]

    def keep(self, plan: _T) -> _T:
        """Keep ``plan`` as this call's (``plan = call.plan or call.keep(make())``)."""
        self.plan = plan
        return plan

    def error(self, problem: str) -> CollectiveArgumentError:
        """The error for a problem an op finds past its door (in the data, or in what the
        ranks' calls make together), worded as the fields word theirs."""
        return CollectiveArgumentError(f"{self.desc} on rank {self.group.rank}: {problem}")
