"""How a rank waits for an exchange: a dead peer is an error within tens of milliseconds, and a
peer that never comes is a timeout that says which op, which pass, and what the peers were doing.

Why this is needed (gloo in torch 2.13, measured on loopback): when a peer's connection closes,
gloo fails every send and receive still *pending* on that pair, but not one already moving bytes
(a send half written, a receive half read): ``Pair::signalException`` walks the pair's pending
lists, not the unbound buffer of the operation in flight. A wait on that operation lasts the
process group's whole timeout, and a timed wait on a point-to-point operation that expires closes
every connection of the group. A peer SIGKILLed during 32 MB point-to-point exchanges left the
survivor waiting the full timeout in 6 of 14 trials (4 MB: 4 of 20, all of them sends; 1 MB: 0 of
20); during torch's own all_gather collective, in 1 of 14.

So distgrad never blocks on such an operation without a way out:

* **Collectives** (all_reduce, broadcast, gather, ... on gloo) run asynchronously and are waited
  for in ticks of :data:`TICK_S`; a wait that expires only returns (gloo's worker thread keeps
  going), so the group is not harmed.
* **Point-to-point exchanges** whose largest message exceeds :data:`INLINE_BYTES`, and every
  point-to-point exchange on a group of more than 2 ranks, are waited for by a helper thread
  while this thread waits, in ticks, for the helper. Smaller messages fit the socket buffers
  whole (gloo sizes them to the message) and were never seen in flight; on 2 ranks they are
  waited for inline, which keeps small exchanges at their old cost (a helper thread costs about
  0.1 ms, 20% of a 128 KB exchange on 2 busy cores). On more ranks a peer can be alive and
  never come (it stopped at its own error when a third rank died), which only a watched wait
  sees: its ticks name the dead rank.
* At each tick, the waiting thread polls distgrad's liveness connections to the group's
  other ranks (``distgrad._exchange.alive``): sockets the kernel resets when a peer's process
  dies, however it dies. So a dead peer is named within a tick or two even when the operation
  in flight would wait forever. No thread watches, and nothing pending is tied to a group: a
  destroyed group and an exiting interpreter leave no distgrad thread blocked in native code.
  (The helper thread of a large exchange whose peer died is the one exception: gloo offers no
  way to release it; it returns at the group's timeout.)

When an exchange fails, the error keeps gloo's own type and text and starts with distgrad's
account: which rank, which op, which pass, which peer. On a timeout, every rank that times out
inside distgrad writes what it was waiting in to the default store, and reads what its peers
wrote there, so the message can say, as far as the store can tell, whether a peer was waiting in
another call (a skipped call, another group) or in none at all.
A wait that lasts :data:`_NOTE_AFTER_S` also writes what it waits in (and clears it when it
ends), so a peer whose own timeout is longer is named as waiting too.
"""

from __future__ import annotations

import contextlib
import json
import queue
import re
import threading
import time
from collections.abc import Sequence
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from distgrad._exchange import alive as _alive
from distgrad._exchange.group import Group, on_forget
from distgrad.errors import PeerGoneError

__all__ = [
    "INLINE_BYTES",
    "TICK_S",
    "activity",
    "annotate",
    "busy_helpers",
    "note_call",
    "others",
    "wait_collective",
    "wait_pairs",
]

TICK_S = 0.02
"""How often a waiting rank looks at its peers' connections (seconds)."""

INLINE_BYTES = 256 * 1024
"""Point-to-point messages up to this size are waited for inline (see the module docstring)."""

_TICK = timedelta(seconds=TICK_S)
_REPORT_WAIT_S = 1.0  # after a timeout, how long to wait for the peers' own reports
_RECENT_S = 5.0  # a peer's report counts if written this recently, or since this wait began
_CLOCK_SLACK_S = 0.5  # ranks' clocks (one machine, or NTP across machines) may differ this much
_NOTE_AFTER_S = 1.0  # a wait this long says in the store what it waits in, until it ends


# ---------------------------------------------------------------------------------------------
# What this rank is doing, for messages. Recording costs one assignment per call.

_last_forward: tuple[str, int, tuple[int, str]] = ("a distgrad collective", -1, (0, ""))


def note_call(desc: str, call: int, group: Group) -> None:
    """Record the forward call this rank is making (``call``: its number on ``group``)."""
    global _last_forward
    _last_forward = (desc, call, group.key)


def _forget_last_call(groups: list[Group], world_gone: bool) -> None:
    global _last_forward
    if any(g.key == _last_forward[2] for g in groups) or world_gone:
        _last_forward = ("a distgrad collective", -1, (0, ""))


on_forget(_forget_last_call)


def activity(group: Group) -> str:
    """What this rank is doing: 'the forward of all_gather(dim=0) (its distgrad call 3 on the
    group)', or 'the backward of all_gather' while an autograd backward runs."""
    return _activity(group, torch._C._current_autograd_node(), _last_forward)


class StartedEarlier:
    """:func:`activity` as it was when an exchange started that is waited for later
    (``async_op=True``); worded only if an error needs it (the wording costs 10-40 us)."""

    __slots__ = ("_group", "_last", "_node")

    def __init__(self, group: Group) -> None:
        self._group = group
        self._node = torch._C._current_autograd_node()
        self._last = _last_forward

    def __str__(self) -> str:
        return f"{_activity(self._group, self._node, self._last)}, started with async_op=True"


What = str | StartedEarlier | object | None
"""How a wait's caller names what it waits for in errors (None: :func:`activity`, now): a
string, or any object whose ``str()`` words it when an error needs it (as
:class:`StartedEarlier`, and distgrad.pipeline's transfers, which are named per call)."""


def _activity(group: Group, node: Any, last: tuple[str, int, tuple[int, str]]) -> str:
    if node is None:
        desc, call, key = last
        text = f"the forward of {desc}"
        if call >= 0 and key == group.key:
            text += f" (its distgrad call {call + 1} on the group)"
        return text
    text = f"the backward of {_op_of(node)}"
    plan = getattr(node, "plan", None)
    call = getattr(getattr(plan, "group", None), "call", -1)
    if isinstance(call, int) and call >= 0:  # debug mode numbers the forward calls
        text += f" (of its distgrad call {call + 1} on the group)"
    return text


def _op_of(node: Any) -> str:
    """'_AllGatherBackward' -> 'all_gather'; '_ReduceScatterSumBackward' -> 'reduce_scatter'."""
    name = type(node).__name__.removesuffix("Backward").lstrip("_")
    snake = re.sub(r"(?<!^)(?=[A-Z])", "_", name).lower()
    return snake.removesuffix("_sum") or "a distgrad collective"


# ---------------------------------------------------------------------------------------------
# Dead peers, seen through distgrad's own liveness sockets (distgrad._exchange.alive).


def _dead_peer(
    group: Group, peers: Sequence[int], settle_s: float = 0.0
) -> tuple[int, BaseException] | None:
    """The first of ``peers`` (group ranks) whose process is gone, with an error saying how
    that was seen."""
    if group.pg is None or group.is_nccl or not peers:
        return None
    _alive.publish()  # cheap when done; a no-op without a default store
    found = _alive.dead([group.global_rank(p) for p in peers], settle_s)
    if found is None:
        return None
    global_rank, why = found
    peer = group.members.index(global_rank)
    return peer, PeerGoneError(f"rank {peer} (global rank {global_rank}): {why}")


def is_timeout(error: BaseException) -> bool:
    """Whether a backend error is a timeout (as opposed to a connection that closed)."""
    text = str(error).lower()
    return "timed out" in text or "timeout" in text


# ---------------------------------------------------------------------------------------------
# Waiting.


def others(group: Group) -> list[int]:
    """Every group rank but this one."""
    return [r for r in range(group.size) if r != group.rank]


def wait_collective(work: Any, group: Group, what: What = None, doing: str | None = None) -> None:
    """Wait for a collective started with ``async_op=True`` on a gloo group, in ticks;
    ``what`` and ``doing`` describe the call in errors (:func:`annotate`)."""
    start = time.monotonic()
    # The first tick alone, with nothing made for a long wait: most exchanges end within it.
    # The expired tick's exception is not kept: its traceback would hold this frame, and with
    # it ``work`` and the output tensor it references, until the garbage collector runs;
    # AccumulateGrad then copies a gradient whose memory something else holds (measured: a
    # 64 MB all_reduce backward 205-220 ms against 138 ms).
    try:
        work.wait(_TICK)
        return
    except RuntimeError:
        pass
    note = _LongWait(group, what, start)
    try:
        while True:
            if work.is_completed():  # its own error, or it finished as the tick expired
                try:
                    work.wait()
                    return
                except RuntimeError as real:
                    raise annotate(real, group, others(group), start, what, doing) from None
            dead = _dead_peer(group, others(group))
            if dead is not None:
                raise annotate(dead[1], group, [dead[0]], start, what, doing) from None
            note.tick()
            try:
                work.wait(_TICK)
                return
            except RuntimeError:
                pass
    finally:
        note.end()


def wait_pairs(
    works: Sequence[Any], peers: Sequence[int], group: Group, largest: int, what: What = None
) -> None:
    """Wait for point-to-point works; ``peers[i]`` is the group rank ``works[i]`` talks to and
    ``largest`` the largest message in bytes; ``what`` names the call in errors (default
    :func:`activity`)."""
    start = time.monotonic()
    # Inline only where no live peer can leave this rank blocked: on 2 ranks the one peer is the
    # one waited on, and its death fails the pending small messages at once. On more ranks a
    # peer that is alive but stopped at its own error (another rank died) never comes, and an
    # inline wait would last until that peer's process exits (measured: 3.1 s under
    # run_on_ranks, which lets a finished rank linger; forever where the error is caught).
    if group.is_nccl or (largest <= INLINE_BYTES and group.size == 2):
        for work, peer in zip(works, peers, strict=True):
            try:
                work.wait()
            except RuntimeError as exc:
                raise annotate(exc, group, [peer], start, what) from None
        return
    job = _Job(works)
    _submit(job)
    note = _LongWait(group, what, start)
    try:
        while not job.done.wait(TICK_S):
            # Every other rank, not only this exchange's peers: a dead rank elsewhere in the
            # group is why a live peer stopped coming, and the one to name.
            dead = _dead_peer(group, others(group))
            if dead is not None:
                raise annotate(dead[1], group, [dead[0]], start, what) from None
            note.tick()
    finally:
        note.end()
    if job.error is not None:
        raise annotate(job.error, group, [peers[job.failed]], start, what) from None


class _Job:
    def __init__(self, works: Sequence[Any]) -> None:
        self.works = works
        self.done = threading.Event()
        self.error: BaseException | None = None
        self.failed = 0


# Idle helper threads. A helper stuck on a dead peer's operation stays busy until gloo's timeout
# releases it, so a new exchange takes another helper rather than queueing behind it.
_idle: list[_Helper] = []
_idle_lock = threading.Lock()


class _Helper(threading.Thread):
    def __init__(self) -> None:
        super().__init__(name="distgrad-wait", daemon=True)
        self.jobs: queue.SimpleQueue[_Job] = queue.SimpleQueue()

    def run(self) -> None:
        while True:
            job: _Job | None = self.jobs.get()
            assert job is not None
            for i, work in enumerate(job.works):
                try:
                    work.wait()
                except BaseException as exc:
                    job.error, job.failed = exc, i
                    break
            job.done.set()
            # Drop the works (and the tensors they hold) now, not when the next job comes.
            job = work = None
            with _idle_lock:
                _idle.append(self)


def busy_helpers() -> list[threading.Thread]:
    """The helper threads still waiting on an exchange: not back among the idle ones (a ^C in
    :func:`wait_pairs` leaves its helper waiting, nobody reading its result)."""
    with _idle_lock:
        idle = list(_idle)
    return [
        t
        for t in threading.enumerate()
        if isinstance(t, _Helper) and t.is_alive() and not any(t is i for i in idle)
    ]


def _submit(job: _Job) -> None:
    with _idle_lock:
        helper = _idle.pop() if _idle else None
    if helper is None:
        helper = _Helper()
        helper.start()
    helper.jobs.put(job)


class _LongWait:
    """Says in the default store what this rank waits in once a wait has lasted
    :data:`_NOTE_AFTER_S`, and that it stopped when it ends: a peer that times out meanwhile
    (its own timeout may be shorter) can then say where this rank is. One store write at the
    start of a long wait and one at its end; nothing for a short one."""

    __slots__ = ("_group", "_noted", "_start", "_what")

    def __init__(self, group: Group, what: What, start: float) -> None:
        self._group, self._what, self._start, self._noted = group, what, start, False

    def tick(self) -> None:
        if not self._noted and time.monotonic() - self._start > _NOTE_AFTER_S:
            self._noted = True
            what = self._what or activity(self._group)
            _write_report(self._group, "waiting", f"waiting in {what}")

    def end(self) -> None:
        if self._noted:
            _write_report(self._group, "waiting", "")


# ---------------------------------------------------------------------------------------------
# Errors.


def annotate(
    error: BaseException,
    group: Group,
    peers: Sequence[int],
    start: float,
    what: What = None,
    doing: str | None = None,
) -> BaseException:
    """``error`` (the backend's), with distgrad's account of it first: this rank, what it was
    doing, and which peer closed its connection or, on a timeout, what the store knows of the
    peers. ``what`` names the activity (default :func:`activity`); ``doing`` says it after
    'rank r' (default 'was in <what>'). Returns ``error`` itself, to be raised."""
    what = str(what or activity(group))
    doing = doing or f"was in {what}"
    waited = time.monotonic() - start
    source = _backend(group)
    if is_timeout(error):
        account = _timeout_account(group, peers, doing, what, waited)
    else:
        if isinstance(error, PeerGoneError):
            source = "distgrad's liveness check"
        states = _peer_states(group, peers)
        gone = [p for p in peers if states[p].state == "gone"]
        if gone:
            who = f"rank {gone[0]}"
            story = _peer_timed_out(group, [gone[0]], 0.0, time.time() - waited)
            why = (
                f"{who} {story[1]}, then exited"
                if story
                else f"{who} exited or crashed: {states[gone[0]].why} (its own log says why)"
            )
            account = (
                f"distgrad: rank {group.rank} {doing} when its connection to {who} closed, "
                f"{waited:.2f} s into the wait: {why}; this group cannot be used any more"
            )
        elif _lost_connection(error):
            # Say what this rank waited in, for a peer whose timeout closed the connection.
            _write_report(group, "closed", f"was waiting in {what} until its connection closed")
            account = _closed_by_a_live_peer(group, peers, states, doing, waited)
        else:
            account = (
                f"distgrad: rank {group.rank} {doing} when its {source} backend refused the "
                "operation on this rank: a local error (no peer's process is gone and no "
                "connection closed; the backend's text follows). If every rank made the same "
                "call, every rank got this error and the group stays usable"
            )
    original = str(error.args[0]) if error.args else str(error)
    error.args = (f"{account}\n[from {source}] {original}", *error.args[1:])
    return error


def _peer_states(group: Group, peers: Sequence[int]) -> dict[int, _alive.Verdict]:
    """What is known of each of ``peers``' processes (group ranks), asked as an exchange with
    them failed: resets on their way get 50 ms to arrive (all peers at once), then /proc and
    the liveness connections answer with no further wait."""
    if group.pg is None or group.is_nccl or not peers:
        return {p: _alive.Verdict("unknown", "") for p in peers}
    _alive.publish()
    _alive.dead([group.global_rank(p) for p in peers], settle_s=0.05)
    return {p: _alive.verdict(group.global_rank(p)) for p in peers}


def _closed_by_a_live_peer(
    group: Group, peers: Sequence[int], states: dict[int, _alive.Verdict], doing: str, waited: float
) -> str:
    """The account of a connection closed by a peer whose process is not known to be gone.

    A peer whose own wait timed out closes every connection of the group and writes where it
    waited just after: that report is waited for (up to 1 s) only from peers whose process is
    known to be running. A peer whose state distgrad cannot know is never said to be running."""
    running = [p for p in peers if states[p].state == "running"]
    unknown = [p for p in peers if states[p].state == "unknown"]
    since = time.time() - waited
    story = _peer_timed_out(group, running, _REPORT_WAIT_S, since) if running else None
    if story is None and unknown:
        story = _peer_timed_out(group, unknown, 0.0, since)
    if story is not None:
        why = f"rank {story[0]} {story[1]} and closed its connections"
        who = f"rank {story[0]}"
    elif running:
        who = f"rank {running[0]}" if len(peers) == 1 else "a peer"
        why = (
            f"{who}'s process is still running, so it closed the connection itself "
            "(its own timeout expired, it destroyed the group, or it failed: its own log "
            "says why)"
        )
    else:
        who = f"rank {peers[0]}" if len(peers) == 1 else "a peer"
        why = (
            f"distgrad cannot tell whether {who}'s process is still running (it published "
            "no liveness address it could reach): it exited or crashed, or it closed the "
            "connection itself (its own timeout expired, it destroyed the group, or it "
            "failed); its own log says why"
        )
    return (
        f"distgrad: rank {group.rank} {doing} when its connection to {who} closed, "
        f"{waited:.2f} s into the wait: {why}; this group cannot be used any more"
    )


_CONNECTION_LOST = (
    "connection closed",
    "closed by peer",
    "connection reset",
    "broken pipe",
    "socket closed",
    "pair closure",
    "read error",
    "write error",
    "connection refused",
)


def _lost_connection(error: BaseException) -> bool:
    """Whether a backend error says a connection to a peer went away."""
    text = str(error).lower()
    return any(sign in text for sign in _CONNECTION_LOST)


def _backend(group: Group) -> str:
    return "nccl" if group.is_nccl else "gloo"


def _timeout_account(
    group: Group, peers: Sequence[int], doing: str, what: str, waited: float
) -> str:
    wanted = ", ".join(f"rank {p}" for p in peers) or "its peers"
    head = (
        f"distgrad: rank {group.rank} {doing} and timed out after {waited:.1f} s waiting for "
        f"{wanted}"
    )
    reports = _exchange_reports(group, peers, f"timed out in {what}", time.time() - waited)
    if reports is None:
        return head + " (the store could not be read to say what the peers were doing)"
    lines = []
    for peer in peers:
        report = reports.get(peer)
        if report is None:
            lines.append(
                f"rank {peer} reported no timeout of its own: it is not waiting inside "
                "distgrad (it skipped this call, for example its backward, or it is busy or "
                "stuck outside distgrad)"
            )
        else:
            lines.append(f"rank {peer} {report}")
    return (
        f"{head}. As far as the store can tell: " + "; ".join(lines) + ". Every rank must make "
        "the same distgrad calls in the same order on the same group (DISTGRAD_DEBUG=1 checks "
        "every call)"
    )


def _store() -> Any:
    try:
        return dist.distributed_c10d._get_default_store()
    except Exception:  # no default group, or torch moved its private helper
        return None


def _write_report(group: Group, kind: str, what: str) -> None:
    """Store ``what`` this rank is doing under ``distgrad/<kind>/<global rank>`` ("" clears)."""
    store = _store()
    if store is None or group.pg is None:
        return
    where = f"{what}, on the group of global ranks {_global_ranks(group)}" if what else ""
    with contextlib.suppress(Exception):  # the store is gone too: the message says less
        store.set(
            f"distgrad/{kind}/{dist.get_rank()}", json.dumps({"time": time.time(), "what": where})
        )


def _read_report(store: Any, kind: str, global_rank: int) -> tuple[float, str] | None:
    name = f"distgrad/{kind}/{global_rank}"
    if not store.check([name]):
        return None
    report = json.loads(store.get(name))
    return float(report["time"]), str(report["what"])


def _peer_timed_out(
    group: Group, peers: Sequence[int], wait_s: float, since: float
) -> tuple[int, str] | None:
    """The first of ``peers`` (group ranks) that reported a recent timeout in the default
    store, with 'timed out in <what>, on the group of ...', waiting up to ``wait_s`` for the
    reports (all peers at once)."""
    store = _store()
    if store is None or group.pg is None or not peers:
        return None
    deadline = time.monotonic() + wait_s
    try:
        while True:
            for peer in peers:
                report = _read_report(store, "timeout", group.global_rank(peer))
                if _relevant(report, since):
                    assert report is not None
                    return peer, report[1]
            if time.monotonic() >= deadline:
                return None
            time.sleep(0.05)
    except Exception:  # the store is gone too
        return None


def _relevant(report: tuple[float, str] | None, since: float) -> bool:
    """Whether a peer's report speaks of this wait: written since it began (``since``, wall
    clock), or recently. A peer that timed out in call 21 and now waits in call 22 is
    described at call 21, however long ago this wait began."""
    if report is None or not report[1]:
        return False
    return report[0] >= since - _CLOCK_SLACK_S or abs(time.time() - report[0]) < _RECENT_S


def _exchange_reports(
    group: Group, peers: Sequence[int], mine: str, since: float
) -> dict[int, str] | None:
    """Write this rank's report to the default store; read its peers' (by group rank): a
    timeout of theirs during this wait (which began at ``since``), a wait of theirs that ended
    when its connection closed, or a long wait they are still in."""
    store = _store()
    if store is None or group.pg is None:
        return None
    _write_report(group, "timeout", mine)
    try:
        found: dict[int, str] = {}
        deadline = time.monotonic() + _REPORT_WAIT_S
        while True:
            for peer in peers:
                if peer in found:
                    continue
                report = _read_report(store, "timeout", group.global_rank(peer))
                closed = _read_report(store, "closed", group.global_rank(peer))
                if _relevant(report, since):
                    assert report is not None
                    found[peer] = report[1]
                elif _relevant(closed, since):
                    assert closed is not None
                    found[peer] = closed[1]
            if len(found) == len(peers) or time.monotonic() > deadline:
                break
            time.sleep(0.05)
        for peer in peers:
            waiting = _read_report(store, "waiting", group.global_rank(peer))
            if waiting is None or not waiting[1]:
                continue
            if peer not in found:
                found[peer] = f"is {waiting[1]} (for {time.time() - waiting[0]:.1f} s)"
            elif waiting[1].removeprefix("waiting in ") not in found[peer]:
                found[peer] += f"; it is now {waiting[1]}"  # it went on to another call
        return found
    except Exception:  # the store is gone too
        return None


def _global_ranks(group: Group) -> str:
    return ", ".join(str(group.global_rank(r)) for r in range(group.size))
