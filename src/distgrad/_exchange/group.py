"""Which processes take part in a collective: the group, this process's rank in it, its size.

``group=None`` means the default (world) group. When no process group has been initialised, the
"group" is this process alone (size 1, rank 0): every collective then reduces to its
single-process meaning, which is what lets one function run both distributed and as its own
single-process reference.

Ranks named in arguments (``src``, ``dst``, ``perm``) are *group ranks*, 0 to size-1 within the
group, never global ranks; ``global_rank`` translates them for the raw torch calls.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from distgrad import _mesh
from distgrad._exchange import alive as _alive
from distgrad.errors import CollectiveArgumentError

__all__ = [
    "Group",
    "ProcessGroup",
    "first_row",
    "forget_destroyed",
    "is_rank",
    "on_forget",
    "own_rows",
    "resolve",
]

ProcessGroup = dist.ProcessGroup


@dataclass(frozen=True)
class Group:
    """A resolved process group; ``pg`` is None when this process runs alone."""

    pg: ProcessGroup | None
    rank: int
    size: int
    backend: str = "none"
    # The name torch registers the group under: how torch's functional collectives take it.
    name: str = ""
    # Which distgrad call on this group an op's plan came from, so debug mode can check that
    # every rank's backward answers the same forward call.
    call: int = -1
    # The global rank of each group rank (empty when alone): read once, not per message.
    members: tuple[int, ...] = ()
    # Whether the backend is NCCL: read several times per exchange, so made once here.
    is_nccl: bool = field(init=False, repr=False, compare=False)
    # Whether the rank is per-rank data, not a Python int: under ``simulate=True``
    # (``distgrad.testing``) one process stands for every rank, and its rank is one SymInt
    # holding each rank's value. Exchanges then take their functional form (the collectives
    # LocalTensorMode runs with each rank's sizes), and code that needs a rank's rows writes
    # them as arithmetic on the rank (first_row, own_rows, is_rank).
    rank_is_data: bool = field(init=False, repr=False, compare=False)
    # The group's identity as per-group state is keyed (the ProcessGroup's id and its name: a
    # ProcessGroup takes no attributes and no weak references; the name guards against a reused
    # id), made once here rather than on every call that counts or notes one.
    key: tuple[int, str] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "is_nccl", "nccl" in self.backend)
        object.__setattr__(self, "rank_is_data", not isinstance(self.rank, int))
        object.__setattr__(self, "key", (id(self.pg), self.name))

    def global_rank(self, group_rank: int) -> int:
        """The global rank of the process with rank ``group_rank`` in this group."""
        if self.pg is None:
            return group_rank
        return self.members[group_rank]


def first_row(counts: Sequence[int], rank: int) -> int:
    """``sum(counts[:rank])``: rank ``rank``'s first row when rank r holds ``counts[r]``.

    Written as arithmetic on the rank, never as an index or a branch, when the rank is not a
    Python int: under ``simulate=True`` (``distgrad.testing``) it is one per-rank value (a
    SymInt holding every rank's), and arithmetic keeps it one, so every rank's offset comes
    out of one Python run, where an index would pick one rank's value for all."""
    if isinstance(rank, int):
        return sum(counts[:rank])
    return sum(c * _at_least(rank, i + 1) for i, c in enumerate(counts))


def own_rows(counts: Sequence[int], rank: int) -> int:
    """``counts[rank]``, written as :func:`first_row` writes it."""
    if isinstance(rank, int):
        return counts[rank]
    if all(c == counts[0] for c in counts):  # even: a plain int, the same for every rank
        return counts[0]
    return sum(c * is_rank(rank, i) for i, c in enumerate(counts))


def is_rank(rank: int, i: int) -> int:
    """1 where ``rank == i``, else 0, written as :func:`first_row` writes it."""
    if isinstance(rank, int):
        return int(rank == i)
    return _at_least(rank, i) - _at_least(rank, i + 1)  # type: ignore[no-any-return]


def _at_least(rank: Any, i: int) -> Any:
    """1 where ``rank >= i``, else 0, as arithmetic (no comparison: see first_row)."""
    return torch.sym_min(torch.sym_max(rank - i + 1, 0), 1)  # type: ignore[no-untyped-call]


_ALONE = Group(pg=None, rank=0, size=1)

# Resolved groups by the ProcessGroup object's id and name (a ProcessGroup takes no attributes
# and no weak references; the name guards against a reused id): resolving costs four torch calls,
# a lookup costs one dictionary access on every collective's hot path.
_resolved: dict[tuple[int, str], Group] = {}


def resolve(group: object, op: str = "collective") -> Group:
    """Resolve ``group`` (None for the default group) for this process.

    ``group`` may also be a 1-D DeviceMesh or a ``(mesh, dim)`` pair (``distgrad._mesh``).
    ``op`` names the calling op in the error raised when ``group`` is none of these.
    """
    if group is None:
        if not (dist.is_available() and dist.is_initialized()):
            return _ALONE
        group = dist.group.WORLD
    if group is dist.GroupMember.NON_GROUP_MEMBER:  # what new_group returns to non-members
        raise CollectiveArgumentError(_NOT_A_MEMBER.format(rank=dist.get_rank()))
    if not isinstance(group, ProcessGroup):
        group = _mesh.process_group(group, op)  # a mesh form, or an error naming every form
    if torch.compiler.is_compiling():
        return _describe_traced(group)
    key = (id(group), group.group_name)
    found = _resolved.get(key)
    if found is None:
        forget_destroyed()  # a group destroyed without distgrad's wrapper seeing it
        found = _resolved[key] = _describe(group)
        if found.size > 1:
            _alive.publish()  # before any peer may need to know whether this process lives
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
        members=tuple(dist.get_process_group_ranks(pg)),
    )


# Inside torch.compile the description is made by running _describe, not by tracing it, and
# kept as a constant of the graph: traced, its torch calls left ~40 guards on torch.distributed's
# functions and state to check on every call of the compiled step.
_describe_traced: Callable[[ProcessGroup], Group] = torch._dynamo.assume_constant_result(  # type: ignore[no-untyped-call]
    _describe
)


_NOT_A_MEMBER = (
    "this process (global rank {rank}) is not a member of the group it passed; every rank "
    "that calls a collective must belong to its group"
)


# ---------------------------------------------------------------------------------------------
# Forgetting destroyed groups. Everything distgrad keeps per group (this cache, call counters,
# what a rank last did) is dropped when the group is destroyed: a new group must start afresh
# even if it gets the old one's name (torch numbers groups from 0 again after the default group
# is destroyed), and the cache must not keep a destroyed group's connections open.

ForgetHook = Callable[[list[Group], bool], None]
"""Called with the groups forgotten and whether the default group was among them."""

_forget_hooks: list[ForgetHook] = []


def on_forget(hook: ForgetHook) -> None:
    """Have ``hook`` drop its own state of groups as they are forgotten."""
    _forget_hooks.append(hook)


def _live_groups() -> Any:
    return dist.distributed_c10d._world.pg_map


def forget_destroyed() -> None:
    """Forget every group torch no longer knows (destroyed), with every hook's state of it."""
    if not _resolved:
        return
    live = _live_groups() if dist.is_available() else {}
    gone = [key for key, group in _resolved.items() if group.pg not in live]
    if gone:
        # The default group went if there is none, or if a forgotten group bore the name of
        # the one there is now (a re-initialised world: torch names groups from "0" again).
        world = dist.group.WORLD if dist.is_initialized() else None
        world_gone = world is None or any(_resolved[k].name == world.group_name for k in gone)
        _forget([_resolved.pop(key) for key in gone], world_gone)


def _forget(groups: list[Group], world_gone: bool) -> None:
    if world_gone:
        _alive.forget()
    for hook in _forget_hooks:
        hook(groups, world_gone)


def settle_backend_threads() -> None:
    """Give the backend's worker threads the GIL for a moment, so that they finish releasing
    the works they hold before the last reference to their group goes.

    While a backward runs, torch's autograd engine keeps a Python object (the caller's
    contextvars) in the thread-local state, and every collective started then captures it in
    its work: distgrad's own (which it starts without it,
    ``inflight.start_outside_engine``) and DDP's bucket
    all-reduces, started from its gradient hooks. gloo's worker thread drops the last reference
    to a finished work, and releasing that object takes the GIL. If the thread holding the GIL
    drops the group's last reference meanwhile (``destroy_process_group``, or a DDP module
    freed after it, whose reducer holds the group), the group's destructor joins the worker
    while the worker waits for the GIL: the process hangs at exit (seen in gdb on a hung
    torchrun worker: ``~ProcessGroupGloo`` in ``thread::join``, the worker in
    ``~AsyncAllreduceWork`` taking the GIL), or aborts if the interpreter is finalising. A
    worker asks for the GIL within microseconds of the work's end unless the machine is
    overloaded; 50 ms covers that, once per job (at the default group's destruction and at
    exit), not per call. A race this narrows but cannot close: the fix belongs in torch.
    """
    global _unsettled
    time.sleep(_SETTLE_S)
    _unsettled = False


def note_collective() -> None:
    """Record that distgrad started a collective (its work may outlive the call)."""
    global _unsettled
    _unsettled = True


def collectives_unsettled() -> bool:
    """Whether distgrad started a collective since the backend's threads were last settled."""
    return _unsettled


_SETTLE_S = 0.05
_unsettled = False


def _wrap_destroy() -> None:
    """Make ``torch.distributed.destroy_process_group`` forget what distgrad kept of the group,
    so that once it returns nothing of distgrad's refers to that group. (A caller holding
    torch's function from before distgrad's import still gets the same effect later: a new
    group's first call forgets destroyed ones, :func:`forget_destroyed`.)"""
    c10d = dist.distributed_c10d
    original = c10d.destroy_process_group
    if getattr(original, "_distgrad_wrapped", False):
        return

    @functools.wraps(original)
    def destroy_process_group(group: ProcessGroup | None = None) -> None:
        if dist.is_initialized() and (group is None or group is dist.group.WORLD):
            settle_backend_threads()
        try:
            original(group)
        finally:
            forget_destroyed()
            if group is None:
                _forget([], True)  # the default group went, whatever distgrad had seen

    destroy_process_group._distgrad_wrapped = True  # type: ignore[attr-defined]
    c10d.destroy_process_group = destroy_process_group
    if getattr(dist, "destroy_process_group", None) is original:
        dist.destroy_process_group = destroy_process_group


if dist.is_available():
    _wrap_destroy()
