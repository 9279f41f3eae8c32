"""Which processes take part in a collective: the group, this process's rank in it, its size.

``group=None`` means the default (world) group. When no process group has been initialised, the
"group" is this process alone (size 1, rank 0): every collective then reduces to its
single-process meaning, which is what lets one function run both distributed and as its own
single-process reference.

Ranks named in arguments (``src``, ``dst``, ``perm``) are *group ranks*, 0 to size-1 within the
group, never global ranks; ``global_rank`` translates them for the raw torch calls.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch.distributed as dist

__all__ = ["Group", "resolve"]

ProcessGroup = dist.ProcessGroup


@dataclass(frozen=True)
class Group:
    """A resolved process group; ``pg`` is None when this process runs alone."""

    pg: ProcessGroup | None
    rank: int
    size: int
    # Which distgrad call on this group an op's plan came from (its handshake's call count), so
    # debug mode can check that every rank's backward answers the same forward call.
    call: int = -1

    def global_rank(self, group_rank: int) -> int:
        """The global rank of the process with rank ``group_rank`` in this group."""
        if self.pg is None:
            return group_rank
        return dist.get_global_rank(self.pg, group_rank)

    @property
    def backend(self) -> str:
        return "none" if self.pg is None else str(dist.get_backend(self.pg))


def resolve(group: ProcessGroup | None) -> Group:
    """Resolve ``group`` (None for the default group) for this process."""
    if group is None:
        if not (dist.is_available() and dist.is_initialized()):
            return Group(pg=None, rank=0, size=1)
        group = dist.group.WORLD
        assert group is not None
    rank = dist.get_rank(group)
    if rank < 0:
        raise ValueError(
            f"this process (global rank {dist.get_rank()}) is not a member of the group it "
            "passed; every rank that calls a collective must belong to its group"
        )
    return Group(pg=group, rank=rank, size=dist.get_world_size(group))
