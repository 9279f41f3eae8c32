"""What travels besides the data: the checked transfers' header, the tags, learned shapes.

**Checked transfers.** The first :data:`CHECKED` messages each way between two ranks of a group
(forward data and backward gradients counted apart), and every message in debug mode
(``DISTGRAD_DEBUG=1``, :func:`distgrad.set_debug`), are preceded by a header of
:data:`WIDTH` int64: what the sender sends (shape, dtype, whether it requires grad), which
transfer it is (its slot, its microbatch) and, in a backward, how many gradients the sender's
backward sends to this receiver. The receiver compares it with what it expects and raises a
:class:`~distgrad.errors.CollectiveMismatchError` naming both ranks and the transfer. Both
sides count the same messages, so both know whether a header comes. After that, a transfer
sends nothing but its data.

**Learned shapes.** A receive without ``shape=`` takes the shape, dtype and ``requires_grad``
from the header of its checked calls and keeps them per slot (the k-th transfer of a context
between the two ranks); its later calls reuse them, data only. The sender keeps what it
announced for the same slot and refuses to send another shape unannounced (the receiver would
read the wrong number of bytes): a transfer's shape is fixed once learned, as in torch's
``PipelineStage`` (which infers shapes once). A step whose shapes change (the last, smaller
batch of an epoch) runs in ``context(check=True)`` on every rank: each of its messages carries
its header again, and what it announces is kept for the steps after it. (A sender cannot know
whether its receiver passed ``shape=``, so the rule cannot depend on it.)

**Tags.** On gloo, forward data goes with :data:`FORWARD_TAG` (pairs of ranks are matched in
order, as the forward is written) and each gradient with ``BACKWARD_TAG + slot``, so that two
ranks whose schedules run the microbatches' backwards in different orders still pair every
gradient with its transfer. NCCL ignores tags and pairs messages in order; the backward's order
(each rank's transfers in reverse program order per microbatch) is then the same on both sides
when every rank runs the microbatches' backwards in the same order (docs/pipeline.md).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from distgrad._exchange.group import Group, on_forget
from distgrad._exchange.handshake import debug_enabled, show
from distgrad.errors import CollectiveMismatchError

__all__ = [
    "BACKWARD_TAG",
    "CHECKED",
    "FORWARD_TAG",
    "WIDTH",
    "Header",
    "announce",
    "checked",
    "decode",
    "encode",
    "learned",
]

CHECKED = 8
"""How many messages each way between two ranks carry a header (then data only)."""

FORWARD_TAG = 0x64670000  # "dg" in the high half; distinct from the collectives' P2P_TAG
BACKWARD_TAG = 0x64680000
_SLOTS = 0xFFFF  # a gradient's tag holds its slot modulo this

_MAGIC = 0x7069706531  # "pipe1"
_MAX_DIMS = 8
WIDTH = 8 + _MAX_DIMS
_DTYPES: tuple[torch.dtype, ...] = (
    torch.float32,
    torch.float64,
    torch.float16,
    torch.bfloat16,
    torch.int64,
    torch.int32,
    torch.int16,
    torch.int8,
    torch.uint8,
    torch.bool,
    torch.complex64,
    torch.complex128,
)

Key = tuple[tuple[int, str], int, int]  # (group key, peer, slot)

# Messages so far each way between this rank and each peer: (group key, peer, what) -> count
_counts: dict[tuple[tuple[int, str], int, str], int] = {}
# What a receive learned, and what a send announced, per slot: key -> (shape, dtype, grad)
_learned: dict[Key, tuple[tuple[int, ...], torch.dtype, bool]] = {}
_announced: dict[Key, tuple[tuple[int, ...], torch.dtype, bool]] = {}


def _forget(groups: list[Group], world_gone: bool) -> None:
    keys = {g.key for g in groups}
    tables: list[dict[Any, Any]] = [_counts, _learned, _announced]
    for table in tables:
        for k in [k for k in table if world_gone or k[0] in keys]:
            del table[k]


on_forget(_forget)


def checked(group: Group, peer: int, what: str, force: bool) -> bool:
    """Count one message of ``what`` ('fwd-out', 'fwd-in', 'bwd-out', 'bwd-in') with
    ``peer``; whether it carries a header (``force``: the context is checked). Sender and
    receiver count the same messages."""
    key = (group.key, peer, what)
    n = _counts.get(key, 0)
    _counts[key] = n + 1
    return n < CHECKED or force or debug_enabled()


def tag(backward: bool, slot: int) -> int:
    return BACKWARD_TAG + slot % _SLOTS if backward else FORWARD_TAG


@dataclass(frozen=True, slots=True)
class Header:
    """A decoded header: what the sender sent."""

    shape: tuple[int, ...]
    dtype: torch.dtype
    requires_grad: bool
    slot: int
    microbatch: int | None
    count: int


def encode(
    shape: Sequence[int],
    dtype: torch.dtype,
    requires_grad: bool,
    slot: int,
    microbatch: int | None,
    count: int = -1,
    *,
    op: object,
    group: Group,
) -> torch.Tensor:
    if len(shape) > _MAX_DIMS:
        raise CollectiveMismatchError(
            f"{op} on rank {group.rank}: a transfer's tensor has at most {_MAX_DIMS} dims, "
            f"got {len(shape)} ({show(tuple(shape))}); reshape it before sending"
        )
    if dtype not in _DTYPES:
        raise CollectiveMismatchError(
            f"{op} on rank {group.rank}: dtype {dtype} cannot be sent; use one of "
            f"{', '.join(str(d) for d in _DTYPES)}"
        )
    mb = -1 if microbatch is None else microbatch
    values = [_MAGIC, _DTYPES.index(dtype), int(requires_grad), slot, mb, count, len(shape), 0]
    values += [*shape, *([0] * (_MAX_DIMS - len(shape)))]
    return torch.tensor(values, dtype=torch.int64)


def decode(vec: torch.Tensor, *, op: object, group: Group, peer: int) -> Header:
    v = vec.tolist()
    if v[0] != _MAGIC:
        raise CollectiveMismatchError(
            f"{op} on rank {group.rank}: what rank {peer} sent is not a dg.pipeline transfer's "
            "header: the two ranks' transfers do not pair up (a send or recv made on one rank "
            "and not on the other, or a torch.distributed send between them)"
        )
    ndim = v[6]
    mb = None if v[4] < 0 else v[4]
    return Header(tuple(v[8 : 8 + ndim]), _DTYPES[v[1]], bool(v[2]), v[3], mb, v[5])


def empty_header(device: torch.device) -> torch.Tensor:
    return torch.empty(WIDTH, dtype=torch.int64, device=device)


def learned(group: Group, peer: int, slot: int) -> tuple[tuple[int, ...], torch.dtype, bool] | None:
    return _learned.get((group.key, peer, slot))


def learn(group: Group, peer: int, slot: int, header: Header) -> None:
    _learned[(group.key, peer, slot)] = (header.shape, header.dtype, header.requires_grad)


def announce(
    group: Group,
    peer: int,
    slot: int,
    what: tuple[tuple[int, ...], torch.dtype, bool],
    header_sent: bool,
    *,
    op: object,
) -> None:
    """Keep what a checked send announced; refuse an unchecked send that differs from it."""
    key = (group.key, peer, slot)
    if header_sent:
        _announced[key] = what
        return
    before = _announced.get(key)
    if before is not None and before != what:
        raise CollectiveMismatchError(
            f"{op} on rank {group.rank}: transfer {slot} to rank {peer} sends shape "
            f"{show(what[0])}, dtype {what[1]}, requires_grad={what[2]}, but its checked calls "
            f"announced shape {show(before[0])}, dtype {before[1]}, requires_grad={before[2]}; "
            "after its first checked calls a transfer sends only its data, so its shape must "
            "stay fixed: keep microbatch shapes the same from step to step, or make the step "
            "whose shapes change in dg.pipeline.context(check=True) on every rank (its "
            "transfers carry their shapes again; later steps keep the new ones)"
        )
