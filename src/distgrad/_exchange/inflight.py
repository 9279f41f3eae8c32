"""Exchanges in flight: starting a c10d call, waiting for it, and the steps every exchange is
written as, so that one definition runs blocking or with ``async_op=True``.

Every exchange (``distgrad._exchange.ops``) is a generator of steps: it starts its c10d call,
yields what waits for it, and finishes (the copies, the guard's check) when resumed. The
blocking call drives it through at once (:func:`drive`); a started one runs up to the exchange,
and a :class:`Pending` finishes it later (``async_op=True``, a ring's step). The exchange is started
on the calling thread, in call order, so collectives stay in the same order on every rank
whatever the caller does in between. Every wait goes through ``distgrad._exchange.wait``.
"""

from __future__ import annotations

import atexit
import time
from collections.abc import Callable, Generator
from typing import Any, Generic, Protocol, TypeVar

import torch
import torch.distributed as dist

from distgrad._exchange import wait as _wait
from distgrad._exchange.group import (
    Group,
    collectives_unsettled,
    note_collective,
    settle_backend_threads,
)

__all__ = [
    "Done",
    "InFlight",
    "Pending",
    "Started",
    "Steps",
    "begin",
    "drive",
    "start_outside_engine",
    "through_host",
]

_T = TypeVar("_T")
_T_co = TypeVar("_T_co", covariant=True)


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


def start_outside_engine(start: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
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


def begin(
    on: Group,
    start: Callable[..., Any],
    /,
    *args: Any,
    what: _wait.What = None,
    doing: str | None = None,
    **kwargs: Any,
) -> Started:
    """Start a collective on ``on`` with ``start(*args, **kwargs)``; ``wait()`` the result.

    gloo's worker thread lets go of the tensors handed to it a moment after this thread wakes,
    and that release takes the GIL while Python also holds a tensor (torch then holds its
    Python object). Waiting here for the release costs up to a
    GIL switch interval (5 ms) per call when the worker lags (measured: 11.9 against 6.6 ms per
    all_gather + all_reduce forward and backward at (64, 128), 2 ranks), so the release is only
    made safe where it can fail, at exit (:func:`_settle_at_exit`).
    """
    note_collective()
    if _tls_api and torch._C._is_key_in_tls(_ENGINE_TLS_KEY):
        work = start_outside_engine(start, *args, **kwargs)
    else:  # (start_outside_engine's test, inline: one Python call less on every exchange)
        work = start(*args, **kwargs)
    return Started(work, on, what, doing)


class Started:
    """A collective in flight; :meth:`wait` waits for it: in ticks on gloo, with errors that
    say which op, which pass and which peer (``what`` and ``doing``: default the op and pass
    running)."""

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
        if self._group.is_nccl:
            _finish_on_nccl(work, self._group, self._what, self._doing)
        else:  # in ticks (distgrad._exchange.wait)
            _wait.wait_collective(work, self._group, self._what, self._doing)

    def describe_now(self) -> None:
        self._what = self._what or _wait.StartedEarlier(self._group)


def _settle_at_exit() -> None:
    """Let the backend's threads finish releasing the last works while the interpreter can
    still give them the GIL (``group.settle_backend_threads``): a thread that asks for it once
    finalising has begun is made to exit inside a C++ destructor ("terminate called without an
    active exception"), and the process aborts. Only a process that ran a collective since the
    last settle (``destroy_process_group`` settles), or still has a process group (DDP's works
    capture the same state), pays, once. distgrad's own helper threads are let finish first
    (:func:`_let_helpers_finish`)."""
    _let_helpers_finish()
    if collectives_unsettled() or (dist.is_available() and dist.is_initialized()):
        settle_backend_threads()


# A wait left by an exception (^C, distgrad's error naming a dead peer) leaves its helper thread
# (``wait.wait_pairs``) blocked in gloo's wait, the GIL released. When that wait returns during
# finalisation (the exchange completes as the peers catch up, or fails as they exit), the
# helper takes the GIL inside pybind's destructor and the process aborts, as above: 5 of 23
# torchrun jobs of 4 processes all ^C'd during their calls, every aborting rank interrupted in
# ``wait_pairs``. So the exit waits for such a helper, for a bounded time: one whose peers come
# or exit within it is safe; one whose peers come later (or whose peer died mid-transfer, kept
# until the group's timeout) is given up on, and the abort stays possible. The bound keeps a
# ^C'd rank's exit prompt, and a ``run_on_ranks`` rank inside its 5 s to exit.
_HELPERS_GRACE_S = 2.0


def _let_helpers_finish() -> None:
    """Wait, up to :data:`_HELPERS_GRACE_S`, for distgrad's helper threads still waiting on an
    exchange (none in a job whose waits all returned: this costs nothing then)."""
    deadline = time.monotonic() + _HELPERS_GRACE_S
    while _wait.busy_helpers() and time.monotonic() < deadline:
        time.sleep(_wait.TICK_S)


atexit.register(_settle_at_exit)


def _finish_on_nccl(work: Any, group: Group, what: _wait.What, doing: str | None) -> None:
    """Wait for a collective on NCCL; ``what`` and ``doing`` describe the call in errors."""
    # No timed wait on NCCL: it would block the host until the GPU is done.
    start = time.monotonic()
    try:
        work.wait()
    except RuntimeError as exc:
        raise _wait.annotate(exc, group, _wait.others(group), start, what, doing) from None


# Staging on gloo (an exchange declared ``staged``, ``distgrad._exchange.declare``): a CUDA
# ``x`` is copied to the host, the exchange runs there, and the result is copied back to
# ``x``'s device. Why: gloo takes CUDA tensors only in some collectives, by copying them to the
# host itself, and its point-to-point sends hand the device pointer to the socket (the process
# aborts with "writev: Bad address"). Staging every exchange makes every op work, at the cost of
# those same copies, and a host synchronisation (gloo's CUDA paths synchronise too).


def through_host(steps: Steps[_T], device: torch.device) -> Steps[_T]:
    """``steps`` (started on a host copy of their input), their result moved to ``device``."""
    out = yield from steps
    return out if out is None else out.to(device)  # type: ignore[attr-defined, no-any-return]


# ---------------------------------------------------------------------------------------------
# Steps (the module's docstring says how they run).


class _Waitable(Protocol):
    def wait(self) -> None: ...

    def describe_now(self) -> None:
        """Fix what errors of the wait will name: the call running now, not then."""


Steps = Generator[_Waitable, None, _T]


class InFlight(Protocol[_T_co]):
    """An exchange started and not waited for: :meth:`wait` returns its result."""

    def wait(self) -> _T_co: ...


class Pending(Generic[_T]):
    """An op whose exchange is in flight: :meth:`wait` waits for it and returns the result.

    Its steps run on :meth:`wait`'s thread, once; an error is raised there, and again by every
    later ``wait``. ``later``: the wait may come after other calls (``async_op=True``), so an
    error of the wait names the call running when the exchange started, not when it waits.
    """

    __slots__ = ("_error", "_steps", "_value", "_waiting")

    def __init__(self, steps: Steps[_T], later: bool = True) -> None:
        self._steps = steps
        self._error: BaseException | None = None
        self._waiting: _Waitable | None = None
        try:
            self._waiting = next(steps)
            if later:
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


class Done(Generic[_T]):
    """An exchange whose result is here already: a traced one, whose wait is a node of the
    graph (the compiler moves it); :meth:`wait` returns the result."""

    __slots__ = ("_value",)

    def __init__(self, value: _T) -> None:
        self._value = value

    def wait(self) -> _T:
        return self._value


def drive(steps: Steps[_T]) -> _T:
    """Run ``steps`` through at once: each exchange waited for as soon as it is started (the
    blocking call; ``Exchange.__call__`` has this loop inline, its hot path)."""
    try:
        waiting = next(steps)
        while True:
            waiting.wait()
            waiting = steps.send(None)
    except StopIteration as finished:
        value: _T = finished.value
        return value
