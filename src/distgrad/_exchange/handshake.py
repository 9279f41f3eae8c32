"""The metadata handshake: how the ranks of a group learn what call each of them is making.

Each rank describes its call in one int64 vector (which op, debug mode, dtype, device type,
requires_grad, grad mode, shape, the op's integer arguments and up to two integer lists such as
``sizes``, whether its own arguments are invalid, and in debug mode a checksum of the Python
stack that made the call); one ``all_gather`` of these vectors lets every rank check every other
rank's call. Bad input then becomes the same Python error on every rank instead of a hang, a
process abort inside gloo, or a silently wrong result, and ops whose sizes are not known locally
(an uneven ``all_gather`` without ``sizes=``) learn them from the same exchange.

*When* a call exchanges metadata is decided by ``distgrad.collectives._signature``: the first
calls on each group, every call in debug mode, and calls whose sizes are unknown. This module
only knows how.

Every metadata message on a group has the same width, so that when a rank skipped a call and
its peers' handshake meets a different kind of metadata message, each rank still reads the
other's and raises, where two sizes would make gloo abort the process.

Cost: one all_gather of ``35 + 2 (max(N, 12) + 1)`` int64 per rank (61 at N <= 12) and a copy of
the result to the host: latency-bound, 0.3-0.4 ms alone on 2 gloo ranks over loopback and
0.6-0.9 ms as the first exchange of a training step (docs/semantics.md).
"""

from __future__ import annotations

import os
import sys
import zlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from types import CodeType
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from distgrad._exchange.backend import ALL_GATHER_OPTIONS, all_gather_single, metadata_device
from distgrad._exchange.group import Group
from distgrad._exchange.inflight import begin
from distgrad.errors import CollectiveArgumentError, CollectiveMismatchError

__all__ = [
    "RankCall",
    "debug_enabled",
    "describe_ranks",
    "dtype_name",
    "dtype_problem",
    "exchange",
    "message_width",
    "named",
    "require_same",
    "set_debug",
    "share",
    "show",
]

_MAGIC = 0x6469737467726164 & 0x7FFFFFFFFFFFFFFF  # "distgrad"
_MAX_DIMS = 12
_MAX_ARGS = 10
_HEADER = 12  # magic, op, debug, problem, has_tensor, dtype, device, requires_grad, grad mode,
#               call, site, number of args
_SHAPE_AT = _HEADER  # ndim, then _MAX_DIMS entries
_ARGS_AT = _SHAPE_AT + 1 + _MAX_DIMS
_LISTS_AT = _ARGS_AT + _MAX_ARGS
_LISTS = 2


def _list_width(group_size: int) -> int:
    """One list slot: its length plus one (0: absent), then room for N sizes or a shape."""
    return 1 + max(group_size, _MAX_DIMS)


def message_width(group_size: int) -> int:
    """The width of every metadata message on a group of ``group_size`` ranks."""
    return _LISTS_AT + _LISTS * _list_width(group_size)


def _code(name: str) -> int:
    """A stable small integer for a name: crc32, the same in every process (hash() is not)."""
    return zlib.crc32(name.encode()) & 0x7FFFFFFF


# Every dtype torch has travels by a checksum of its name, so no dtype is ever reinterpreted as
# another: a float8 variant against another, uint16 against uint32 (each an error, named).
_DTYPES = {
    _code(str(value)): value
    for value in (getattr(torch, name) for name in dir(torch))
    if isinstance(value, torch.dtype)
}
_NO_DTYPE = -1

# The dtypes no collective can carry, and why; every other dtype torch has is carried as its
# bytes (bool, complex, float8, float4, bits and unsigned types included: tests/collectives/
# test_dtypes.py walks them all). Sub-byte integers have no copy kernel ("copy_kernel" not
# implemented for 'UInt1'), so a send fails on one rank and leaves its peer waiting; quantized
# tensors carry a scale and zero point besides their bytes, which the backends do not send.
_SUB_BYTE = frozenset(f"torch.{kind}{bits}" for kind in ("int", "uint") for bits in range(1, 8))


def dtype_problem(dtype: torch.dtype) -> str | None:
    """Why no collective carries ``dtype``, or None when every one does."""
    # Asked twice per call on the hot path: a dict lookup, not a str() and two scans.
    try:
        return _dtype_problems[dtype]
    except KeyError:
        found = _dtype_problems[dtype] = _find_dtype_problem(dtype)
        return found


_dtype_problems: dict[torch.dtype, str | None] = {}


def _find_dtype_problem(dtype: torch.dtype) -> str | None:
    name = str(dtype)
    if name in _SUB_BYTE:
        return (
            f"x must have a dtype a collective can send, got {name}: torch has no kernel that "
            "copies sub-byte integer tensors; pack the values into torch.uint8 and send that"
        )
    if name.startswith(("torch.qint", "torch.quint")):
        return (
            f"x must have a dtype a collective can send, got {name}: a quantized tensor's scale "
            "and zero point do not travel with its bytes; send x.int_repr() (and the "
            "quantization parameters) or x.dequantize()"
        )
    return None


def _env_debug() -> bool:
    if os.environ.get("DISTGRAD_DEBUG", "") not in ("", "0"):
        return True
    return os.environ.get("TORCH_DISTRIBUTED_DEBUG", "").upper() == "DETAIL"


_debug = _env_debug()


def set_debug(enabled: bool) -> None:
    """Turn debug mode on or off for this process.

    The default comes from the environment: ``DISTGRAD_DEBUG=1``, or
    ``TORCH_DISTRIBUTED_DEBUG=DETAIL`` (torch's own debug level for collectives).

    Outside debug mode, distgrad checks the first calls on each group across ranks (every
    rank's shapes, dtypes and arguments, before any data moves) and then trusts the ranks to
    keep making matching calls, so that a training step sends nothing but its data. Debug mode
    checks *every* call that way, and adds:

    * a handshake in every backward collective that verifies all ranks run their backward
      collectives in the same order (a rank whose loss uses the outputs in a different order
      could otherwise pair the wrong collectives);
    * for ``objective="replicated"``, a check that every rank's incoming gradient is the same;
    * a comparison of the Python stacks that made each call, which catches a rank that skipped
      a call at once, even through a shared helper (ranks that legitimately call from
      different places must leave debug mode off).

    Each check costs one small collective. Every rank must use the same setting.

    Args:
        enabled: ``True`` to check every call across ranks, ``False`` for the default (the first
            calls on each group only).

    Returns:
        None.

    Raises:
        Nothing itself; in debug mode every call raises ``CollectiveMismatchError`` on every rank
        when the ranks' calls do not match (another op, shape, order or calling line).

    Example:
        >>> dg.set_debug(True)  # from here every call is checked across ranks
        >>> dg.all_reduce(torch.ones(2))
        tensor([1., 1.])
        >>> dg.set_debug(False)
    """
    global _debug
    _debug = bool(enabled)


def debug_enabled() -> bool:
    return _debug


@dataclass(frozen=True)
class RankCall:
    """What one rank passed to a collective, as every rank sees it after the exchange."""

    rank: int
    op: str
    debug: bool
    has_tensor: bool
    dtype: torch.dtype | None
    device_type: str
    requires_grad: bool
    grad_mode: bool
    shape: tuple[int, ...]
    args: tuple[int, ...]
    lists: tuple[tuple[int, ...] | None, ...]
    call: int = 0  # how many distgrad calls this rank made on the group before this one
    site: int = 0  # debug mode: a checksum of the stack that made the call


# The names behind the op and device codes, so that a peer's code can be shown as a name.
_NAMES: dict[int, str] = {}


def named(name: str) -> int:
    """The code of an op or device name, remembered so that a peer's code can be shown by name.

    Ops register their names when they are defined, so a rank can name a peer's op it has not
    called itself.
    """
    code = _code(name)
    _NAMES[code] = name
    return code


for _device in ("cpu", "cuda", "xpu", "mps", "meta", "hpu", "mtia", "privateuseone"):
    named(_device)
named("backward")


def _encode(
    op: str,
    x: Tensor | None,
    args: Sequence[int],
    lists: Sequence[Sequence[int] | None],
    problem: bool,
    call: int,
    site: int,
    group_size: int,
) -> list[int]:
    vec = [_MAGIC, named(op), int(_debug), int(problem), int(x is not None)]
    if x is None:
        vec += [_NO_DTYPE, _NO_DTYPE, 0]
        shape: list[int] = []
    else:
        vec += [_code(str(x.dtype)), named(x.device.type), int(x.requires_grad)]
        shape = list(x.shape)
    vec += [int(torch.is_grad_enabled()), call, site, len(args)]
    vec += [len(shape), *shape, *[0] * (_MAX_DIMS - len(shape))]
    vec += [*args, *[0] * (_MAX_ARGS - len(args))]
    slot = _list_width(group_size)
    for values in [*lists, *[None] * (_LISTS - len(lists))]:
        if values is None:
            vec += [0] * slot
        else:
            vec += [len(values) + 1, *values, *[0] * (slot - 1 - len(values))]
    assert len(vec) == message_width(group_size)
    return vec


def _decode(rank: int, vec: list[int], group_size: int) -> RankCall:
    ndim = vec[_SHAPE_AT]
    lists: list[tuple[int, ...] | None] = []
    slot = _list_width(group_size)
    for i in range(_LISTS):
        at = _LISTS_AT + i * slot
        lists.append(tuple(vec[at + 1 : at + vec[at]]) if vec[at] else None)
    has_tensor = bool(vec[4])
    return RankCall(
        rank=rank,
        op=_NAMES.get(vec[1], f"<unknown op {vec[1]}>"),
        debug=bool(vec[2]),
        has_tensor=has_tensor,
        dtype=_DTYPES.get(vec[5]) if has_tensor else None,
        device_type=_NAMES.get(vec[6], "<unknown device type>") if has_tensor else "",
        requires_grad=bool(vec[7]),
        grad_mode=bool(vec[8]),
        call=vec[9],
        site=vec[10],
        shape=tuple(vec[_SHAPE_AT + 1 : _SHAPE_AT + 1 + ndim]),
        args=tuple(vec[_ARGS_AT : _ARGS_AT + vec[11]]),
        lists=tuple(lists),
    )


# Per code object: a checksum of its file and function name, or 0 for distgrad's own code.
_FRAME_CODES: dict[CodeType, int] = {}


def _stack_site() -> int:
    """A checksum of the caller's Python stack (each frame's file, function and line), without
    distgrad's own frames: the same in every process for the same stack.

    Names are checksummed once per code object, so a frame costs a dict lookup and a multiply:
    0.2 us a frame, where building and hashing the stack's text took 2 us (docs/semantics.md).
    """
    site = 0
    frame: Any = sys._getframe(1)
    while frame is not None:
        code = frame.f_code
        named_code = _FRAME_CODES.get(code)
        if named_code is None:
            module = frame.f_globals.get("__name__", "")
            ours = module == "distgrad" or module.startswith("distgrad.")
            named_code = 0 if ours else _code(f"{code.co_filename} in {code.co_name}") + 1
            _FRAME_CODES[code] = named_code
        if named_code:
            site = (site * 1_000_003 + named_code * 65_599 + frame.f_lasti) & _SITE_MASK
        frame = frame.f_back
    return site


_SITE_MASK = (1 << 62) - 1


def _user_stack() -> list[str]:
    """The caller's Python stack, innermost first, without distgrad's own frames."""
    frames = []
    frame: Any = sys._getframe(1)
    while frame is not None:
        module = frame.f_globals.get("__name__", "")
        if not (module == "distgrad" or module.startswith("distgrad.")):
            code = frame.f_code
            frames.append(f"{code.co_filename}:{frame.f_lineno} in {code.co_name}")
        frame = frame.f_back
    return frames


def exchange(
    op: str,
    desc: str,
    group: Group,
    x: Tensor | None,
    args: Sequence[int] = (),
    lists: Sequence[Sequence[int] | None] = (),
    problem: str | None = None,
    call: int = 0,
) -> list[RankCall]:
    """Share this rank's call with the group and return every rank's, indexed by group rank.

    ``problem`` is this rank's own complaint about its arguments, found before the handshake;
    it is raised, with every other rank's complaint, on every rank. ``desc`` names the call in
    messages, e.g. ``"all_gather(dim=0)"``. ``call`` is the call's number on the group.
    """
    assert len(args) <= _MAX_ARGS and len(lists) <= _LISTS, f"{op}: too much metadata"
    if problem is None and x is not None and x.dim() > _MAX_DIMS:
        problem = (
            f"x must have at most {_MAX_DIMS} dims, got {x.dim()} (the checked calls carry "
            "every shape whole; flatten some dims around the call, e.g. x.flatten(1, 2), and "
            "view the result back)"
        )
    longest = _list_width(group.size) - 1
    if problem is None and any(v is not None and len(v) > longest for v in lists):
        most = max(len(v) for v in lists if v is not None)
        problem = f"every list argument must have at most {longest} entries, got {most}"
    if problem is not None:
        x, args, lists = None, (), ()
    site = _stack_site() if _debug else 0
    mine = _encode(op, x, args, lists, problem is not None, call, site, group.size)
    if group.pg is None or group.size == 1:
        if problem is not None:
            raise CollectiveArgumentError(f"{desc} on rank {group.rank}: {problem}")
        return [_decode(group.rank, mine, 1)]
    # A peer that exited, crashed or never makes this call: the error says where we waited.
    rows = share(mine, group, desc)
    if any(row[0] != _MAGIC for row in rows):
        raise CollectiveMismatchError(
            f"{desc} on rank {group.rank}: some ranks are not inside a distgrad collective at "
            "this point (they called a raw torch.distributed collective or another library); "
            "every rank must make the same sequence of calls"
        )
    calls = [_decode(rank, row, group.size) for rank, row in enumerate(rows)]
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
    if _debug and any(c.site != calls[0].site for c in calls):
        _raise_stacks(desc, group, _user_stack())
    if any(row[3] for row in rows):
        _raise_problems(desc, group, problem)
    return calls


def _raise_stacks(desc: str, group: Group, stack: list[str]) -> None:
    stacks: list[Any] = [None] * group.size
    dist.all_gather_object(stacks, stack, group=group.pg)
    # Show the innermost frame where the stacks differ: a shared helper's own line is the same
    # on every rank, its caller's is not.
    depth = 0
    while all(depth < len(s) for s in stacks) and len({s[depth] for s in stacks}) == 1:
        depth += 1
    listing = "; ".join(
        f"rank {rank}: {s[depth] if depth < len(s) else '(a shallower stack)'}"
        for rank, s in enumerate(stacks)
    )
    where = "" if depth == 0 else f" (called through {stacks[0][0]})"
    raise CollectiveMismatchError(
        f"{desc} on rank {group.rank}: debug mode: ranks made this call from different places "
        f"({listing}){where}; a rank skipped a call or made an extra one (if your ranks "
        "legitimately call from different places, turn debug mode off)"
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
        groups.setdefault(show(key(call)), []).append(call.rank)
    parts = []
    for value, ranks in groups.items():
        who = f"rank {ranks[0]}" if len(ranks) == 1 else "ranks " + ", ".join(map(str, ranks))
        parts.append(f"{who}: {value}")
    return "; ".join(parts)


def show(value: object) -> str:
    """A value as messages show it: tuples as shapes, lists as lists."""
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


def dtype_name(dtype: torch.dtype | None) -> str:
    return "an unknown dtype" if dtype is None else str(dtype)


def share(values: Sequence[int], group: Group, desc: str = "a distgrad call") -> list[list[int]]:
    """Every rank's ``values`` (small integers, the same count on every rank), by group rank.

    A host synchronisation on NCCL (the result is read on the host): only metadata goes here.
    ``desc`` names the call whose metadata this is, in the error raised when a peer is gone.
    """
    if group.pg is None or group.size == 1:
        return [list(values)]
    device = metadata_device(group)
    if group.rank_is_data:  # values that differ between the ranks simulated (simulate=True):
        # made by torch from each rank's value, not by torch.tensor from one Python int
        each = [torch.full((), v, dtype=torch.int64, device=device) for v in values]
        mine = torch.stack(each)[None]
    else:
        mine = torch.tensor([list(values)], dtype=torch.int64, device=device)
    # A collective, not point-to-point pairs: pairs are faster alone (0.20 ms against 0.30 ms
    # on 2 ranks) but slower as the first exchange of a training step (1.0-1.8 ms against
    # 0.6-0.9 ms median, with more multi-millisecond stalls).
    every = mine.new_empty((group.size, len(values)))
    where = "forward" if torch._C._current_autograd_node() is None else "backward"
    what = f"the metadata handshake at the start of {desc}"
    doing = f"was waiting for its peers at the start of {desc}, in its {where}"
    if group.is_nccl:
        begin(group, all_gather_single, every, mine, group=group.pg, async_op=True).wait()
    else:
        start = group.pg._allgather_base
        begin(group, start, every, mine, ALL_GATHER_OPTIONS, what=what, doing=doing).wait()
    return every.tolist()  # type: ignore[no-any-return]
