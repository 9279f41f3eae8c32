"""The lean path: a call whose checks passed before gets back what they made, unchecked.

A call past the checked calls (``_checked_calls``), outside debug mode and ``torch.compile``,
with the same group, the same tensor metadata and the same arguments (its *call shape*) as a
call whose every check passed, gets back the :class:`~distgrad.collectives._signature.Bound`
that call's checks made (with the plan its op kept on it), and only counts and notes the call.

Why it is sound: every local check reads only the group, the op's arguments and the tensor's
type, shape, dtype, device and requires_grad (with grad mode), which make the key; a tensor
argument enters the key by that metadata, so a check that reads a tensor's values reads them
only on the calls checked across ranks, which never come from here. Why it matters: the checks
are about a third of an eager call's Python (measured: bind alone 4.4 us of a 32 KB
all_reduce's 59 us forward on 2 gloo ranks). Forgotten with the groups (a destroyed group's
calls must not come back), bounded by :data:`LEAN_MAX`.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any, Protocol

import torch
import torch.distributed as dist
from torch import Tensor
from torch.nn import Parameter

from distgrad._exchange.group import Group, on_forget
from distgrad._exchange.handshake import debug_enabled
from distgrad._exchange.wait import note_call
from distgrad.collectives._bound import Bound
from distgrad.collectives._checked_calls import CHECKED_CALLS, call_counts

__all__ = ["LEAN_MAX", "remember", "reuse"]

LEAN_MAX = 4096
"""How many call shapes are kept; a program of ever-new call shapes starts over past it."""

_LEAN: dict[Any, Bound] = {}


class Declared(Protocol):
    """What the lean path reads of a signature."""

    @property
    def plain(self) -> bool: ...  # every argument plain data: its values key it as passed
    @property
    def handshake(self) -> bool: ...  # whether its calls are counted and checked across ranks


def _forget_lean(groups: list[Group], world_gone: bool) -> None:
    _LEAN.clear()


on_forget(_forget_lean)


def reuse(
    signature: Declared, group: object, x: object, passed: dict[str, Any]
) -> tuple[Bound | None, Any]:
    """The Bound of an earlier call of this call shape, when this call may take it (counted
    and noted as the call it is), and the call shape (None where there is none: ``x`` not a
    plain tensor, an argument that cannot be hashed or is not plain data)."""
    if type(x) is not Tensor:
        return None, None
    assert isinstance(x, Tensor)
    if signature.plain:  # integers, names and lists of integers: the collectives' hot path
        values: Any = tuple([tuple(v) if type(v) is list else v for v in passed.values()])
    else:
        values = _shape_of(passed.values())
    key = (
        id(signature),
        group,
        x.shape,
        x.dtype,
        x.device,
        x.requires_grad,
        torch.is_grad_enabled(),
        values,
    )
    try:
        hit = _LEAN.get(key)
    except TypeError:  # an argument that cannot be hashed: no call shape
        return None, None
    if hit is None:
        return None, key
    g = hit.group
    if g.size == 1:  # never checked across ranks, nor counted
        # Seen alone (no process group): reused unless a group was made since.
        if g.pg is not None or not dist.is_initialized():
            return hit, key
    elif not signature.handshake:  # made of collectives that check themselves: not counted
        return hit, key
    else:
        call = call_counts.get(g.key, 0)
        if call >= CHECKED_CALLS and not debug_enabled():
            call_counts[g.key] = call + 1
            note_call(hit.desc, call, g)
            return hit, key
    return None, key


def remember(key: Any, bound: Bound) -> None:
    """Keep ``bound`` for calls of the call shape ``key``."""
    if len(_LEAN) >= LEAN_MAX:  # a program of ever-new call shapes: start over
        _LEAN.clear()
    _LEAN[key] = bound


_DATA = (int, float, str, bool, type(None), torch.dtype, torch.device)


def _shape_of(values: Iterable[object]) -> tuple[Any, ...] | list[Any]:
    """The arguments as a call shape holds them: a plain tensor by its metadata (never the
    tensor: a call shape must not keep a step's tensors alive), lists and tuples of plain data
    as tuples; anything else makes the call shape unhashable (a list), so it is not kept."""
    shaped: list[Any] = []
    for value in values:
        kind = type(value)
        if kind in _DATA:
            shaped.append(value)
        elif kind is Tensor or kind is Parameter:  # a layer's weight reads as a tensor
            assert isinstance(value, Tensor)
            shaped.append((Tensor, value.shape, value.dtype, value.device, value.requires_grad))
        elif kind is list or kind is tuple:
            assert isinstance(value, (list, tuple))
            for item in value:  # a loop, not all(...): one Python call less per op
                if type(item) not in _DATA:
                    return shaped
            shaped.append(tuple(value))
        else:
            return shaped
    return tuple(shaped)
