"""The metadata handshake that runs before every collective's data moves.

Each rank describes its call in one small int64 vector (which op, whether debug mode is on,
dtype, device type, requires_grad, shape, the op's integer arguments, whether its own
arguments are invalid, and how many distgrad calls it has made on this group before); one
``all_gather`` of these vectors lets every rank check every other rank's call. Bad input then
becomes the same Python error on every rank instead of a hang, a process abort inside gloo, or a
silently wrong result (the call count catches a rank that skipped a call even when its next call
looks like the one its peers make), and the ops learn the per-rank sizes they need (uneven
all_gather, gather, all_to_all) from the same exchange.

Cost: one all_gather of ``_WIDTH`` int64 per rank, per forward call (tens of microseconds on
loopback gloo; see ``docs/semantics.md`` for the measurement). Debug mode
(:func:`distgrad.set_debug`) adds a second handshake in every backward that checks all ranks run
their backward collectives in the same order.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from distgrad import _comm
from distgrad._group import Group
from distgrad.errors import CollectiveArgumentError, CollectiveMismatchError

__all__ = ["RankCall", "debug_enabled", "exchange", "require_same", "set_debug"]

_MAGIC = 0x6469737467726164 & 0x7FFFFFFFFFFFFFFF  # "distgrad"
_MAX_DIMS = 12
_MAX_ARGS = 10
_HEADER = 9  # magic, op, debug, problem, has_tensor, dtype, device, requires_grad, call
_WIDTH = _HEADER + 1 + _MAX_DIMS + 1 + _MAX_ARGS

_OPS = (
    "all_gather",
    "reduce_scatter",
    "all_reduce",
    "all_to_all",
    "broadcast",
    "reduce",
    "gather",
    "scatter",
    "permute",
    "backward",
    "loss",
)
_DTYPES = (
    torch.float32,
    torch.float64,
    torch.float16,
    torch.bfloat16,
    torch.complex64,
    torch.complex128,
    torch.int8,
    torch.uint8,
    torch.int16,
    torch.int32,
    torch.int64,
    torch.bool,
)
_DEVICES = ("cpu", "cuda", "xpu", "mps", "meta")

_debug = os.environ.get("DISTGRAD_DEBUG", "") not in ("", "0")

# How many distgrad calls this process has made on each group, keyed by the group object's id
# and name (a ProcessGroup takes no attributes and no weak references; the name guards against
# a reused id). Every rank of a group counts the same calls, so a difference means a rank
# skipped a call or made an extra one.
_calls: dict[tuple[int, str], int] = {}


def _call_key(group: Group) -> tuple[int, str]:
    return (id(group.pg), str(getattr(group.pg, "group_name", "")))


def _next_call(group: Group) -> int:
    key = _call_key(group)
    count = _calls.get(key, 0)
    _calls[key] = count + 1
    return count


def set_debug(enabled: bool) -> None:
    """Turn debug checks on or off for this process (the default comes from ``DISTGRAD_DEBUG``).

    Debug mode adds, on top of the checks that always run, a handshake in every backward
    collective that verifies all ranks run their backward collectives in the same order (a rank
    whose loss uses the outputs in a different order can otherwise pair the wrong collectives),
    and, for ``objective="replicated"``, that every rank's incoming gradient is the same.
    Each costs one extra collective per backward call. Every rank must use the same setting.
    """
    global _debug
    _debug = bool(enabled)


def debug_enabled() -> bool:
    return _debug


@dataclass(frozen=True)
class RankCall:
    """What one rank passed to a collective."""

    rank: int
    op: str
    debug: bool
    has_tensor: bool
    dtype: torch.dtype | None
    device_type: str
    requires_grad: bool
    shape: tuple[int, ...]
    args: tuple[int, ...]
    call: int = 0  # how many distgrad calls this rank made on the group before this one


def _encode(
    op: str, x: Tensor | None, args: Sequence[int], problem: bool, call: int = 0
) -> list[int]:
    has = x is not None
    dtype = _DTYPES.index(x.dtype) if x is not None and x.dtype in _DTYPES else -1
    device = _DEVICES.index(x.device.type) if x is not None and x.device.type in _DEVICES else -1
    shape = list(x.shape) if x is not None else []
    vec = [_MAGIC, _OPS.index(op), int(_debug), int(problem), int(has), dtype, device]
    vec += [int(x is not None and x.requires_grad), call]
    vec += [len(shape), *shape, *[0] * (_MAX_DIMS - len(shape))]
    vec += [len(args), *args, *[0] * (_MAX_ARGS - len(args))]
    assert len(vec) == _WIDTH
    return vec


def _decode(rank: int, vec: list[int]) -> RankCall:
    ndim = vec[_HEADER]
    shape = tuple(vec[_HEADER + 1 : _HEADER + 1 + ndim])
    nargs = vec[_HEADER + 1 + _MAX_DIMS]
    args_at = _HEADER + 2 + _MAX_DIMS
    return RankCall(
        rank=rank,
        op=_OPS[vec[1]] if 0 <= vec[1] < len(_OPS) else f"<unknown op {vec[1]}>",
        debug=bool(vec[2]),
        has_tensor=bool(vec[4]),
        dtype=_DTYPES[vec[5]] if vec[5] >= 0 else None,
        device_type=_DEVICES[vec[6]] if vec[6] >= 0 else "other",
        requires_grad=bool(vec[7]),
        shape=shape,
        args=tuple(vec[args_at : args_at + nargs]),
        call=vec[8],
    )


def exchange(
    op: str,
    desc: str,
    group: Group,
    x: Tensor | None,
    args: Sequence[int] = (),
    problem: str | None = None,
) -> list[RankCall]:
    """Share this rank's call with the group and return every rank's, indexed by group rank.

    ``problem`` is this rank's own complaint about its arguments, found before the handshake;
    it is raised, with every other rank's complaint, on every rank. ``desc`` names the call in
    messages, e.g. ``"all_gather(dim=0)"``.
    """
    if problem is None and x is not None and x.dim() > _MAX_DIMS:
        problem = f"tensors of at most {_MAX_DIMS} dims are supported, got {x.dim()}"
    if problem is None and len(args) > _MAX_ARGS:
        raise AssertionError(f"{op}: too many handshake arguments")
    if group.pg is None or group.size == 1:
        if problem is not None:
            raise CollectiveArgumentError(f"{desc} on rank {group.rank}: {problem}")
        return [_decode(group.rank, _encode(op, x, args, False))]
    call = _next_call(group)
    mine = torch.tensor(
        _encode(op, None if problem else x, args if not problem else (), problem is not None, call),
        dtype=torch.int64,
        device=_comm.metadata_device(group),
    )
    try:
        every = _comm.all_gather(mine.view(1, _WIDTH), [1] * group.size, group)
    except RuntimeError as exc:
        # Typically a peer exited, crashed or never made this call: say where we were waiting.
        exc.args = (
            f"{exc.args[0] if exc.args else exc}\n[distgrad] rank {group.rank} was waiting for "
            f"its peers at the start of {desc}: a peer skipped this call, failed or exited early",
            *exc.args[1:],
        )
        raise

    rows = every.view(group.size, _WIDTH).tolist()
    calls = [_decode(rank, row) for rank, row in enumerate(rows)]
    _check_same_call(desc, group, calls, rows)
    if any(row[3] for row in rows):
        _raise_problems(desc, group, problem)
    return calls


def _check_same_call(desc: str, group: Group, calls: list[RankCall], rows: list[list[int]]) -> None:
    if any(row[0] != _MAGIC for row in rows):
        raise CollectiveMismatchError(
            f"{desc} on rank {group.rank}: some ranks are not inside a distgrad collective at "
            "this point (they called a raw torch.distributed collective or another library); "
            "every rank must make the same sequence of calls"
        )
    if any(c.call != calls[0].call for c in calls):
        # Resynchronise first, so that the group stays usable if the caller handles the error.
        _calls[_call_key(group)] = max(c.call for c in calls) + 1
        listing = describe_ranks(calls, lambda c: f"its call {c.call + 1}, {c.op}")
        raise CollectiveMismatchError(
            f"{desc} on rank {group.rank}: ranks are at different distgrad calls on this group "
            f"({listing}); a rank skipped a call or made an extra one, and every rank must make "
            "the same sequence of calls"
        )
    require_same(
        desc,
        group,
        calls,
        "which collective they called",
        lambda c: c.op,
        "every rank must call the same collectives in the same order",
    )
    require_same(
        desc,
        group,
        calls,
        "debug mode",
        lambda c: c.debug,
        "call distgrad.set_debug() with the same value on every rank",
    )


def _raise_problems(desc: str, group: Group, problem: str | None) -> None:
    problems: list[Any] = [None] * group.size
    dist.all_gather_object(problems, problem, group=group.pg)
    lines = [f"rank {rank}: {text}" for rank, text in enumerate(problems) if text is not None]
    raise CollectiveArgumentError(
        f"{desc} on rank {group.rank}: invalid arguments; " + "; ".join(lines)
    )


def describe_ranks(calls: Sequence[RankCall], key: Callable[[RankCall], object]) -> str:
    """'rank 0: a; ranks 1, 2: b' - each distinct value once, with the ranks that passed it."""
    groups: dict[str, list[int]] = {}
    for call in calls:
        groups.setdefault(_show(key(call)), []).append(call.rank)
    parts = []
    for value, ranks in groups.items():
        who = f"rank {ranks[0]}" if len(ranks) == 1 else "ranks " + ", ".join(map(str, ranks))
        parts.append(f"{who}: {value}")
    return "; ".join(parts)


def _show(value: object) -> str:
    if isinstance(value, tuple):
        return "(" + ", ".join(map(str, value)) + ("," if len(value) == 1 else "") + ")"
    return str(value)


def require_same(
    desc: str,
    group: Group,
    calls: Sequence[RankCall],
    what: str,
    key: Callable[[RankCall], object],
    rule: str,
    shown: Callable[[RankCall], object] | None = None,
) -> None:
    """Raise on every rank unless ``key`` gives the same value for every rank's call.

    The message lists each rank's ``shown`` value (default: ``key``'s).
    """
    first = key(calls[0])
    if all(key(call) == first for call in calls[1:]):
        return
    listing = describe_ranks(calls, shown or key)
    raise CollectiveMismatchError(
        f"{desc} on rank {group.rank}: ranks disagree on {what} ({listing}); {rule}"
    )
