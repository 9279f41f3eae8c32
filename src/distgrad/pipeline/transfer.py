"""Sends and receives that autograd records: the forward half of distributed autograd over c10d.

``isend``/``irecv`` start a transfer and return a :class:`Transfer`; ``send``/``recv`` are the
same, waited for. Inside a :func:`~distgrad.pipeline.context`, a transfer whose tensor requires
grad is recorded: its gradient goes back the other way when the ranks run
:func:`~distgrad.pipeline.backward`. A received tensor is a leaf of this rank's graph that
requires grad: autograd accumulates into its ``.grad`` what reaches it, which the distributed
backward sends to the sender once every part of it has arrived.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor

from distgrad._exchange.group import Group, on_forget, resolve
from distgrad._exchange.handshake import show
from distgrad._exchange.pairs import Pairs, start_pairs
from distgrad._mesh import GroupLike, refuse_dtensors
from distgrad.errors import CollectiveArgumentError, CollectiveMismatchError
from distgrad.pipeline import _records, _wire
from distgrad.pipeline._records import Context

__all__ = ["Transfer", "irecv", "isend", "recv", "send"]


class Transfer:
    """A send or receive in flight, from :func:`isend` or :func:`irecv` (not made directly).

    :meth:`wait` finishes it: a send returns ``None``, a receive the tensor received (the same
    tensor on every later call). A transfer never waited for is waited for when its context
    ends; a receive's tensor exists only once waited for.

    Example:
        >>> from distgrad._demo.pipeline import microbatches  # irecv(...).wait(), isend
        >>> dg.testing.run_on_ranks(microbatches, 2)  # each stage equals one process
        [True, True]
    """

    __slots__ = ("_finish", "_pairs", "_result", "_waited")
    _pairs: Pairs | None
    _finish: Any  # a receive: makes the received tensor once the data is there
    _result: Tensor | None
    _waited: bool

    @classmethod
    def _started(cls, pairs: Pairs | None, finish: Any = None) -> Transfer:
        made = object.__new__(cls)
        made._pairs, made._finish, made._result, made._waited = pairs, finish, None, False
        return made

    def wait(self) -> Tensor | None:
        if not self._waited:
            self._waited = True
            if self._pairs is not None:
                pairs, self._pairs = self._pairs, None
                pairs.wait()
            if self._finish is not None:
                self._result = self._finish()
                self._finish = None
        return self._result

    def is_completed(self) -> bool:
        return self._waited


def _peer(peer: object, g: Group, op: str, name: str) -> int:
    if isinstance(peer, bool) or not isinstance(peer, int) or not 0 <= peer < g.size:
        raise CollectiveArgumentError(
            f"{op} on rank {g.rank}: {name} must be a group rank, an int from 0 to "
            f"{g.size - 1}, got {peer!r}"
        )
    if peer == g.rank:
        raise CollectiveArgumentError(
            f"{op} on rank {g.rank}: {name}={peer} is this rank itself; a transfer goes to "
            "another rank of the group (use the tensor directly for this rank's own part)"
        )
    return peer


class _Named:
    """A transfer's name in errors, worded only when an error needs it (a wait that fails, a
    mismatch): formatting it on every call cost more than the rest of a small call's Python."""

    __slots__ = ("microbatch", "op", "peer", "slot")

    def __init__(self, op: str, peer: int, slot: int, microbatch: int | None) -> None:
        self.op, self.peer, self.slot, self.microbatch = op, peer, slot, microbatch

    def __str__(self) -> str:
        mb = "" if self.microbatch is None else f", microbatch {self.microbatch}"
        way = "to" if self.op.endswith("send") else "from"
        transfer = f"(transfer {self.slot}{mb})"
        return f"the forward of dg.pipeline.{self.op} {way} rank {self.peer} {transfer}"


# The last group argument and what it resolved to: a pipeline names the same group on every
# call, and resolving it each time was a tenth of a small transfer's Python. Forgotten with the
# group (destroyed groups), and never kept for a process alone (it may join a group later).
_last: list[Any] = [object(), None]


def _group(group: GroupLike, op: str) -> Group:
    if group is _last[0] and _last[1] is not None:
        return _last[1]  # type: ignore[no-any-return]
    g = resolve(group, f"dg.pipeline.{op}")
    if g.size > 1 and not torch.compiler.is_compiling():
        _last[:] = [group, g]
    return g


def _forget(groups: list[Group], world_gone: bool) -> None:
    if world_gone or any(g.key == getattr(_last[1], "key", None) for g in groups):
        _last[:] = [object(), None]


on_forget(_forget)


def isend(
    x: Tensor, dst: int, group: GroupLike = None, *, microbatch: int | None = None
) -> Transfer:
    """Start sending ``x`` to group rank ``dst``; the gradient of what ``dst`` computes from
    it comes back in the backward and flows on into ``x``'s graph.

    ``x`` is not modified; it must not be modified until the transfer completes (as with
    torch's ``isend``). Recorded in the current context when ``x`` requires grad and grad mode
    is on; ``microbatch`` labels the transfer for :func:`~distgrad.pipeline.backward`'s
    ``microbatch=``. Communication: forward 1 message of ``x`` (and a header of 16 int64 on
    the first 8 sends to ``dst``, or every send in debug mode); backward 1 message of ``x``'s
    shape from ``dst``.

    Args:
        x: the tensor to send; not modified (it must not be modified until the transfer
            completes).
        dst: the group rank to send to.
        group: the process group (default: the default group), or a DeviceMesh dimension
            (``mesh["pp"]``, ``(mesh, "pp")``).
        microbatch: the label :func:`~distgrad.pipeline.backward`'s ``microbatch=`` selects.

    Returns:
        A :class:`Transfer` in flight; its ``wait()`` returns ``None``.

    Raises:
        CollectiveArgumentError: ``dst`` is not another rank of the group, or ``x`` is no
            tensor.
        CollectiveMismatchError: after its checked calls, the transfer's shape, dtype or
            ``requires_grad`` differs from what its checked calls announced (make that step in
            ``context(check=True)``).
        PipelineError: called outside a :func:`~distgrad.pipeline.context`.
        torch.distributed.DistBackendError: the peer's process died while this rank waited
            (``PeerGoneError`` when distgrad's liveness check saw it first), naming the rank
            and the transfer.
        RuntimeError: the peer never received within the group's timeout.

    Example:
        >>> from distgrad._demo.pipeline import microbatches  # isend each microbatch
        >>> dg.testing.run_on_ranks(microbatches, 2)
        [True, True]
    """
    op = "isend"
    g = _group(group, op)
    if type(x) is not Tensor:
        refuse_dtensors(f"dg.pipeline.{op}", x=x)
    if not isinstance(x, Tensor):
        raise CollectiveArgumentError(
            f"dg.pipeline.{op} on rank {g.rank}: x must be a tensor, got {type(x).__name__}"
        )
    dst = _peer(dst, g, f"dg.pipeline.{op}", "dst")
    ctx = _records.current(op)
    slot = ctx.next_slot("send", g, dst)
    grad = x.requires_grad and torch.is_grad_enabled()
    checked = _wire.checked(g, dst, "fwd-out", ctx.check)
    what = _Named(op, dst, slot, microbatch)
    _wire.announce(g, dst, slot, (tuple(x.shape), x.dtype, grad), checked, op=what)
    data = x.detach().contiguous()
    sends: list[tuple[Tensor, int]] = []
    if checked:
        header = _wire.encode(x.shape, x.dtype, grad, slot, microbatch, op=what, group=g)
        sends.append((header.to(data.device), dst))
    if data.numel():
        sends.append((data, dst))
    pairs = start_pairs(sends, [], g, _wire.tag(False, slot), what) if sends else None
    if grad:
        ctx.record("send", g, dst, slot, x, microbatch)
    # The data is kept alive by the transfer until it is waited for (gloo reads it while in
    # flight); a context waits for every send it started when it ends.
    if pairs is not None:
        ctx.keep(pairs)
    return Transfer._started(pairs)


def send(x: Tensor, dst: int, group: GroupLike = None, *, microbatch: int | None = None) -> None:
    """:func:`isend`, waited for: returns when ``x`` has been sent (gloo's send waits until
    the receiver has posted its buffer). Same cost as :func:`isend`.

    Args:
        x: the tensor to send; not modified.
        dst: the group rank to send to.
        group: the process group (default: the default group), or a DeviceMesh dimension.
        microbatch: the label :func:`~distgrad.pipeline.backward`'s ``microbatch=`` selects.

    Returns:
        None, once sent.

    Raises:
        CollectiveArgumentError: ``dst`` is not another rank of the group, or ``x`` is no
            tensor.
        CollectiveMismatchError: after its checked calls, the transfer's shape, dtype or
            ``requires_grad`` differs from what its checked calls announced (make that step in
            ``context(check=True)``).
        PipelineError: called outside a :func:`~distgrad.pipeline.context`.
        torch.distributed.DistBackendError: the peer's process died while this rank waited
            (``PeerGoneError`` when distgrad's liveness check saw it first), naming the rank
            and the transfer.
        RuntimeError: the peer never received within the group's timeout.

    Example:
        >>> from distgrad._demo.pipeline import two_stages  # rank 0 sends, rank 1 receives
        >>> dg.testing.run_on_ranks(two_stages, 2)  # each stage's gradient: one process's
        [True, True]
    """
    isend(x, dst, group, microbatch=microbatch).wait()


def irecv(
    src: int,
    group: GroupLike = None,
    *,
    shape: Sequence[int] | None = None,
    dtype: torch.dtype | None = None,
    device: torch.device | str | None = None,
    like: Tensor | None = None,
    requires_grad: bool | None = None,
    microbatch: int | None = None,
) -> Transfer:
    """Start receiving a tensor from group rank ``src``; :meth:`Transfer.wait` returns it.

    The received tensor requires grad when the sent one did (and grad mode is on here): its
    gradient goes back to ``src`` in the backward. ``shape``, ``dtype`` and ``requires_grad``
    (or ``like=``, a tensor whose shape, dtype and device to take) say what arrives; any left
    out are learned from the transfer's first checked calls and then reused, so a step after
    the first sends nothing but its data. ``device`` defaults to ``like``'s, else the current
    CUDA device on NCCL and the CPU otherwise. ``microbatch`` labels the transfer for the
    backward.

    Communication: forward 1 message (and a header of 16 int64 on the first 8 receives from
    ``src``, or every one in debug mode); backward 1 message of the gradient to ``src``.

    Args:
        src: the group rank to receive from.
        group: the process group (default: the default group), or a DeviceMesh dimension.
        shape: the shape that arrives (else learned from the transfer's checked calls).
        dtype: the dtype that arrives (else learned).
        device: where to put it (default: ``like``'s, else the current CUDA device on NCCL,
            the CPU otherwise).
        like: a tensor whose shape, dtype and device to take.
        requires_grad: whether the sent tensor requires grad (else learned; it decides
            whether a gradient goes back).
        microbatch: the label :func:`~distgrad.pipeline.backward`'s ``microbatch=`` selects.

    Returns:
        A :class:`Transfer` in flight; its ``wait()`` returns the received tensor.

    Raises:
        CollectiveArgumentError: ``src`` is not another rank of the group.
        CollectiveMismatchError: what arrives differs from ``shape``/``dtype``/
            ``requires_grad`` (checked calls: raised before the data is read), or nothing says
            what arrives (a transfer with no checked call to learn from, and no ``shape=``).
        PipelineError: called outside a :func:`~distgrad.pipeline.context`.
        torch.distributed.DistBackendError: the sender's process died while this rank waited
            (``PeerGoneError`` when distgrad's liveness check saw it first), within tens of
            milliseconds, naming the rank and the transfer.
        RuntimeError: nothing was sent within the group's timeout (a receive with no matching
            send), naming the transfer.

    Example:
        >>> from distgrad._demo.pipeline import microbatches  # irecv(...).wait()
        >>> dg.testing.run_on_ranks(microbatches, 2)
        [True, True]
    """
    op = "irecv"
    g = _group(group, op)
    src = _peer(src, g, f"dg.pipeline.{op}", "src")
    ctx = _records.current(op)
    slot = ctx.next_slot("recv", g, src)
    what = _Named(op, src, slot, microbatch)
    if like is not None:
        refuse_dtensors(f"dg.pipeline.{op}", like=like)
        shape = tuple(like.shape) if shape is None else shape
        dtype = like.dtype if dtype is None else dtype
        device = like.device if device is None else device
    wanted = None if shape is None else tuple(int(d) for d in shape)
    where = torch.device(device) if device is not None else _default_device(g)
    tag = _wire.tag(False, slot)
    known = _wire.learned(g, src, slot)
    if _wire.checked(g, src, "fwd-in", ctx.check):
        # The header first, its data only once the header matches: gloo aborts the process
        # when a message is larger than the buffer posted for it.
        header = _wire.empty_header(where)
        first = start_pairs([], [(header, src)], g, tag, what)

        def finish_checked() -> Tensor:
            first.wait()
            arrived = _arrived(header, g, src, slot, what)
            _check(arrived, wanted, dtype, requires_grad, g, src, what)
            buffer = torch.empty(arrived.shape, dtype=arrived.dtype, device=where)
            if buffer.numel():
                start_pairs([], [(buffer, src)], g, tag, what).wait()
            return _received(ctx, g, src, slot, microbatch, buffer, arrived.requires_grad)

        return Transfer._started(None, finish_checked)
    # Data only: what arrives is what the caller says, else what the checked calls taught.
    shape_ = wanted if wanted is not None else (known[0] if known else None)
    dtype_ = dtype if dtype is not None else (known[1] if known else None)
    if shape_ is None or dtype_ is None:
        raise CollectiveMismatchError(
            f"{what} on rank {g.rank}: nothing says what arrives (this transfer had no "
            "checked call to learn its shape from); pass shape= and dtype= (or like=)"
        )
    buffer = torch.empty(shape_, dtype=dtype_, device=where)
    grad = requires_grad if requires_grad is not None else (known[2] if known else True)
    data = start_pairs([], [(buffer, src)], g, tag, what) if buffer.numel() else None
    return Transfer._started(data, lambda: _received(ctx, g, src, slot, microbatch, buffer, grad))


def recv(
    src: int,
    group: GroupLike = None,
    *,
    shape: Sequence[int] | None = None,
    dtype: torch.dtype | None = None,
    device: torch.device | str | None = None,
    like: Tensor | None = None,
    requires_grad: bool | None = None,
    microbatch: int | None = None,
) -> Tensor:
    """:func:`irecv`, waited for: returns the tensor received. Same cost as :func:`irecv`.

    Args:
        src: the group rank to receive from.
        group: the process group (default: the default group), or a DeviceMesh dimension.
        shape: the shape that arrives (else learned from the transfer's checked calls).
        dtype: the dtype that arrives (else learned).
        device: where to put it (default: ``like``'s, else the current CUDA device on NCCL,
            the CPU otherwise).
        like: a tensor whose shape, dtype and device to take.
        requires_grad: whether the sent tensor requires grad (else learned; it decides
            whether a gradient goes back).
        microbatch: the label :func:`~distgrad.pipeline.backward`'s ``microbatch=`` selects.

    Returns:
        The received tensor; it requires grad when the sent one did, and its gradient goes
        back to ``src`` in the backward.

    Raises:
        CollectiveArgumentError: ``src`` is not another rank of the group.
        CollectiveMismatchError: what arrives differs from ``shape``/``dtype``/
            ``requires_grad`` (checked calls: raised before the data is read), or nothing says
            what arrives (a transfer with no checked call to learn from, and no ``shape=``).
        PipelineError: called outside a :func:`~distgrad.pipeline.context`.
        torch.distributed.DistBackendError: the sender's process died while this rank waited
            (``PeerGoneError`` when distgrad's liveness check saw it first), within tens of
            milliseconds, naming the rank and the transfer.
        RuntimeError: nothing was sent within the group's timeout (a receive with no matching
            send), naming the transfer.

    Example:
        >>> from distgrad._demo.pipeline import two_stages  # rank 1: recv(src=0, shape=...)
        >>> dg.testing.run_on_ranks(two_stages, 2)
        [True, True]
    """
    received = irecv(
        src,
        group,
        shape=shape,
        dtype=dtype,
        device=device,
        like=like,
        requires_grad=requires_grad,
        microbatch=microbatch,
    ).wait()
    assert received is not None
    return received


_CPU = torch.device("cpu")


def _default_device(g: Group) -> torch.device:
    if g.is_nccl:
        return torch.device("cuda", torch.cuda.current_device())
    return _CPU


def _arrived(header: Tensor, g: Group, src: int, slot: int, what: _Named) -> _wire.Header:
    arrived = _wire.decode(header, op=what, group=g, peer=src)
    _wire.learn(g, src, slot, arrived)
    return arrived


def _check(
    arrived: _wire.Header,
    shape: tuple[int, ...] | None,
    dtype: torch.dtype | None,
    requires_grad: bool | None,
    g: Group,
    src: int,
    what: _Named,
) -> None:
    problems = []
    if shape is not None and arrived.shape != shape:
        problems.append(f"shape {show(arrived.shape)} where this rank expects {show(shape)}")
    if dtype is not None and arrived.dtype != dtype:
        problems.append(f"dtype {arrived.dtype} where this rank expects {dtype}")
    if requires_grad is not None and arrived.requires_grad != requires_grad:
        problems.append(
            f"a tensor with requires_grad={arrived.requires_grad} where this rank expects "
            f"requires_grad={requires_grad}"
        )
    if problems:
        raise CollectiveMismatchError(
            f"{what} on rank {g.rank}: rank {src} sends " + "; ".join(problems)
        )


def _received(
    ctx: Context,
    g: Group,
    src: int,
    slot: int,
    microbatch: int | None,
    buffer: Tensor,
    grad: bool,
) -> Tensor:
    """The received tensor, recorded when its gradient goes back: a leaf that requires grad,
    into whose ``.grad`` autograd accumulates what reaches it (a custom recv node cost 20 us
    more per transfer, its apply and its Python backward)."""
    if not (grad and torch.is_grad_enabled()):
        return buffer
    ctx.record("recv", g, src, slot, buffer.requires_grad_(), microbatch)
    return buffer
