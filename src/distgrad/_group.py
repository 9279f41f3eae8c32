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

import torch
import torch.distributed as dist

from distgrad.errors import CollectiveArgumentError

__all__ = ["Group", "ProcessGroup", "resolve"]

ProcessGroup = dist.ProcessGroup


@dataclass(frozen=True)
class Group:
    """A resolved process group; ``pg`` is None when this process runs alone."""

    pg: ProcessGroup | None
    rank: int
    size: int
    backend: str = "none"
    # The name torch registers the group under: how torch.compile's custom ops find it again.
    name: str = ""
    # Which distgrad call on this group an op's plan came from, so debug mode can check that
    # every rank's backward answers the same forward call.
    call: int = -1

    def global_rank(self, group_rank: int) -> int:
        """The global rank of the process with rank ``group_rank`` in this group."""
        if self.pg is None:
            return group_rank
        return dist.get_global_rank(self.pg, group_rank)

    @property
    def is_nccl(self) -> bool:
        return "nccl" in self.backend


_ALONE = Group(pg=None, rank=0, size=1)

# Resolved groups by the ProcessGroup object's id and name (a ProcessGroup takes no attributes
# and no weak references; the name guards against a reused id): resolving costs four torch calls,
# a lookup costs one dictionary access on every collective's hot path.
_resolved: dict[tuple[int, str], Group] = {}


def resolve(group: object, op: str = "collective") -> Group:
    """Resolve ``group`` (None for the default group) for this process.

    ``op`` names the calling op in the error raised when ``group`` is not a process group.
    """
    if group is None:
        if not (dist.is_available() and dist.is_initialized()):
            return _ALONE
        group = dist.group.WORLD
    if group is dist.GroupMember.NON_GROUP_MEMBER:  # what new_group returns to non-members
        raise CollectiveArgumentError(_NOT_A_MEMBER.format(rank=dist.get_rank()))
    if not isinstance(group, ProcessGroup):
        raise CollectiveArgumentError(_not_a_group(group, op))
    if torch.compiler.is_compiling():
        # Traced once; torch.compile folds these calls into constants.
        return _describe(group)
    key = (id(group), group.group_name)
    found = _resolved.get(key)
    if found is None:
        found = _resolved[key] = _describe(group)
    return found


def _describe(pg: ProcessGroup) -> Group:
    rank = dist.get_rank(pg)
    if rank < 0:
        raise CollectiveArgumentError(_NOT_A_MEMBER.format(rank=dist.get_rank()))
    return Group(
        pg=pg,
        rank=rank,
        size=dist.get_world_size(pg),
        backend=str(dist.get_backend(pg)),
        name=pg.group_name,
    )


_NOT_A_MEMBER = (
    "this process (global rank {rank}) is not a member of the group it passed; every rank "
    "that calls a collective must belong to its group"
)


def _not_a_group(group: object, op: str) -> str:
    shown = f"{type(group).__name__} {group!r}"
    hint = ""
    if isinstance(group, int):
        hint = (
            f"; group is {op}'s second positional argument (as in torch.distributed): to pick a "
            f"dim, pass dim={group}"
        )
    elif isinstance(group, list | tuple):
        hint = f"; make a group of these ranks with torch.distributed.new_group({list(group)!r})"
    return f"{op}: group must be a torch.distributed ProcessGroup or None, got {shown}{hint}"
