"""The guard that rides in the data: mismatched calls past the checked ones, caught in the bytes.

Past the checked calls (``collectives._signature``) the ranks exchange nothing but their data,
so a rank that makes another call than its peers (another shape, dtype, op, argument, or one
call late) goes unseen by distgrad. The guard appends a few tag elements to the buffer an
exchange moves anyway. The tag is a checksum of what every rank must agree on (the exchange,
its shape and dtype, its arguments, and how many guarded exchanges this process has made on
the group: the call order), and is read back where the result is:

* reductions (``all_reduce`` sum/max/min, ``reduce``) carry tags that reduce to a known value
  only when every rank's tag is the same. For a sum, each of four 4-bit digits ``d`` travels
  as ``d`` and ``d**2``: the sums equal ``N d`` and ``N d**2`` for this rank's ``d`` exactly
  when every rank's digit is ``d`` (the spread ``sum((d_i - d)**2)`` is then 0). Exact in
  float32 up to 65,535 ranks (``N * 256 < 2**24``). For max and min, ``h`` and ``-h`` travel:
  the result is ``h`` and ``-h`` only when no rank's ``h`` differs. Every rank sees the mismatch;
* data that is moved, not reduced (``broadcast``, ``all_gather``), carries 8 bytes of
  checksum after its own bytes; each receiver compares them with its own.

On CPU tensors the tag is read at once and a mismatch raises :class:`CollectiveMismatchError`
on every rank that sees it. On CUDA, reading it would synchronise the host, so the comparison
is queued on the device and its one-byte verdict copied to pinned memory; the next guarded call
on the group (or :func:`raise_pending`) reads the verdicts whose copies have landed (an event
query, no synchronisation) and raises then, naming the call that mismatched.

What it cannot catch, and why (docs/semantics.md has the table): a mismatch that changes how
many bytes a rank sends (gloo checks sizes and aborts the process before any byte is read; NCCL
reads past buffers), or the backend's own pairing (a different collective, or a different
reduce op, waits in the backend until its timeout).
"""

from __future__ import annotations

import os
import zlib
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from distgrad import _wait
from distgrad._group import Group, on_forget
from distgrad.errors import CollectiveMismatchError

__all__ = [
    "BYTES",
    "Tag",
    "byte_tag",
    "check_bytes",
    "check_reduced",
    "enabled",
    "raise_pending",
    "reduced_tag",
    "set_guard",
]

BYTES = 8
"""The length of a byte tag."""

# Sums are exact in these dtypes for the digits' squares (and counts) of any realistic group;
# bfloat16 and float16 are not (8 and 11 bits of mantissa), nor are the unsigned types that
# gloo does not sum.
_SUMMED = frozenset({torch.float32, torch.float64, torch.int32, torch.int64})
_DIGITS = 4  # 4-bit digits of a sum tag: 16 bits of checksum, 8 elements
_ORDERED_BITS = 24  # a max/min tag: exact in float32


def _env_enabled() -> bool:
    return os.environ.get("DISTGRAD_GUARD", "1") not in ("", "0")


_enabled = _env_enabled()


def set_guard(enabled: bool) -> None:
    """Turn the data guard on or off for this process (default on; ``DISTGRAD_GUARD=0`` off).

    Past the calls distgrad checks across ranks, the guard appends a few tag elements to the
    data of ``all_reduce`` (sum, max, min), ``reduce``, ``broadcast`` and ``all_gather``, in
    their forward and backward, and reads them where the result is read: a rank making another
    call than its peers (another shape, dtype, op argument, or a call skipped) is then a
    :class:`~distgrad.errors.CollectiveMismatchError` instead of a silently wrong result.
    No extra message and no host synchronisation on CUDA. Costs and what it catches:
    docs/semantics.md, "The data guard". Every rank of a group must agree on it.
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


# Guarded exchanges made on each group, by its id and name (as the checked calls are counted).
_exchanges: dict[tuple[int, str], int] = {}


def _forget(groups: list[Group], world_gone: bool) -> None:
    for group in groups:
        _exchanges.pop((id(group.pg), group.name), None)
        _pending.pop((id(group.pg), group.name), None)


on_forget(_forget)


def _checksum(group: Group, what: str) -> tuple[int, int]:
    """``what``'s checksum, and how many guarded exchanges came before on ``group`` (for the
    message only: a rank that skipped a call has made one exchange fewer, so the count would
    not tell a skip from its next call; and ranks that make the same call from different lines
    are right, so the call site is not in the checksum either)."""
    key = (id(group.pg), group.name)
    count = _exchanges.get(key, 0)
    _exchanges[key] = count + 1
    return zlib.crc32(what.encode()), count


def reduced_tag(group: Group, kind: str, x: Tensor, op: str, args: str = "") -> Tag | None:
    """The tag of a reduction of ``x`` with ``op`` (None where the guard cannot ride: off,
    a dtype whose sums are not exact, prod)."""
    if not _enabled or group.pg is None or op == "prod" or x.dtype not in _SUMMED:
        return None
    what = f"{kind}(op={op}{args}) of {str(x.dtype).removeprefix('torch.')} {tuple(x.shape)}"
    raise_pending(group)
    h, count = _checksum(group, what)
    if op == "sum":
        digits = [((h >> (4 * j)) & 0xF) + 1 for j in range(_DIGITS)]
        values = tuple(v for d in digits for v in (d, d * d))
    else:
        ordered = (h & ((1 << _ORDERED_BITS) - 1)) + 1
        values = (ordered, -ordered)
    return Tag(values, what, count)


def byte_tag(group: Group, kind: str, dtype: torch.dtype, shape: Sequence[int], args: str) -> Tag:
    """The 8-byte tag of data moved whole (``shape``: what every rank agrees on)."""
    what = f"{kind}({args}) of {str(dtype).removeprefix('torch.')} {tuple(shape)}"
    raise_pending(group)
    h, count = _checksum(group, what)
    low = zlib.crc32(f"{h}|{what}".encode())
    # Never all zero: an unwritten tag (zeros) is then a mismatch too.
    values = tuple((h | 1).to_bytes(4, "little") + low.to_bytes(4, "little"))
    return Tag(values, what, count)


def tag_tensor(tag: Tag, dtype: torch.dtype, device: torch.device) -> Tensor:
    """``tag``'s values as a tensor on ``device`` with no host synchronisation (a copy from
    pinned memory, queued on the stream)."""
    host = torch.tensor(tag.values, dtype=dtype)
    if device.type == "cpu":
        return host
    return host.pin_memory().to(device, non_blocking=True)


def check_reduced(tail: Tensor, tag: Tag, group: Group, op: str, ranks: int) -> None:
    """Check a reduction's tag elements ``tail`` (the reduction over ``ranks`` ranks)."""
    if op == "sum":
        want = [v * ranks for v in tag.values]
    elif op == "max":
        want = list(tag.values)
    else:  # min: min(h) and min(-h) = -max(h)
        want = list(tag.values)
    _check(tail, want, tag, group)


def check_bytes(tails: Tensor, tag: Tag, group: Group) -> None:
    """Check received byte tags: ``tails`` is [..., BYTES] uint8, every row must be ``tag``."""
    _check(tails.reshape(-1, BYTES), list(tag.values), tag, group)


def _check(got: Tensor, want: list[int], tag: Tag, group: Group) -> None:
    if got.device.type == "cpu":
        rows = got.reshape(-1, len(want)).tolist()
        if any([int(v) for v in row] != want for row in rows):
            raise _mismatch(tag, group)
        return
    expected = torch.tensor(want, dtype=got.dtype).pin_memory().to(got.device, non_blocking=True)
    bad = (got.reshape(-1, len(want)) != expected).any()
    verdict = torch.empty((), dtype=torch.bool, pin_memory=True)
    verdict.copy_(bad, non_blocking=True)
    landed = torch.cuda.Event()  # type: ignore[no-untyped-call]
    landed.record()
    _pending.setdefault((id(group.pg), group.name), []).append((verdict, landed, tag))


# CUDA verdicts not yet read, per group: (pinned bool, the event after its copy, the call).
_pending: dict[tuple[int, str], list[tuple[Tensor, torch.cuda.Event, Tag]]] = {}


def raise_pending(group: Group) -> None:
    """Raise for the first queued CUDA verdict on ``group`` that has landed and says mismatch;
    drop those that landed clean. Never waits."""
    queue = _pending.get((id(group.pg), group.name))
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
