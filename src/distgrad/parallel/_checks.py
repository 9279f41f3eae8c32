"""What every pattern checks at its door: its group (any form of ``group=``), DTensors, and the
wording of its argument errors (``<op> on rank <r>: <problem>``, a CollectiveArgumentError)."""

from __future__ import annotations

import torch.distributed as dist

from distgrad._exchange.group import ProcessGroup
from distgrad._mesh import GroupLike, process_group, refuse_dtensors
from distgrad.errors import CollectiveArgumentError

__all__ = ["as_process_group", "refuse", "refuse_dtensors"]


def as_process_group(group: GroupLike, op: str) -> ProcessGroup | None:
    """The ``ProcessGroup`` a module keeps for ``group`` (None stays None: the default group
    when the module runs), so that ``module.group`` is the group whatever form named it."""
    if group is None or isinstance(group, ProcessGroup):
        return group
    return process_group(group, op)


def refuse(op: str, problem: str) -> CollectiveArgumentError:
    """The error for ``problem`` with this rank's arguments to ``op``."""
    rank = dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
    return CollectiveArgumentError(f"{op} on rank {rank}: {problem}")
