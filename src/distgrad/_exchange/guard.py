"""The guard that rides in the data: mismatched calls past the checked ones, caught in the bytes.

Past the checked calls (``collectives._signature``) the ranks exchange nothing but their data,
so a rank that makes another call than its peers (another shape, dtype or argument) goes unseen
by distgrad. The guard (opt-in: :func:`set_guard`) appends a few tag elements to the buffer an
exchange moves anyway. The tag is a checksum of what every rank must agree on (the exchange,
its shape and dtype, its arguments), and is read back where the result is:

* reductions (``all_reduce`` sum/max/min, ``reduce``) carry tags that reduce to a known value
  only when every rank's tag is the same. For a sum, each of four 4-bit digits ``d`` travels
  as ``d`` and ``d**2``: the sums equal ``N d`` and ``N d**2`` for this rank's ``d`` exactly
  when every rank's digit is ``d`` (the spread ``sum((d_i - d)**2)`` is then 0). Exact in
  float32 up to 65,535 ranks (``N * 256 < 2**24``). For max and min, ``h`` and ``-h`` travel:
  the result is ``h`` and ``-h`` only when no rank's ``h`` differs. Every rank sees the mismatch;
* data that is moved, not reduced (``broadcast``, ``all_gather``, ``all_to_all``, ``gather``,
  ``scatter``, ``permute``), carries 8 bytes of checksum after each piece's bytes; each
  receiver compares them with its own.

On CPU tensors the tag is read at once and a mismatch raises :class:`CollectiveMismatchError`
on every rank that sees it. On CUDA, reading it would synchronise the host, so the comparison
is queued on the device and its one-byte verdict copied to pinned memory; the next guarded call
on the group (or :func:`raise_pending`) reads the verdicts whose copies have landed (an event
query, no synchronisation) and raises then, naming the call that mismatched.

What it cannot catch, and why (docs/semantics.md, "The data guard"): a mismatch that changes
how many bytes a rank sends (gloo checks sizes and aborts the process before any byte is read;
NCCL reads past buffers); the backend's own pairing (a different collective, or a different
reduce op, waits in the backend until its timeout); and a skipped call whose next call looks
alike (every rank's tag then says the same).
"""

from __future__ import annotations

import math
import os
import zlib
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

import torch
from torch import Tensor

from distgrad._exchange import wait as _wait
from distgrad._exchange.group import Group, on_forget
from distgrad.errors import CollectiveMismatchError

__all__ = [
    "BYTES",
    "Tag",
    "as_bytes",
    "byte_tag",
    "check",
    "enabled",
    "raise_pending",
    "reduced_tag",
    "row_bytes",
    "set_guard",
    "tag_tensor",
    "tagged",
    "untagged",
    "with_tail",
]

BYTES = 8
"""The length of a byte tag."""

_V = TypeVar("_V")

# Sums are exact in these dtypes for the digits' squares (and counts) of any realistic group;
# bfloat16 and float16 are not (8 and 11 bits of mantissa), nor are the unsigned types that
# gloo does not sum.
_SUMMED = frozenset({torch.float32, torch.float64, torch.int32, torch.int64})
_DIGITS = 4  # 4-bit digits of a sum tag: 16 bits of checksum, 8 elements
_ORDERED_BITS = 24  # a max/min tag: exact in float32


def _env_enabled() -> bool:
    return os.environ.get("DISTGRAD_GUARD", "") not in ("", "0")


_enabled = _env_enabled()


def set_guard(enabled: bool) -> None:
    """Turn the data guard on or off for this process (default off; ``DISTGRAD_GUARD=1`` on).

    Past the calls distgrad checks across ranks, the guard appends a few tag elements to the
    data of every collective (``all_reduce`` with ``prod`` and NCCL's native reduce-scatter
    excepted), in forward and backward, and reads them where the result is read: a rank
    making another call than its peers that moves as many bytes (another shape, dtype or op
    argument) is then a :class:`~distgrad.errors.CollectiveMismatchError` instead of a
    silently wrong result.
    No extra message and no host synchronisation on CUDA. Off by default: forward+backward
    costs 0.96x-1.30x on the reductions and broadcast and up to 2.27x on the ops that move
    pieces, on 2 gloo ranks (benchmarks/results/collectives.md; tens of microseconds of Python
    per exchange, and a copy of their input and output), above the 2% (large messages) and 5%
    (small) that a default may cost. Costs and what it catches: docs/semantics.md, "The data
    guard". Every rank of a group must agree on it.

    Args:
        enabled: ``True`` to tag every collective's data, ``False`` (the default) not to.

    Returns:
        None.

    Raises:
        Nothing itself; with the guard on, a call whose tags differ across ranks raises
        ``CollectiveMismatchError`` on every rank that reads them (on CUDA at the group's next
        guarded call).

    Example:
        >>> dg.set_guard(True)
        >>> dg.all_gather(torch.arange(3.0), sizes=[3])  # the tags ride in the data, then go
        tensor([0., 1., 2.])
        >>> dg.set_guard(False)
    """
    global _enabled
    _enabled = bool(enabled)


def enabled() -> bool:
    return _enabled


@dataclass(frozen=True)
class Tag:
    """One guarded exchange: its tag values and what it was, for the error."""

    values: tuple[int, ...]
    what: str  # 'all_reduce(op=sum) of float32 (2, 3)'
    exchange: int  # how many guarded exchanges this process made on the group before
    kind: str  # "sum", "ordered" (max, min) or "bytes": how the tags combine in the exchange


# Guarded exchanges made on each group, by its id and name (as the checked calls are counted).
_exchanges: dict[tuple[int, str], int] = {}


def _forget(groups: list[Group], world_gone: bool) -> None:
    for group in groups:
        _exchanges.pop(group.key, None)
        _pending.pop(group.key, None)


on_forget(_forget)


def _count(group: Group) -> int:
    """How many guarded exchanges came before on ``group``: for the message only. Not in the
    checksum: a rank that skipped a call has made one exchange fewer, so the count cannot tell
    a skip from its next call; and the call site is not in it either, since ranks that make the
    same call from different lines (``if rank == 0: ... else: ...``) are right."""
    key = group.key
    count = _exchanges.get(key, 0)
    _exchanges[key] = count + 1
    return count


# A training loop repeats its calls: each call's description, checksum and tag values are made
# once (measured in one process: 4-10 us per call to make them, 0.3 us to look them up).
_made: dict[tuple[object, ...], tuple[str, tuple[int, ...], str]] = {}

# Both caches start over past this many entries: a program whose shapes keep changing (a
# dynamic batch) must not grow them without end.
_CACHED = 4096


def _keep(cache: dict[Any, _V], key: Any, value: _V) -> _V:
    if len(cache) >= _CACHED:
        cache.clear()
    cache[key] = value
    return value


def _sum_values(h: int) -> tuple[int, ...]:
    digits = [((h >> (4 * j)) & 0xF) + 1 for j in range(_DIGITS)]
    return tuple(v for d in digits for v in (d, d * d))


def _ordered_values(h: int) -> tuple[int, ...]:
    ordered = (h & ((1 << _ORDERED_BITS) - 1)) + 1
    return (ordered, -ordered)


def _byte_values(h: int, what: str) -> tuple[int, ...]:
    low = zlib.crc32(f"{h}|{what}".encode())
    # Never all zero: an unwritten tag (zeros) is then a mismatch too.
    return tuple((h | 1).to_bytes(4, "little") + low.to_bytes(4, "little"))


def reduced_tag(group: Group, kind: str, x: Tensor, op: str, args: str = "") -> Tag | None:
    """The tag of a reduction of ``x`` with ``op`` (None where the guard cannot ride: off,
    a dtype whose sums are not exact, prod)."""
    if not _enabled or group.pg is None or op == "prod" or x.dtype not in _SUMMED:
        return None
    key = (kind, op, args, x.dtype, x.shape)
    made = _made.get(key)
    if made is None:
        dtype = str(x.dtype).removeprefix("torch.")
        what = f"{kind}(op={op}{args}) of {dtype} {tuple(x.shape)}"
        h = zlib.crc32(what.encode())
        combine = "sum" if op == "sum" else "ordered"
        values = _sum_values(h) if op == "sum" else _ordered_values(h)
        made = _keep(_made, key, (what, values, combine))
    raise_pending(group)
    return Tag(made[1], made[0], _count(group), made[2])


def byte_tag(
    group: Group,
    kind: str,
    dtype: torch.dtype,
    shape: Sequence[int],
    args: str,
    counted: bool = True,
) -> Tag:
    """The 8-byte tag of data moved whole (``shape``: what every rank agrees on). An exchange
    whose sender and receiver describe it each in their own terms (``permute``'s shape and
    ``recv_shape``) makes two tags, the second not ``counted``."""
    key = (kind, args, dtype, tuple(shape))
    made = _made.get(key)
    if made is None:
        call = f"{kind}({args})" if args else kind
        what = f"{call} of {str(dtype).removeprefix('torch.')} {tuple(shape)}"
        h = zlib.crc32(what.encode())
        made = _keep(_made, key, (what, _byte_values(h, what), "bytes"))
    if not counted:
        return Tag(made[1], made[0], _exchanges.get(group.key, 1) - 1, made[2])
    raise_pending(group)
    return Tag(made[1], made[0], _count(group), made[2])


# The tag tensors, by values, dtype and device: made once (on CUDA, copied from pinned memory
# without waiting), then reused: a fresh torch.tensor costs 10 us per call.
_tensors: dict[tuple[tuple[int, ...], torch.dtype, torch.device], Tensor] = {}


def _tensor(values: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> Tensor:
    key = (values, dtype, device)
    found = _tensors.get(key)
    if found is None:
        host = torch.tensor(values, dtype=dtype)
        if device.type != "cpu":
            host = host.pin_memory().to(device, non_blocking=True)
        found = _keep(_tensors, key, host)
    return found


def tag_tensor(tag: Tag, dtype: torch.dtype, device: torch.device) -> Tensor:
    """``tag``'s values as a tensor of ``dtype`` on ``device`` (cached; never written)."""
    return _tensor(tag.values, dtype, device)


def check(got: Tensor, tag: Tag, group: Group, ranks: int = 1) -> None:
    """Check tags read back: a reduction's tail (reduced over ``ranks`` ranks) or received byte
    tags ([..., BYTES] uint8, every row must be the tag)."""
    values = tuple(v * ranks for v in tag.values) if tag.kind == "sum" else tag.values
    expected = _tensor(values, got.dtype, got.device)
    rows = got.view(-1, len(values))
    if got.device.type == "cpu":
        if not torch.equal(rows, expected.expand(rows.shape)):
            raise _mismatch(tag, group)
        return
    bad = (rows != expected).any()
    verdict = torch.empty((), dtype=torch.bool, pin_memory=True)
    verdict.copy_(bad, non_blocking=True)
    landed = torch.cuda.Event()  # type: ignore[no-untyped-call]
    landed.record()
    _pending.setdefault(group.key, []).append((verdict, landed, tag))


# CUDA verdicts not yet read, per group: (pinned bool, the event after its copy, the call).
_pending: dict[tuple[int, str], list[tuple[Tensor, torch.cuda.Event, Tag]]] = {}


def raise_pending(group: Group) -> None:
    """Raise for the first queued CUDA verdict on ``group`` that has landed and says mismatch;
    drop those that landed clean. Never waits."""
    queue = _pending.get(group.key)
    while queue and queue[0][1].query():  # type: ignore[no-untyped-call]
        verdict, _, tag = queue.pop(0)
        if bool(verdict):
            queue.clear()
            raise _mismatch(tag, group, late=True)


def _mismatch(tag: Tag, group: Group, late: bool = False) -> CollectiveMismatchError:
    """The error: the user's call this rank is in (``_wait.activity``), then the exchange."""
    if late:
        where = (
            f"(the tags of an earlier exchange on the group, {tag.what}, its guarded exchange "
            f"{tag.exchange + 1}, did not match; on CUDA the verdict is read without waiting, so "
            "it is raised as a later call begins)"
        )
    else:
        where = (
            f"(the tags of this rank's {tag.what} exchange, its guarded exchange "
            f"{tag.exchange + 1} on the group, did not match)"
        )
    return CollectiveMismatchError(
        f"distgrad: rank {group.rank} was in {_wait.activity(group)}, past the checked calls, "
        f"when the data guard found that the ranks had not made the same call {where}: some "
        "rank passed another shape, dtype or argument, called another op, or skipped or added "
        "a call. Rerun with DISTGRAD_DEBUG=1: every call is then checked across ranks, and the "
        "error names the rank and what it passed."
    )


# ---------------------------------------------------------------------------------------------
# Tags in the bytes an exchange moves: each piece's bytes followed by its tag, one copy.


def as_bytes(x: Tensor) -> Tensor:
    """``x``'s bytes, flat (a view when ``x`` is contiguous)."""
    flat = x.contiguous().view(-1)
    if flat.numel() <= 1 and flat.stride(0) != 1:  # a lone entry keeps any stride it had
        flat = flat.clone(memory_format=torch.contiguous_format)
    return flat.view(torch.uint8)


def row_bytes(x: Tensor) -> int:
    return math.prod(x.shape[1:]) * x.element_size()


def tagged(parts: Sequence[Tensor], tag: Tag) -> Tensor:
    """Each part's bytes followed by ``tag``'s, concatenated: one copy (see above)."""
    mark = tag_tensor(tag, torch.uint8, parts[0].device)
    return torch.cat([piece for part in parts for piece in (as_bytes(part), mark)])


def untagged(
    received: Tensor, pieces: Sequence[int], tag: Tag, group: Group, like: Tensor, rows: int
) -> Tensor:
    """Check the tag after each of ``received``'s byte ``pieces`` (each ends in one), and return
    the data before them as ``rows`` rows of ``like``'s row shape and dtype."""
    blocks = torch.split(received, list(pieces))
    check(torch.stack([b[-BYTES:] for b in blocks]), tag, group)
    data = torch.cat([b[:-BYTES] for b in blocks])
    return data.view(like.dtype).view(rows, *like.shape[1:])


def with_tail(x: Tensor, tag: Tag | None) -> tuple[Tensor, int]:
    """A fresh contiguous copy of ``x`` to reduce in place: ``x`` itself when unguarded, else
    flat with ``tag``'s values after ``x``'s (at index ``x.numel()``, returned). The same one
    copy either way, so the guard costs the tag's few elements."""
    if tag is None:
        return x.clone(memory_format=torch.contiguous_format), 0
    return torch.cat([x.reshape(-1), tag_tensor(tag, x.dtype, x.device)]), x.numel()
