"""Raw communication: out of place, not differentiable, and the only home of backend quirks.

Every function here works along dim 0 of a tensor, returns a new tensor and never writes to
its input. The differentiable ops in ``distgrad.collectives`` call these in both their forward
and backward passes, so no backward ever branches on the backend, and the CPU tests exercise
exactly the code that runs on GPUs.

Backend gaps handled here, once:

* On gloo, ``reduce_scatter`` runs one ``all_to_all`` (each rank sends every other rank that
  rank's slice, (N-1)/N of the tensor) and sums the N slices it receives locally, at every
  size. gloo's own reduce-scatter is never used: a wait on its work does not return at the
  wait's timeout, so the dead-peer watch could not run (see :func:`reduce_scatter`). NCCL's
  native reduce-scatter is used where it applies (equal sizes).
* gloo's ``all_gather`` is slower than the same exchange written as concurrent point-to-point
  pairs, so on gloo it is a batch of isend/irecv (which also takes unequal sizes as they are),
  except below :data:`GLOO_COLLECTIVE_BELOW_BYTES` per rank with equal sizes, where latency,
  not bandwidth, sets the time and gloo's own is faster. gloo's ``all_to_all`` is used below
  :data:`GLOO_ALL_TO_ALL_BELOW_BYTES`, pairs above.
* gloo's ``gather``/``scatter`` (and NCCL's ``all_gather``) reject unequal sizes; unequal sizes
  are padded to the largest and trimmed after.
* On gloo every exchange calls the process group's own methods (``pg.send``, ``pg.allreduce``,
  ...) with group ranks, not the ``torch.distributed`` wrappers: ``dist.P2POp`` with
  ``dist.batch_isend_irecv`` cost about 250 us of Python per exchange and ``dist.all_reduce``
  about 24 us over ``pg.allreduce``, for checks distgrad has already made. NCCL keeps the
  wrappers (``batch_isend_irecv`` groups its pairs into one NCCL group call).
* gloo moves CUDA tensors through host memory for some collectives and not at all for others
  (point-to-point sends abort the process, some reduce ops are refused), so on gloo every
  exchange of a CUDA tensor is staged here: copied to the host, exchanged there, copied back
  (``ExchangeOp(..., staged=True)``). gloo's own CUDA paths make the same copies.
* gloo does not fail an operation already moving bytes when its peer's connection closes, so a
  plain wait could last the whole timeout after a peer died: every wait on gloo goes through
  ``distgrad._wait``, which names the dead peer within tens of milliseconds, and every failed
  exchange says which op, which pass and which peer (``_wait.annotate``).
"""

from __future__ import annotations

import atexit
import functools
import math
import time
from collections.abc import Callable, Generator, Sequence
from typing import Any, Generic, ParamSpec, Protocol, TypeVar

import torch
import torch.distributed as dist
from torch import Tensor
from torch._C._distributed_c10d import (
    AllgatherOptions,
    AllreduceOptions,
    AllToAllOptions,
    BroadcastOptions,
    GatherOptions,
    ReduceOptions,
    ScatterOptions,
)

from distgrad import _guard, _wait
from distgrad._group import Group, collectives_unsettled, note_collective, settle_backend_threads

__all__ = [
    "Exchange",
    "ExchangeOp",
    "Pending",
    "Steps",
    "all_gather",
    "all_reduce",
    "all_to_all",
    "broadcast",
    "gather",
    "metadata_device",
    "permute",
    "reduce",
    "reduce_scatter",
    "scatter",
    "share",
    "start_exchange",
]

_T = TypeVar("_T")
_P = ParamSpec("_P")

_TORCH_OPS = {
    "sum": dist.ReduceOp.SUM,
    "prod": dist.ReduceOp.PRODUCT,
    "max": dist.ReduceOp.MAX,
    "min": dist.ReduceOp.MIN,
}


def _options(kind: Any, **fields: Any) -> Any:
    """A c10d options object for an asynchronous call (made once per op and reused)."""
    opts = kind()
    opts.asyncOp = True
    for name, value in fields.items():
        setattr(opts, name, value)
    return opts


_ALL_REDUCE_OPTIONS = {
    op: _options(AllreduceOptions, reduceOp=rop) for op, rop in _TORCH_OPS.items()
}
_ALL_GATHER_OPTIONS = _options(AllgatherOptions)


# torch 2.13 renamed the tensor forms of all_gather and reduce_scatter (the old names warn);
# torch >= 2.3 without the new names keeps working through the old ones.
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


# The autograd engine keeps a Python object (the caller's contextvars) in the thread-local state
# while a backward runs, and a collective started then captures that state in its work. gloo's
# worker thread often drops the last reference to a finished work, and destroying the captured
# Python object needs the GIL: if that happens while the interpreter is finalising (the job's
# last backward, then exit), the thread is made to exit inside a C++ destructor and the process
# aborts ("terminate called without an active exception"). Measured: 1 in 13 torchrun jobs.
# So every exchange is started with that object out of the thread-local state (put back at
# once): the work captures nothing of Python's. Plain torch collectives, never started inside a
# backward, never see it.
_ENGINE_TLS_KEY = "context"
_tls_api = getattr(torch._C, "_is_key_in_tls", None) is not None


def _start(start: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """``start(*args, **kwargs)``, with nothing of Python's in the thread-local state it
    captures (see above)."""
    if not _tls_api or not torch._C._is_key_in_tls(_ENGINE_TLS_KEY):
        return start(*args, **kwargs)
    stashed = torch._C._get_obj_in_tls(_ENGINE_TLS_KEY)
    torch._C._remove_obj_from_tls(_ENGINE_TLS_KEY)
    try:
        return start(*args, **kwargs)
    finally:
        torch._C._stash_obj_in_tls(_ENGINE_TLS_KEY, stashed)


def metadata_device(group: Group) -> torch.device:
    """Where small bookkeeping tensors must live for this group's backend."""
    if group.is_nccl:
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


# The tag of every point-to-point message distgrad sends (start_exchange): gloo pairs messages
# between two ranks by tag, in order, so an untagged message the user has in flight between the
# same ranks would otherwise be taken by distgrad's receive, or take distgrad's message. ("dg")
P2P_TAG = 0x6467


def share(values: Sequence[int], group: Group, desc: str = "a distgrad call") -> list[list[int]]:
    """Every rank's ``values`` (small integers, the same count on every rank), by group rank.

    A host synchronisation on NCCL (the result is read on the host): only metadata goes here.
    ``desc`` names the call whose metadata this is, in the error raised when a peer is gone.
    """
    if group.pg is None or group.size == 1:
        return [list(values)]
    mine = torch.tensor([list(values)], dtype=torch.int64, device=metadata_device(group))
    # A collective, not point-to-point pairs: pairs are faster alone (0.20 ms against 0.30 ms
    # on 2 ranks) but slower as the first exchange of a training step (1.0-1.8 ms against
    # 0.6-0.9 ms median, with more multi-millisecond stalls).
    every = mine.new_empty((group.size, len(values)))
    where = "forward" if torch._C._current_autograd_node() is None else "backward"
    what = f"the metadata handshake at the start of {desc}"
    doing = f"was waiting for its peers at the start of {desc}, in its {where}"
    if group.is_nccl:
        _begin(group, _all_gather_single, every, mine, group=group.pg, async_op=True).wait()
    else:
        start = group.pg._allgather_base
        _begin(group, start, every, mine, _ALL_GATHER_OPTIONS, what=what, doing=doing).wait()
    return every.tolist()  # type: ignore[no-any-return]


def _begin(
    on: Group,
    start: Callable[..., Any],
    /,
    *args: Any,
    what: _wait.What = None,
    doing: str | None = None,
    **kwargs: Any,
) -> _Started:
    """Start a collective on ``on`` with ``start(*args, **kwargs)``; ``wait()`` the result.

    gloo's worker thread lets go of the tensors handed to it a moment after this thread wakes,
    and that release takes the GIL while Python also holds a tensor (torch then holds its
    Python object). Waiting here for the release costs up to a
    GIL switch interval (5 ms) per call when the worker lags (measured: 11.9 against 6.6 ms per
    all_gather + all_reduce forward and backward at (64, 128), 2 ranks), so the release is only
    made safe where it can fail, at exit (:func:`_settle_at_exit`).
    """
    note_collective()
    return _Started(_start(start, *args, **kwargs), on, what, doing)


class _Started:
    """A collective in flight; :meth:`wait` finishes it (see :func:`_finish`)."""

    __slots__ = ("_doing", "_group", "_what", "_work")

    def __init__(self, work: Any, group: Group, what: _wait.What, doing: str | None) -> None:
        self._work = work
        self._group = group
        self._what = what
        self._doing = doing

    def wait(self) -> None:
        # The work goes when the wait returns, as a local of the caller would: not when the
        # op's last steps are done (measured: 15-25 us more CPU per call on gloo otherwise).
        work, self._work = self._work, None
        _finish(work, self._group, self._what, self._doing)

    def describe_now(self) -> None:
        self._what = self._what or _wait.StartedEarlier(self._group)


def _settle_at_exit() -> None:
    """Let the backend's threads finish releasing the last works while the interpreter can
    still give them the GIL (``_group.settle_backend_threads``): a thread that asks for it once
    finalising has begun is made to exit inside a C++ destructor ("terminate called without an
    active exception"), and the process aborts. Only a process that ran a collective since the
    last settle (``destroy_process_group`` settles), or still has a process group (DDP's works
    capture the same state), pays, once."""
    if collectives_unsettled() or (dist.is_available() and dist.is_initialized()):
        settle_backend_threads()


atexit.register(_settle_at_exit)


def _finish(work: Any, group: Group, what: _wait.What = None, doing: str | None = None) -> None:
    """Wait for a collective started asynchronously: in ticks on gloo (``_wait``); ``what``
    and ``doing`` describe the call in errors (default: the op and pass running)."""
    if group.is_nccl:
        # No timed wait on NCCL: it would block the host until the GPU is done.
        start = time.monotonic()
        try:
            work.wait()
        except RuntimeError as exc:
            raise _wait.annotate(exc, group, _wait.others(group), start, what, doing) from None
    else:
        _wait.wait_collective(work, group, what, doing)


def _real(x: Tensor) -> Tensor:
    """gloo moves real numbers: a complex tensor travels as its (..., 2) real view."""
    return torch.view_as_real(x) if x.is_complex() else x


def _pad_rows(x: Tensor, rows: int) -> Tensor:
    if x.shape[0] == rows:
        return x.contiguous()
    out = x.new_zeros((rows, *x.shape[1:]))
    out[: x.shape[0]] = x
    return out


def _trim_cat(padded: Tensor, sizes: Sequence[int]) -> Tensor:
    """[N * max, ...] padded blocks -> the concatenation of the first sizes[i] rows of block i."""
    width = max(sizes)
    if all(s == width for s in sizes):
        return padded
    blocks = padded.view(len(sizes), width, *padded.shape[1:])
    return torch.cat([blocks[i, :s] for i, s in enumerate(sizes)])


def _on_host(group: Group, device: torch.device) -> bool:
    """Whether a tensor on ``device`` is staged through host memory to cross ``group``."""
    return group.pg is not None and not group.is_nccl and device.type != "cpu"


# Staging on gloo (``ExchangeOp(..., staged=True)``): a CUDA ``x`` is copied to the host, the
# exchange runs there, and the result is copied back to ``x``'s device. Why: gloo takes CUDA
# tensors only in some collectives, by copying them to the host itself, and its point-to-point
# sends hand the device pointer to the socket (the process aborts with "writev: Bad address").
# Staging every exchange makes every op work, at the cost of those same copies, and a host
# synchronisation (gloo's CUDA paths synchronise too).


def _through_host(steps: Steps[Tensor | None], device: torch.device) -> Steps[Tensor | None]:
    out = yield from steps
    return None if out is None else out.to(device)


# ---------------------------------------------------------------------------------------------
# Steps: every op is written once, as a generator that starts its one exchange, yields it, and
# finishes (the copies, the guard's check) when resumed. The blocking call drives it through at
# once; ``op.start(...)`` runs it up to the exchange and returns a :class:`Pending` that finishes
# it later (``async_op=True``). The exchange is started on the calling thread, in call order, so
# collectives stay in the same order on every rank whatever the caller does in between.


class _Waitable(Protocol):
    def wait(self) -> None: ...

    def describe_now(self) -> None:
        """Fix what errors of the wait will name: the call running now, not then."""


Steps = Generator[_Waitable, None, _T]


class Pending(Generic[_T]):
    """An op whose exchange is in flight: :meth:`wait` waits for it and returns the result.

    Its steps run on :meth:`wait`'s thread, once; an error is raised there, and again by every
    later ``wait``.
    """

    __slots__ = ("_error", "_steps", "_value", "_waiting")

    def __init__(self, steps: Steps[_T]) -> None:
        self._steps = steps
        self._error: BaseException | None = None
        self._waiting: _Waitable | None = None
        try:
            self._waiting = next(steps)
            self._waiting.describe_now()
        except StopIteration as finished:  # nothing to exchange (a group of one)
            self._value: _T = finished.value

    def wait(self) -> _T:
        if self._error is not None:
            raise self._error
        try:
            while self._waiting is not None:
                waiting, self._waiting = self._waiting, None
                waiting.wait()
                try:
                    self._waiting = self._steps.send(None)
                except StopIteration as finished:
                    self._value = finished.value
        except BaseException as exc:
            self._error = exc
            raise
        return self._value


class ExchangeOp(Generic[_P, _T]):
    """An op written as steps: call it to run it through, or ``start`` it (see above).

    ``staged``: the op is ``op(x, ..., group)``, and a CUDA ``x`` on gloo goes through host
    memory (see "Staging on gloo" above); the check is made here, inline, as the hot path's
    one test of ``x.is_cpu``.
    """

    def __init__(self, steps: Callable[_P, Steps[_T]], staged: bool = False) -> None:
        self.steps = steps
        self.staged = staged
        functools.update_wrapper(self, steps)

    def __call__(self, *args: _P.args, **kwargs: _P.kwargs) -> _T:
        a: tuple[Any, ...] = args
        if self.staged and not a[0].is_cpu and _on_host(a[-1], a[0].device):
            steps = self._through_host(*a)
        else:
            steps = self.steps(*args, **kwargs)
        try:
            waiting = next(steps)
            while True:
                waiting.wait()
                waiting = steps.send(None)
        except StopIteration as finished:
            value: _T = finished.value
            return value

    def start(self, *args: _P.args, **kwargs: _P.kwargs) -> Pending[_T]:
        a: tuple[Any, ...] = args
        if self.staged and not a[0].is_cpu and _on_host(a[-1], a[0].device):
            return Pending(self._through_host(*a))
        return Pending(self.steps(*args, **kwargs))

    def _through_host(self, x: Tensor, *args: Any) -> Steps[_T]:
        steps: Callable[..., Steps[Any]] = self.steps
        return _through_host(steps(x.cpu(), *args), x.device)  # type: ignore[return-value]


def _staged(steps: Callable[_P, Steps[_T]]) -> ExchangeOp[_P, _T]:
    """``ExchangeOp(steps, staged=True)``, as a decorator."""
    return ExchangeOp(steps, staged=True)


# ---------------------------------------------------------------------------------------------
# Point-to-point exchanges


class Exchange:
    """Point-to-point sends and receives in flight; :meth:`wait` finishes them all.

    Started by :func:`start_exchange`. Waiting goes through ``distgrad._wait``, so a peer that
    dies during the exchange is an error naming it within tens of milliseconds.
    """

    __slots__ = ("_group", "_landings", "_largest", "_peers", "_what", "_works")

    def __init__(
        self,
        works: list[Any],
        peers: list[int],
        largest: int,
        group: Group,
        landings: Sequence[tuple[Tensor, Tensor]] = (),
    ) -> None:
        self._works = works
        self._peers = peers
        self._largest = largest
        self._group = group
        self._landings = landings  # (host buffer, its device target): staged receives
        self._what: _wait.What = None

    def wait(self) -> None:
        works, self._works = self._works, []  # gone when the wait returns (see _Started)
        if works:
            _wait.wait_pairs(works, self._peers, self._group, self._largest, self._what)
        for host, target in self._landings:
            target.copy_(host)

    def describe_now(self) -> None:
        self._what = self._what or _wait.StartedEarlier(self._group)


def start_exchange(
    sends: Sequence[tuple[Tensor, int]], recvs: Sequence[tuple[Tensor, int]], group: Group
) -> Exchange:
    """Start sending each ``(tensor, peer)`` of ``sends`` and receiving into each of ``recvs``
    (contiguous tensors, group ranks), tagged so that they never meet the user's own messages.
    Sends are started first, in order, then receives."""
    pg = group.pg
    assert pg is not None
    if any(_on_host(group, t.device) for t, _ in (*sends, *recvs)):  # see "Staging on gloo"
        landings = [(torch.empty_like(t, device="cpu"), t) for t, _ in recvs]
        host_sends = [(t.cpu(), peer) for t, peer in sends]
        host_recvs = [(host, peer) for (host, _), (_, peer) in zip(landings, recvs, strict=True)]
        staged = start_exchange(host_sends, host_recvs, group)
        staged._landings = landings
        return staged
    peers = [peer for _, peer in sends] + [peer for _, peer in recvs]
    largest = max((_nbytes(t) for t, _ in (*sends, *recvs)), default=0)
    if group.is_nccl:
        ops = [dist.P2POp(dist.isend, t, group.global_rank(p), pg, tag=P2P_TAG) for t, p in sends]
        ops += [dist.P2POp(dist.irecv, t, group.global_rank(p), pg, tag=P2P_TAG) for t, p in recvs]
        works = _start(dist.batch_isend_irecv, ops) if ops else []
    else:
        # The process group's own methods take group ranks; 0.25 ms faster than P2POp.
        works = []
        try:
            for t, peer in sends:
                works.append(pg.send([_real(t)], peer, P2P_TAG))
            for t, peer in recvs:
                works.append(pg.recv([_real(t)], peer, P2P_TAG))
        except RuntimeError as exc:  # gloo refuses to post on a connection already closed
            raise _wait.annotate(exc, group, [peers[len(works)]], time.monotonic()) from None
    return Exchange(works, peers, largest, group)


def _nbytes(x: Tensor) -> int:
    return x.numel() * x.element_size()


# Below this many bytes per rank, gloo's all_gather finishes sooner than concurrent
# point-to-point pairs; from there on the pairs win. Measured on 2 ranks over loopback,
# forward+backward, 300-400 paired rounds: an all_gather of 64-128 KB per rank 0.87x-0.94x the
# pairs' time; at 256 KB 0.94x-1.05x, at 512 KB 1.16x, at 2 MB 1.29x-1.35x.
# (docs/semantics.md, "How the data moves on gloo".)
GLOO_COLLECTIVE_BELOW_BYTES = 256 * 1024

# The dtypes gloo's all_gather and all_to_all take; others go as pairs (which move any dtype).
_GLOO_COLLECTIVE_DTYPES = frozenset(
    {
        torch.float32,
        torch.float64,
        torch.float16,
        torch.bfloat16,
        torch.int32,
        torch.int64,
        torch.int8,
        torch.uint8,
    }
)


def _use_gloo_collective(piece: Tensor, sizes: Sequence[int]) -> bool:
    """Whether an all_gather on gloo whose per-rank piece is ``piece`` goes through gloo's own
    all_gather: small, equal sizes, a dtype gloo takes."""
    return (
        piece.dtype in _GLOO_COLLECTIVE_DTYPES
        and _nbytes(piece) < GLOO_COLLECTIVE_BELOW_BYTES
        and all(s == sizes[0] for s in sizes)
    )


def _exchange_by_pairs(
    sent: Sequence[Tensor], received: Sequence[Tensor], group: Group
) -> Steps[None]:
    """Send ``sent[i]`` to group rank i and receive ``received[i]`` from it, all at once.

    This rank's own pair is a local copy. The same bytes as gloo's all_gather and
    all_to_all_single, which are slower: 2 ranks, (4096, 512) float32 all_gather over
    loopback 8.2 ms against 9.3 ms (3 ranks: 15.4 ms against 18.8 ms). Not measured: large
    groups across machines, where each rank's N - 1 concurrent flows meet a ring's two
    neighbours; a ring all_gather would be the thing to try there.
    """
    # A pair with nothing to move is skipped on both sides: the receiver's size for it equals
    # the sender's (the handshake checked it).
    others = [peer for peer in range(group.size) if peer != group.rank]
    sends = [(sent[peer], peer) for peer in others if sent[peer].numel()]
    recvs = [(received[peer], peer) for peer in others if received[peer].numel()]
    exchange = start_exchange(sends, recvs, group)
    received[group.rank].copy_(sent[group.rank])  # while the peers' bytes are on their way
    yield exchange


@_staged
def all_gather(x: Tensor, sizes: Sequence[int], group: Group) -> Steps[Tensor]:
    """Concatenate every rank's ``x`` along dim 0; ``sizes[i]`` is rank i's row count."""
    if group.pg is None:
        return x.clone()
    if not _guard.enabled():
        return (yield from _all_gather(x, sizes, group))
    # Guarded (distgrad._guard): each rank's rows travel as bytes followed by its 8-byte tag,
    # gathered as byte pieces of sizes[i] * row + 8, and compacted after the tags are read.
    tag = _guard.byte_tag(group, "all_gather", x.dtype, x.shape[1:], f"sizes={list(sizes)}")
    pieces = [s * _row_bytes(x) + _guard.BYTES for s in sizes]
    received = yield from _all_gather(_tagged([x], tag), pieces, group)
    return _untagged(received, pieces, tag, group, x, sum(sizes))


def _bytes(x: Tensor) -> Tensor:
    """``x``'s bytes, flat (a view when ``x`` is contiguous)."""
    flat = x.contiguous().view(-1)
    if flat.numel() <= 1 and flat.stride(0) != 1:  # a lone entry keeps any stride it had
        flat = flat.clone(memory_format=torch.contiguous_format)
    return flat.view(torch.uint8)


def _row_bytes(x: Tensor) -> int:
    return math.prod(x.shape[1:]) * x.element_size()


def _tagged(parts: Sequence[Tensor], tag: _guard.Tag) -> Tensor:
    """Each part's bytes followed by ``tag``'s, concatenated: one copy (see distgrad._guard)."""
    mark = _guard.tag_tensor(tag, torch.uint8, parts[0].device)
    return torch.cat([piece for part in parts for piece in (_bytes(part), mark)])


def _untagged(
    received: Tensor, pieces: Sequence[int], tag: _guard.Tag, group: Group, like: Tensor, rows: int
) -> Tensor:
    """Check the tag after each of ``received``'s byte ``pieces`` (each ends in one), and return
    the data before them as ``rows`` rows of ``like``'s row shape and dtype."""
    blocks = torch.split(received, list(pieces))
    _guard.check(torch.stack([b[-_guard.BYTES :] for b in blocks]), tag, group)
    data = torch.cat([b[: -_guard.BYTES] for b in blocks])
    return data.view(like.dtype).view(rows, *like.shape[1:])


def _all_gather(x: Tensor, sizes: Sequence[int], group: Group) -> Steps[Tensor]:
    assert group.pg is not None
    if not group.is_nccl:
        out = x.new_empty((sum(sizes), *x.shape[1:]))
        mine = x.contiguous()
        if _use_gloo_collective(mine, sizes):
            yield _begin(group, group.pg._allgather_base, out, mine, _ALL_GATHER_OPTIONS)
            return out
        blocks = torch.split(out, list(sizes))  # views into ``out``, each contiguous
        yield from _exchange_by_pairs([mine] * group.size, blocks, group)
        return out
    width = max(sizes)
    send = _pad_rows(x, width)
    out = send.new_empty((width * group.size, *x.shape[1:]))
    yield _begin(group, _all_gather_single, out, send, group=group.pg, async_op=True)
    return _trim_cat(out, sizes)


@_staged
def reduce_scatter(x: Tensor, sizes: Sequence[int], group: Group) -> Steps[Tensor]:
    """Sum ``x`` over ranks and return this rank's slice (``sizes[rank]`` rows) of the sum."""
    if group.pg is None:
        return x.clone()
    mine = sizes[group.rank]
    if group.is_nccl and all(s == mine for s in sizes):
        out = x.new_empty((mine, *x.shape[1:]))
        yield _begin(
            group, _reduce_scatter_single, out, x.contiguous(), group=group.pg, async_op=True
        )
        return out
    # One all_to_all (gloo's own below 32 MB), then a local sum, at every size. Not gloo's own
    # reduce-scatter: a wait on its work does not return at the wait's timeout (measured: a
    # 20 ms wait returned when the peer came, 200 ms later), so the dead-peer watch cannot
    # tick. Not an all_reduce and a slice either (what this was below 256 KB per slice): that
    # moves twice the bytes in a ring of 2(N-1) steps, the all_to_all in one; measured raw,
    # paired, it took 1.20x-1.46x of the all_to_all and sum's time on 2 ranks (4-256 KB
    # slices), 1.47x-1.97x on 4 and 2.80x-3.39x on 8 (benchmarks/results/exchanges.md).
    slices = yield from all_to_all.steps(x, sizes, [mine] * group.size, group)
    # Sum in rank order, the same order on every backend and run: results are reproducible.
    return slices.view(group.size, mine, *x.shape[1:]).sum(0)


@_staged
def all_to_all(
    x: Tensor, input_sizes: Sequence[int], output_sizes: Sequence[int], group: Group
) -> Steps[Tensor]:
    """Send rows ``input_sizes[i]`` of ``x`` to rank i; receive ``output_sizes[i]`` from rank i."""
    if group.pg is None:
        return x.clone()
    if not _guard.enabled():
        return (yield from _all_to_all(x, input_sizes, output_sizes, group))
    # Guarded: each chunk's bytes and a tag, exchanged as byte chunks, compacted after.
    tag = _guard.byte_tag(group, "all_to_all", x.dtype, x.shape[1:], "")
    row = _row_bytes(x)
    sent = _tagged(torch.split(x, list(input_sizes)), tag)
    out_pieces = [s * row + _guard.BYTES for s in output_sizes]
    in_pieces = [s * row + _guard.BYTES for s in input_sizes]
    received = yield from _all_to_all(sent, in_pieces, out_pieces, group)
    return _untagged(received, out_pieces, tag, group, x, sum(output_sizes))


def _all_to_all(
    x: Tensor, input_sizes: Sequence[int], output_sizes: Sequence[int], group: Group
) -> Steps[Tensor]:
    assert group.pg is not None
    out = x.new_empty((sum(output_sizes), *x.shape[1:]))
    if group.is_nccl:
        yield _begin(
            group,
            dist.all_to_all_single,
            out,
            x.contiguous(),
            list(output_sizes),
            list(input_sizes),
            group=group.pg,
            async_op=True,
        )
    elif x.dtype in _GLOO_COLLECTIVE_DTYPES and _nbytes(x) < GLOO_ALL_TO_ALL_BELOW_BYTES:
        yield _begin(
            group,
            group.pg.alltoall_base,
            out,
            x.contiguous(),
            list(output_sizes),
            list(input_sizes),
            _ALL_TO_ALL_OPTIONS,
        )
    else:
        sent = torch.split(x.contiguous(), list(input_sizes))
        received = torch.split(out, list(output_sizes))  # views into ``out``, each contiguous
        yield from _exchange_by_pairs(sent, received, group)
    return out


# Below this many bytes of input per rank, gloo's own all_to_all beats concurrent
# point-to-point pairs (uneven sizes included); at 64 MB they are even. Measured raw, forward
# only, 10-30 paired rounds, gloo's time over the pairs': 2 ranks 0.82x at 256 KB, 0.60x at
# 1 MB, 0.69x at 4 MB, 0.74x at 16 MB, 1.08x at 64 MB; 4 ranks 0.74x, 0.91x, 0.74x, 0.73x,
# 1.01x. (An earlier note had the pairs at half gloo's time at 16 MB on 2 ranks: not reproduced.)
GLOO_ALL_TO_ALL_BELOW_BYTES = 32 * 1024 * 1024
_ALL_TO_ALL_OPTIONS = AllToAllOptions()


@_staged
def permute(
    x: Tensor, perm: Sequence[int], recv_shape: Sequence[int], group: Group
) -> Steps[Tensor]:
    """Send ``x`` to group rank ``perm[rank]``; return what the rank that maps here sent."""
    if group.pg is None or perm[group.rank] == group.rank:
        return x.clone()
    source = list(perm).index(group.rank)
    if not _guard.enabled():
        out = x.new_empty(tuple(recv_shape))
        yield start_exchange([(x.contiguous(), perm[group.rank])], [(out, source)], group)
        return out
    # Guarded: the sender tags what it sends (its shape), the receiver checks against what it
    # expects (recv_shape); a receiver's tag bytes start as zeros, which no tag is.
    sent_tag = _guard.byte_tag(group, "permute", x.dtype, x.shape, "")
    want = _guard.byte_tag(group, "permute", x.dtype, recv_shape, "", counted=False)
    n = math.prod(recv_shape) * x.element_size()
    buf = torch.empty(n + _guard.BYTES, dtype=torch.uint8, device=x.device)
    buf[n:].zero_()
    sent = _tagged([x], sent_tag)
    yield start_exchange([(sent, perm[group.rank])], [(buf, source)], group)
    _guard.check(buf[n:], want, group)
    return buf[:n].view(x.dtype).view(tuple(recv_shape))


# ---------------------------------------------------------------------------------------------
# Collectives


@_staged
def all_reduce(x: Tensor, op: str, group: Group) -> Steps[Tensor]:
    """Reduce ``x`` over ranks with ``op`` in sum, prod, max, min; every rank gets the result."""
    if group.pg is None:
        return x.clone(memory_format=torch.contiguous_format)
    tag = _guard.reduced_tag(group, "all_reduce", x, op)
    out, tail = _with_tail(x, tag)
    if group.is_nccl or out.is_complex():  # torch's wrapper says which ops take complex
        yield _begin(group, dist.all_reduce, out, op=_TORCH_OPS[op], group=group.pg, async_op=True)
    else:
        yield _begin(group, group.pg.allreduce, [out], _ALL_REDUCE_OPTIONS[op])
    if tag is None:
        return out
    _guard.check(out[tail:], tag, group, group.size)
    return _leading(out, x.shape)


def _leading(flat: Tensor, shape: Sequence[int]) -> Tensor:
    """The first entries of the flat, contiguous ``flat`` as a tensor of ``shape``: the data
    before a guard's tag (``as_strided``: 1.5 us where slicing and ``view`` take 6-9 us)."""
    strides, stride = [], 1
    for size in reversed(shape):
        strides.append(stride)
        stride *= max(size, 1)
    return flat.as_strided(tuple(shape), strides[::-1])


def _with_tail(x: Tensor, tag: _guard.Tag | None) -> tuple[Tensor, int]:
    """A fresh contiguous copy of ``x`` to reduce in place: ``x`` itself when unguarded, else
    flat with ``tag``'s values after ``x``'s (at index ``x.numel()``, returned). The same one
    copy either way, so the guard costs the tag's few elements."""
    if tag is None:
        return x.clone(memory_format=torch.contiguous_format), 0
    return torch.cat([x.reshape(-1), _guard.tag_tensor(tag, x.dtype, x.device)]), x.numel()


@_staged
def broadcast(x: Tensor, src: int, group: Group) -> Steps[Tensor]:
    """Every rank gets group rank ``src``'s ``x`` (other ranks' values are not read)."""
    if group.pg is None:
        return x.clone()
    if not _guard.enabled():
        out = (
            x.clone(memory_format=torch.contiguous_format)
            if group.rank == src
            else torch.empty_like(x, memory_format=torch.contiguous_format)
        )
        yield from _broadcast(out, src, group)
        return out
    # Guarded: the source's bytes and its tag in one buffer (the copy the source makes anyway);
    # a receiver's tag bytes start as zeros, which no tag is, so bytes not written mismatch.
    tag = _guard.byte_tag(group, "broadcast", x.dtype, x.shape, f"src={src}")
    n = _nbytes(x)
    buf = torch.empty(n + _guard.BYTES, dtype=torch.uint8, device=x.device)
    if group.rank == src:
        buf[:n].copy_(_bytes(x))
        buf[n:].copy_(_guard.tag_tensor(tag, torch.uint8, x.device))
    else:
        buf[n:].zero_()
    yield from _broadcast(buf, src, group)
    if group.rank != src:
        _guard.check(buf[n:], tag, group)
    return buf[:n].view(x.dtype).view(x.shape)


def _broadcast(out: Tensor, src: int, group: Group) -> Steps[None]:
    assert group.pg is not None
    if group.is_nccl:
        yield _begin(
            group,
            dist.broadcast,
            out,
            src=group.global_rank(src),
            group=group.pg,
            async_op=True,
        )
    else:
        opts = _options(BroadcastOptions, rootRank=src, rootTensor=0)
        moved = _real(out)
        yield _begin(group, group.pg.broadcast, [moved], opts)


@_staged
def reduce(x: Tensor, dst: int, group: Group) -> Steps[Tensor | None]:
    """The sum of ``x`` over ranks on group rank ``dst``; None on the other ranks."""
    if group.pg is None:
        return x.clone(memory_format=torch.contiguous_format)
    tag = _guard.reduced_tag(group, "reduce", x, "sum", f", dst={dst}")  # None for complex
    out, tail = _with_tail(x, tag)
    if group.is_nccl:
        yield _begin(
            group,
            dist.reduce,
            out,
            dst=group.global_rank(dst),
            op=dist.ReduceOp.SUM,
            group=group.pg,
            async_op=True,
        )
    else:
        opts = _options(ReduceOptions, rootRank=dst, rootTensor=0, reduceOp=dist.ReduceOp.SUM)
        moved = _real(out)  # a complex sum is the sum of its parts
        yield _begin(group, group.pg.reduce, [moved], opts)
    if group.rank != dst:
        return None
    if tag is None:
        return out
    _guard.check(out[tail:], tag, group, group.size)
    return _leading(out, x.shape)


@_staged
def gather(x: Tensor, sizes: Sequence[int], dst: int, group: Group) -> Steps[Tensor | None]:
    """Rank ``dst`` gets every rank's ``x`` concatenated along dim 0; None elsewhere."""
    if group.pg is None:
        return x.clone()
    if not _guard.enabled():
        return (yield from _gather(x, sizes, dst, group))
    # Guarded: as all_gather, to one rank.
    tag = _guard.byte_tag(group, "gather", x.dtype, x.shape[1:], f"sizes={list(sizes)}, dst={dst}")
    pieces = [s * _row_bytes(x) + _guard.BYTES for s in sizes]
    received = yield from _gather(_tagged([x], tag), pieces, dst, group)
    if received is None:
        return None
    return _untagged(received, pieces, tag, group, x, sum(sizes))


def _gather(x: Tensor, sizes: Sequence[int], dst: int, group: Group) -> Steps[Tensor | None]:
    assert group.pg is not None
    width = max(sizes)
    send = _pad_rows(x, width)
    out = send.new_empty((group.size * width, *x.shape[1:])) if group.rank == dst else None
    parts = list(out.chunk(group.size)) if out is not None else None
    if group.is_nccl:
        yield _begin(
            group,
            dist.gather,
            send,
            parts,
            dst=group.global_rank(dst),
            group=group.pg,
            async_op=True,
        )
    else:
        outputs = [[_real(p) for p in parts]] if parts is not None else []
        sent = _real(send)
        opts = _options(GatherOptions, rootRank=dst)
        yield _begin(group, group.pg.gather, outputs, [sent], opts)
    return _trim_cat(out, sizes) if out is not None else None


@ExchangeOp
def scatter(
    x: Tensor | None,
    sizes: Sequence[int],
    src: int,
    trailing: Sequence[int],
    dtype: torch.dtype,
    device: torch.device,
    group: Group,
) -> Steps[Tensor]:
    """Rank i gets ``sizes[i]`` rows of group rank ``src``'s ``x``, split in rank order."""
    if group.pg is None:
        assert x is not None
        return x.clone()
    if _on_host(group, device):  # see "Staging on gloo"
        host = None if x is None else x.cpu()
        cpu = torch.device("cpu")
        out = yield from scatter.steps(host, sizes, src, trailing, dtype, cpu, group)
        return out.to(device)
    if not _guard.enabled():
        return (yield from _scatter(x, sizes, src, trailing, dtype, device, group))
    # Guarded: the source tags each part with what it sends (its dtype and row shape); each
    # receiver checks against what it expects (``dtype``, ``trailing``).
    args = f"sizes={list(sizes)}, src={src}"
    row = math.prod(trailing) * dtype.itemsize
    tagged = None
    is_src = group.rank == src
    if is_src:  # (other ranks' x, if any, is not read)
        assert x is not None
        sent = _guard.byte_tag(group, "scatter", x.dtype, x.shape[1:], args)
        tagged = _tagged(torch.split(x, list(sizes)), sent)
    want = _guard.byte_tag(group, "scatter", dtype, trailing, args, counted=not is_src)
    pieces = [s * row + _guard.BYTES for s in sizes]
    mine = pieces[group.rank]
    received = yield from _scatter(
        tagged, pieces, src, (), torch.uint8, device, group, zero_tail=True
    )
    _guard.check(received[mine - _guard.BYTES :], want, group)
    data = received[: mine - _guard.BYTES]
    return data.view(dtype).view(sizes[group.rank], *trailing)


def _scatter(
    x: Tensor | None,
    sizes: Sequence[int],
    src: int,
    trailing: Sequence[int],
    dtype: torch.dtype,
    device: torch.device,
    group: Group,
    zero_tail: bool = False,
) -> Steps[Tensor]:
    """``scatter``'s exchange; ``zero_tail``: the output's last tag bytes start as zeros."""
    assert group.pg is not None
    width = max(sizes)
    out = torch.empty((width, *trailing), dtype=dtype, device=device)
    if zero_tail:
        out[sizes[group.rank] - _guard.BYTES : sizes[group.rank]].zero_()
    chunks = None
    if group.rank == src:
        assert x is not None
        chunks = [_pad_rows(part, width) for part in torch.split(x, list(sizes))]
    if group.is_nccl:
        yield _begin(
            group,
            dist.scatter,
            out,
            chunks,
            src=group.global_rank(src),
            group=group.pg,
            async_op=True,
        )
    else:
        inputs = [[_real(c) for c in chunks]] if chunks is not None else []
        received = _real(out)
        opts = _options(ScatterOptions, rootRank=src)
        yield _begin(group, group.pg.scatter, [received], inputs, opts)
    return out[: sizes[group.rank]]
