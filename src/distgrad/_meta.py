"""The metadata handshake that runs before every collective's data moves.

Each rank describes its call in one small int64 vector (which op, whether debug mode is on,
dtype, device type, requires_grad, shape, the op's integer arguments, whether its own
arguments are invalid, and in debug mode where in the caller's code the call was made); one
``all_gather`` of these vectors lets every rank check every other rank's call. Bad input then
becomes the same Python error on every rank instead of a hang, a process abort inside gloo, or a
silently wrong result, and the ops learn the per-rank sizes they need (uneven all_gather,
gather, all_to_all) from the same exchange.

A rank that skips a call is caught at its next call that differs from its peers' (another op,
shape, dtype or argument), or, when every later call looks alike, by the peers' timeout at the
last call, which names the call they were waiting in. Debug mode also compares the call sites,
which catches the skip at once.

Cost: one all_gather of 48 int64 per rank, per forward call: latency-bound, 0.3-0.4 ms alone on
2 gloo ranks over loopback and 0.6-0.9 ms as the first exchange of a training step (see
``docs/semantics.md`` and ``benchmarks/results/collectives.md``). Debug mode
(:func:`distgrad.set_debug`) adds a second handshake in every backward that checks all ranks run
their backward collectives in the same order.
"""

from __future__ import annotations

import os
import sys
import zlib
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
_HEADER = 10  # magic, op, debug, problem, has_tensor, dtype, device, requires_grad, call, site
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
# a reused id). The handshake pairs every rank's i-th call, so the count names a call the same
# way on every rank: debug mode uses it to check that backwards answer the same forward call.
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
    Each costs one extra collective per backward call. It also compares, in every forward
    handshake, where in the caller's code each rank made the call, which catches a rank that
    skipped a call at once (ranks that legitimately call from different lines must leave debug
    mode off). Every rank must use the same setting.
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
    site: int = 0  # debug mode: a checksum of where in the caller's code the call was made


def _encode(
    op: str, x: Tensor | None, args: Sequence[int], problem: bool, call: int = 0, site: int = 0
) -> list[int]:
    has = x is not None
    dtype = _DTYPES.index(x.dtype) if x is not None and x.dtype in _DTYPES else -1
    device = _DEVICES.index(x.device.type) if x is not None and x.device.type in _DEVICES else -1
    shape = list(x.shape) if x is not None else []
    vec = [_MAGIC, _OPS.index(op), int(_debug), int(problem), int(has), dtype, device]
    vec += [int(x is not None and x.requires_grad), call, site]
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
        site=vec[9],
    )


def _call_site() -> str:
    """Where the user's code called distgrad: the first frame outside the distgrad package."""
    frame = sys._getframe(1)
    while frame.f_back is not None and frame.f_globals.get("__name__", "").startswith("distgrad"):
        frame = frame.f_back
    return f"{frame.f_code.co_filename}:{frame.f_lineno} in {frame.f_code.co_name}"


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
    site = _call_site() if _debug else ""
    mine = _encode(
        op,
        None if problem else x,
        args if not problem else (),
        problem is not None,
        call,
        zlib.crc32(site.encode()),
    )
    try:
        rows = _comm.share(mine, group)
    except RuntimeError as exc:
        # Typically a peer exited, crashed or never made this call: say where we were waiting.
        exc.args = (
            f"{exc.args[0] if exc.args else exc}\n[distgrad] rank {group.rank} was waiting for "
            f"its peers at the start of {desc}: a peer skipped this call, failed or exited early",
            *exc.args[1:],
        )
        raise

    calls = [_decode(rank, row) for rank, row in enumerate(rows)]
    _check_same_call(desc, group, calls, rows)
    if _debug and any(c.site != calls[0].site for c in calls):
        _raise_sites(desc, group, site)
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
    # Each rank's i-th handshake meets its peers' i-th: the counts agree by construction.
    assert all(c.call == calls[0].call for c in calls), "distgrad call counts diverged"
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


def _raise_sites(desc: str, group: Group, site: str) -> None:
    sites: list[Any] = [None] * group.size
    dist.all_gather_object(sites, site, group=group.pg)
    listing = "; ".join(f"rank {rank}: {where}" for rank, where in enumerate(sites))
    raise CollectiveMismatchError(
        f"{desc} on rank {group.rank}: debug mode: ranks made this call from different places "
        f"({listing}); a rank skipped a call or made an extra one (if your ranks legitimately "
        "call from different lines, turn debug mode off)"
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
