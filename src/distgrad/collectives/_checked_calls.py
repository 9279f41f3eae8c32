"""Which calls are checked across ranks: every rank counts its distgrad calls on each group.

A call exchanges metadata (``distgrad._exchange.handshake``) when it is

* one of the first :data:`CHECKED_CALLS` calls on its group. Every rank counts its own calls,
  so the ranks agree on which calls these are without asking, and a mistake in the code (a
  shape, a dtype, an argument that differs between ranks) is the same clear error on every
  rank at start-up;
* any call in debug mode (:func:`distgrad.set_debug`, ``DISTGRAD_DEBUG=1`` or
  ``TORCH_DISTRIBUTED_DEBUG=DETAIL``);
* a call whose output shape this rank cannot compute from its own arguments (an uneven
  ``all_gather`` without ``sizes=``, ...): the sizes have to be exchanged anyway, and the same
  message checks the call for free.

Any other call sends nothing but its data and makes no host synchronisation: the ranks are
trusted to keep making the calls the checked ones made (same shapes, same arguments, inputs that
require grad on every rank or on none). Inside ``torch.compile`` nothing is exchanged or counted.
"""

from __future__ import annotations

import torch

from distgrad._exchange.group import Group, on_forget
from distgrad._exchange.handshake import debug_enabled

__all__ = ["CHECKED_CALLS", "call_counts", "calls_so_far", "checks_this_call", "next_call"]

CHECKED_CALLS = 8
"""How many calls on each group are checked across ranks outside debug mode."""

call_counts: dict[tuple[int, str], int] = {}
"""How many distgrad calls this process has made on each group, by the group's key (its id and
name: distgrad._exchange.group). Every rank counts the same calls, so the counts name a call
alike everywhere. (The lean path reads and bumps it in place: one call less per op.)"""


def _forget_calls(groups: list[Group], world_gone: bool) -> None:
    for group in groups:
        call_counts.pop(group.key, None)


on_forget(_forget_calls)


def calls_so_far(group: Group) -> int:
    """How many checked-or-not distgrad calls this process has made on ``group``."""
    return call_counts.get(group.key, 0)


def checks_this_call(group: Group, sizes_known: bool = True) -> bool:
    """Whether the next call on ``group`` exchanges metadata (see the module docstring).

    For checks that cost a host synchronisation (a tensor argument's value), which are made
    only on the calls that are checked across ranks anyway.
    """
    if torch.compiler.is_compiling() or group.size == 1:
        return False
    return debug_enabled() or not sizes_known or calls_so_far(group) < CHECKED_CALLS


def next_call(group: Group) -> int:
    """Count a call on ``group``; return its number (how many calls came before it)."""
    key = group.key
    count = call_counts.get(key, 0)
    call_counts[key] = count + 1
    return count
