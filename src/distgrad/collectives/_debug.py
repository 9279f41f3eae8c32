"""Checks that only run in debug mode (:func:`distgrad.set_debug`), each costing a collective."""

from __future__ import annotations

import zlib

import torch
from torch import Tensor

from distgrad._exchange import ops
from distgrad._exchange.group import Group
from distgrad._exchange.handshake import debug_enabled, exchange, require_same
from distgrad.errors import CollectiveMismatchError

__all__ = ["check_backward_order", "check_replicated"]


def _checking(group: Group) -> bool:
    """Debug mode, a real group, and not inside torch.compile (which never exchanges metadata)."""
    # is_compiling first: a compiled graph must not read (and so guard on) the debug flag.
    return not torch.compiler.is_compiling() and group.size > 1 and debug_enabled()


def check_backward_order(op: str, group: Group) -> None:
    """Every rank must be in the backward of the same op of the same forward call.

    Autograd orders backward nodes by the local graph, so ranks whose losses use the outputs of
    several collectives differently (or that ask ``torch.autograd.grad`` for different inputs
    first) can reach them in different orders and pair the wrong ones. ``group.call`` names the
    forward call the node came from, so two backwards of the same op and shape are told apart.
    """
    if not _checking(group):
        return
    desc = f"backward of {op}"
    # crc32, not hash(): str hashes differ between processes started separately (torchrun).
    calls = exchange("backward", desc, group, None, [zlib.crc32(op.encode()), group.call])
    require_same(
        desc,
        group,
        calls,
        "which collective's backward they run",
        lambda c: c.args,
        "ranks reached their backward collectives in different orders; make every "
        "rank back-propagate through the collective outputs in the same order",
        shown=lambda c: f"the backward of its distgrad call {c.args[1] + 1}",
    )


def check_replicated(op: str, group: Group, grad: Tensor) -> None:
    """With objective="replicated" every rank must back-propagate the same gradient."""
    if not _checking(group):
        return
    reference = ops.broadcast.eager(grad, 0, group=group)
    # Bit-identical gradients are the same even where they hold NaN (NaN != NaN).
    same = torch.equal(grad, reference) or bool(
        ((grad == reference) | (grad.isnan() & reference.isnan())).all()
    )
    differs = torch.tensor([float(not same)], device=grad.device)
    count = int(ops.all_reduce.eager(differs, "sum", group=group).item())
    if count:
        raise CollectiveMismatchError(
            f"backward of {op}(objective='replicated') on rank {group.rank}: {count} of "
            f"{group.size} ranks back-propagate a gradient that differs from rank 0's; "
            "'replicated' requires every rank to compute the same loss from the same output. "
            "Use objective='sum' when each rank's loss differs"
        )
