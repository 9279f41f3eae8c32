"""``run_on_ranks``: run a function on N local processes joined in a process group.

Why it is built this way (measured on a 2-core machine):

* Ranks start from a *preloaded forkserver*: torch is imported once in the server and each rank
  is a fork of it, so a 2-rank gloo group costs about 0.1 s instead of 2-4 s with plain spawn.
  Every call still gets fresh processes, so one failure cannot poison the next call.
* Rendezvous goes through a ``FileStore`` in a fresh temporary folder: no port to pick, so no
  race between finding a free port and binding it.
* A timeout ladder, innermost first: the process group's own timeout turns a missing peer into
  an error; ``faulthandler`` makes a hung rank print its stack and exit; the parent waits with a
  deadline and never blocks without one; the processes are always reaped in ``finally``.
* Fail fast: each rank stamps its error with the time it happened; after the first failure the
  others get a short grace period (to report their own view) and are then killed, and one error
  lists every rank's traceback, earliest first, so the root cause is on top.
* Every exit is checked: a rank that reported its value and then dies (a signal, a crash in
  teardown), exits non-zero or does not exit within a few seconds fails the run, as a
  launcher such as torchrun would fail the job; ``faulthandler`` is on in every rank, so a
  crash prints its Python stack. (Ranks end with ``os._exit`` after their ``atexit``
  handlers, as multiprocessing ends them: interpreter finalisation itself is exercised by the
  torchrun tests, tests/lifecycle.)
* Leave together, briefly: a rank whose function returned waits (through the store, at most two
  seconds) for its peers' functions to return before it tears its connections down, so that
  it cannot break a connection a peer is still making, yet a peer stuck in a collective the
  rank skipped still fails within seconds.
"""

from __future__ import annotations

import atexit
import contextlib
import faulthandler
import multiprocessing as mp
import multiprocessing.connection
import multiprocessing.forkserver
import os
import pickle
import shutil
import signal
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Literal

from distgrad.errors import RankFailedError
from distgrad.testing import _simulate

__all__ = ["run_on_ranks"]

Init = Literal["process_group", "rpc", "none"]

_GRACE_S = 2.0  # default: after the first failure, how long peers may report before being killed
_LEAVE_GRACE_S = 2.0  # how long a finished rank waits for its peers to finish before leaving
_EXIT_WITHIN_S = _LEAVE_GRACE_S + 3.0  # how long a rank that reported may take to exit
# torch.autograd imports symbolic_shapes lazily the first time a backward is given explicit
# gradients (about 1.3 s); every distributed backward over RPC does that on each worker.
_PRELOAD = ["torch", "torch.distributed", "torch.fx.experimental.symbolic_shapes", "distgrad"]
_context: Any = None


# Imported in the server too when the caller already has them: a test module unpickled in a
# new rank would otherwise import them again, 0.3 s per rank for pytest and hypothesis.
_PRELOAD_IF_LOADED = ["numpy", "pytest", "hypothesis"]


def _forkserver_context() -> Any:
    """The forkserver context, created once per process with torch preloaded.

    ``__main__`` is preloaded as well, so ranks do not each re-run the caller's main module
    (under pytest that is pytest's own entry point, about a second per rank).
    """
    global _context
    if _context is None:
        ctx = mp.get_context("forkserver")
        extra = [name for name in _PRELOAD_IF_LOADED if name in sys.modules]
        ctx.set_forkserver_preload([*_PRELOAD, *extra, "__main__"])
        _start_server_with_one_thread()
        _context = ctx
    return _context


def _start_server_with_one_thread() -> None:
    """Start the forkserver with ``OMP_NUM_THREADS=1`` in its environment, so that every
    thread of every rank has one intra-op thread from its start.

    ``torch.set_num_threads(1)`` in a rank sets the count of the threads that ask for it; a
    thread that has not asked yet (an RPC agent thread that only ran matrix products) used the
    OpenMP default, 2 on 2 cores, and computed other last bits: a torch RPC program's results
    then depended on which agent thread served which call. The caller's own environment is
    left as it was. A forkserver already running (started by someone else) is used as it is.
    """
    previous = os.environ.get("OMP_NUM_THREADS")
    os.environ["OMP_NUM_THREADS"] = "1"
    try:
        multiprocessing.forkserver.ensure_running()
    finally:
        if previous is None:
            del os.environ["OMP_NUM_THREADS"]
        else:
            os.environ["OMP_NUM_THREADS"] = previous


@dataclass(frozen=True)
class _RankSpec:
    rank: int
    world_size: int
    rendezvous_dir: str
    init: Init
    backend: str
    collective_timeout: float
    hang_timeout: float


@dataclass(frozen=True)
class _Outcome:
    rank: int
    ok: bool
    value: Any = None
    when: float = 0.0
    summary: str = ""
    traceback: str = ""


def run_on_ranks(
    fn: Callable[..., Any],
    world_size: int = 2,
    *,
    args: Sequence[Any] = (),
    timeout: float = 60.0,
    collective_timeout: float | None = None,
    grace: float = _GRACE_S,
    backend: str = "gloo",
    init: Init = "process_group",
    simulate: bool = False,
) -> list[Any]:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` new local processes.

    Before ``fn`` runs, each process has joined a process group (``init="process_group"``,
    the default), an RPC group (TensorPipe) with workers named ``worker0``, ``worker1``, ...
    (``init="rpc"``)
    or nothing (``init="none"``). ``fn`` and ``args`` must pickle, so ``fn`` lives at module
    level; scripts that call this need an ``if __name__ == "__main__":`` guard.

    Returns each rank's return value, indexed by rank (they travel back pickled). A rank whose
    ``fn`` returned keeps its process group up until every rank's ``fn`` has returned, or two
    seconds at most.

    Raises :class:`~distgrad.errors.RankFailedError` if any rank raises, dies or runs past
    ``timeout`` seconds, or if, every rank having returned, one then dies, exits non-zero or
    does not exit within 5 seconds. Its message lists every failing rank's traceback, earliest
    first, and its ``results`` holds the values of the ranks that returned (a rank reports its
    value as soon as its ``fn`` returns); the other ranks are killed ``grace`` seconds (default
    2) after the first failure: a test of what survivors see when a peer dies or never comes
    gives them ``collective_timeout`` plus a margin. A rank blocked in a collective whose peer
    is gone fails after ``collective_timeout`` seconds (default: a third of ``timeout``); a rank
    hung anywhere else prints its stack and exits shortly before ``timeout``.
    Processes are always reaped and the rendezvous folder removed.

    ``simulate=True`` starts no process: every rank runs in this one (torch's
    ``LocalTensorMode`` over a ``fake`` process group, docs/checker.md "Simulated ranks").
    ``rank`` is then one per-rank int and ``fn`` runs once for all ranks where it uses the
    rank as data; each returned tensor is split into each rank's value. Code that cannot be
    simulated truthfully raises :class:`~distgrad.errors.CheckArgumentError` (an error of
    ``fn`` itself propagates as it is); ``timeout``, ``collective_timeout``, ``grace`` and
    ``backend`` do not apply, and ``init`` must be ``"process_group"``.

    Args:
        fn: ``fn(rank, world_size, *args)``, defined at module level (it travels pickled).
        world_size: the ranks.
        args: more arguments for ``fn``; they must pickle.
        timeout: seconds every rank may take.
        collective_timeout: seconds a collective may wait for a missing peer (default: a third of
            ``timeout``).
        grace: seconds the other ranks get after the first failure before they are killed.
        backend: the process group's backend.
        init: ``"process_group"``, ``"rpc"`` or ``"none"``: what each process joins first.
        simulate: run every rank in this process (``LocalTensorMode``) instead of processes.

    Returns:
        Every rank's return value, indexed by rank.

    Raises:
        RankFailedError: a rank raised, died, timed out, or failed on its way out.
        CheckArgumentError: with ``simulate=True``, code that cannot be simulated truthfully.

    Example:
        >>> import operator
        >>> dg.testing.run_on_ranks(operator.add, 2)  # rank + world_size, on 2 processes
        [2, 3]
        >>> def doubled(rank, world_size):  # simulated, a function defined anywhere will do
        ...     return dg.all_reduce(torch.ones(1) * rank) * 2
        >>> dg.testing.run_on_ranks(doubled, 3, simulate=True)  # 2 (0 + 1 + 2) on every rank
        [tensor([6.]), tensor([6.]), tensor([6.])]
    """
    if simulate:
        if init != "process_group":
            raise ValueError(
                f"run_on_ranks: simulate=True needs init='process_group', got {init!r}"
            )
        if world_size < 1:
            raise ValueError(f"run_on_ranks: world_size must be at least 1, got {world_size}")
        return _simulate.run_spmd(fn, world_size, args, "run_on_ranks")
    if world_size < 1:
        raise ValueError(f"run_on_ranks: world_size must be at least 1, got {world_size}")
    if timeout <= 0:
        raise ValueError(f"run_on_ranks: timeout must be positive, got {timeout}")
    if grace < 0:
        raise ValueError(f"run_on_ranks: grace must not be negative, got {grace}")
    if init not in ("process_group", "rpc", "none"):
        raise ValueError(
            f"run_on_ranks: init must be 'process_group', 'rpc' or 'none', got {init!r}"
        )
    collective_timeout = timeout / 3 if collective_timeout is None else collective_timeout
    ctx = _forkserver_context()
    rendezvous_dir = tempfile.mkdtemp(prefix="distgrad-rdzv-")
    processes: list[Any] = []
    receivers: list[multiprocessing.connection.Connection] = []
    outcomes: dict[int, _Outcome] = {}
    try:
        for rank in range(world_size):
            spec = _RankSpec(
                rank=rank,
                world_size=world_size,
                rendezvous_dir=rendezvous_dir,
                init=init,
                backend=backend,
                collective_timeout=collective_timeout,
                hang_timeout=max(timeout - 3.0, timeout * 0.8),  # see hang_after below
            )
            receiver, sender = ctx.Pipe(duplex=False)
            proc = ctx.Process(
                target=_rank_main, args=(spec, fn, tuple(args), sender), name=f"distgrad-rank{rank}"
            )
            proc.start()
            sender.close()
            processes.append(proc)
            receivers.append(receiver)
        hang_after = time.monotonic() + max(timeout - 3.0, timeout * 0.8)
        outcomes = _collect(processes, receivers, time.monotonic() + timeout, hang_after, grace)
    finally:
        # Ranks that all reported are leaving together (at most _LEAVE_GRACE_S): let them.
        clean = len(outcomes) == world_size and all(o.ok for o in outcomes.values())
        killed = _reap(processes, _EXIT_WITHIN_S if clean else 0.0)
        for receiver in receivers:
            receiver.close()
        shutil.rmtree(rendezvous_dir, ignore_errors=True)
    if clean:
        # A rank that reported its value must then leave cleanly: a crash or a hang in
        # teardown is a failure of the job, as a launcher such as torchrun would see it.
        for rank, proc in enumerate(processes):
            why = _bad_exit(proc.exitcode, rank in killed)
            if why is not None:
                outcomes[rank] = _Outcome(rank=rank, ok=False, when=time.time(), summary=why)
    failures = [o for o in outcomes.values() if not o.ok]
    if failures:
        results = {o.rank: o.value for o in outcomes.values() if o.ok}
        raise RankFailedError(_failure_message(fn, world_size, failures), results)
    return [outcomes[rank].value for rank in range(world_size)]


def _collect(
    processes: list[Any],
    receivers: list[multiprocessing.connection.Connection],
    deadline: float,
    hang_after: float,
    grace: float,
) -> dict[int, _Outcome]:
    """Wait for every rank's outcome, never past ``deadline`` nor long past the first failure."""
    outcomes: dict[int, _Outcome] = {}
    pending = dict(enumerate(receivers))
    failed_at: float | None = None
    while pending:
        now = time.monotonic()
        stop = deadline if failed_at is None else min(deadline, failed_at + grace)
        if now >= stop:
            break
        ready = multiprocessing.connection.wait(list(pending.values()), timeout=stop - now)
        for conn in ready:
            rank = next(r for r, c in pending.items() if c is conn)
            del pending[rank]
            outcome = _receive(conn, rank, processes[rank], hang_after)
            outcomes[rank] = outcome
            if not outcome.ok and failed_at is None:
                failed_at = time.monotonic()
    for rank in pending:
        why = (
            "killed: it was still running after another rank had failed"
            if failed_at is not None
            else "timed out: still running at the deadline"
        )
        outcomes[rank] = _Outcome(rank=rank, ok=False, when=float("inf"), summary=why)
    return outcomes


def _receive(conn: Any, rank: int, proc: Any, hang_after: float) -> _Outcome:
    try:
        outcome: _Outcome = pickle.loads(conn.recv_bytes())
        return outcome
    except (EOFError, OSError):
        proc.join(timeout=1.0)
        code = proc.exitcode
        if time.monotonic() >= hang_after - 0.5:
            # faulthandler's rung: the rank was still running at its hang timeout.
            summary = (
                "timed out: no result before its hang timeout, so it dumped its stack to "
                f"stderr and exited (exit code {code})"
            )
        else:
            summary = f"died without reporting (exit code {code})"
        return _Outcome(rank=rank, ok=False, when=time.time(), summary=summary)


def _reap(processes: list[Any], leave_s: float) -> set[int]:
    """Give the processes ``leave_s`` seconds to exit, then kill what is left and reap all;
    returns the indices of those killed."""
    deadline = time.monotonic() + leave_s
    killed = set()
    for index, proc in enumerate(processes):
        proc.join(timeout=max(0.0, deadline - time.monotonic()))
        if proc.is_alive():
            proc.kill()
            killed.add(index)
    for proc in processes:
        proc.join(timeout=5.0)
    return killed


def _bad_exit(code: int | None, killed: bool) -> str | None:
    """What was wrong with how a rank that reported its value then exited, if anything."""
    if killed:
        return (
            f"returned its value but did not exit within {_EXIT_WITHIN_S:.0f} s "
            "(stuck in teardown), so it was killed"
        )
    if code == 0:
        return None
    if code is not None and code < 0:
        try:
            name = signal.Signals(-code).name
        except ValueError:
            name = f"signal {-code}"
        return (
            f"returned its value but then died of {name} while leaving (exit code {code}); "
            "its stderr above has faulthandler's stack"
        )
    return f"returned its value but then exited with code {code}"


def _failure_message(fn: Callable[..., Any], world_size: int, failures: list[_Outcome]) -> str:
    name = getattr(fn, "__qualname__", repr(fn))
    failures = sorted(failures, key=lambda o: (o.when, o.rank))
    lines = [f"{name} failed on {len(failures)} of {world_size} ranks (earliest first):"]
    for outcome in failures:
        lines.append(f"--- rank {outcome.rank}: {outcome.summary}")
        if outcome.traceback:
            lines.append(outcome.traceback.rstrip())
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------------
# Inside a rank


def _rank_main(
    spec: _RankSpec,
    fn: Callable[..., Any],
    args: tuple[Any, ...],
    sender: multiprocessing.connection.Connection,
) -> None:
    # A crash (SIGSEGV, SIGABRT, ...) prints every thread's Python stack to stderr.
    faulthandler.enable(all_threads=True)
    faulthandler.dump_traceback_later(spec.hang_timeout, exit=True)
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    import torch

    # Two ranks on two cores leave no room for intra-op threads.
    torch.set_num_threads(1)
    try:
        store = _join(spec)
        value = fn(spec.rank, spec.world_size, *args)
        outcome = _Outcome(rank=spec.rank, ok=True, value=value)
        try:
            payload = pickle.dumps(outcome)
        except Exception as exc:  # the function returned something that does not pickle
            raise TypeError(
                f"the value returned on rank {spec.rank} does not pickle: {exc}"
            ) from exc
        # Report before leaving: leaving waits for peers, and a peer that died (a fault
        # injected on purpose) would make the parent kill this rank before its report.
        sender.send_bytes(payload)
        _leave(spec, store)
        # What an interpreter does as it exits, short of finalising (multiprocessing ends
        # the process with os._exit): the handlers distgrad and torch registered run here.
        atexit._run_exitfuncs()
    except BaseException as exc:
        when = time.time()
        summary = f"{type(exc).__name__}: {exc}".splitlines()[0][:300]
        outcome = _Outcome(
            rank=spec.rank, ok=False, when=when, summary=summary, traceback=traceback.format_exc()
        )
        payload = pickle.dumps(outcome)
        # Report first, then leave without tearing down the group: a teardown could block on
        # peers that are themselves stuck.
        with contextlib.suppress(OSError):  # the report may be out already
            sender.send_bytes(payload)
        sender.close()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(1)
    sender.close()
    faulthandler.cancel_dump_traceback_later()


def _join(spec: _RankSpec) -> Any:
    """Join the group ``spec`` asks for; returns the process group's store, if any."""
    import torch.distributed as dist

    timeout = timedelta(seconds=spec.collective_timeout)
    store = None
    if spec.init == "process_group":
        store = dist.FileStore(  # type: ignore[attr-defined]
            os.path.join(spec.rendezvous_dir, "store"), spec.world_size
        )
        dist.init_process_group(
            spec.backend, store=store, rank=spec.rank, world_size=spec.world_size, timeout=timeout
        )
        _wait_for_peers_to_join(spec, store, timeout)
    elif spec.init == "rpc":
        from distgrad import rpc

        rpc.init_rpc(
            f"worker{spec.rank}",
            rank=spec.rank,
            world_size=spec.world_size,
            init_method=f"file://{os.path.join(spec.rendezvous_dir, 'rpc')}",
            timeout=spec.collective_timeout,
        )
    return store


def _wait_for_peers_to_join(spec: _RankSpec, store: Any, timeout: timedelta) -> None:
    """Return once every rank's ``init_process_group`` has returned.

    gloo connects a group asymmetrically: one rank's init may return while a peer is still
    finishing its side of the handshake. A function that then failed at once on the first rank
    would end that process and break the peer's init with "Connection closed by peer", an error
    that hides the real one (and whose C++ log line lands first on stderr). No rank runs the
    function before all have joined; the wait goes through the store, not a collective.
    """
    _store_barrier(spec, store, "joined", timeout)


def _wait_for_peers_to_finish(spec: _RankSpec, store: Any) -> None:
    """Wait, at most ``_LEAVE_GRACE_S``, until every rank's function has returned.

    A rank that tore down its connections the moment its function returned could break a peer
    still making one: gloo connects a new sub-group's members in the background, and a peer
    whose connect is in flight fails with "Connection closed by peer". The wait goes through
    the store, not a collective, and is short: a peer stuck in a collective this rank skipped
    must still fail soon, when this rank leaves, rather than wait for its timeout.
    """
    # A timeout (DistStoreError) means a peer is still busy: leave anyway.
    with contextlib.suppress(Exception):
        _store_barrier(spec, store, "finished", timedelta(seconds=_LEAVE_GRACE_S))


def _store_barrier(spec: _RankSpec, store: Any, stage: str, timeout: timedelta) -> None:
    """Say this rank reached ``stage`` and wait, at most ``timeout``, until every rank has."""
    keys = [f"distgrad/{stage}/{rank}" for rank in range(spec.world_size)]
    store.set(keys[spec.rank], "1")
    store.wait(keys, timeout)


def _leave(spec: _RankSpec, store: Any) -> None:
    import torch.distributed as dist

    if spec.init == "process_group" and dist.is_initialized():
        _wait_for_peers_to_finish(spec, store)
        dist.destroy_process_group()
    elif spec.init == "rpc":
        from distgrad import rpc

        rpc.shutdown()
