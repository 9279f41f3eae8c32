"""Whether a peer's process is still alive, learnt from a socket that the kernel closes when it
dies: no thread, no pending backend operation, nothing tied to a process group.

Why not ask gloo: a gloo operation already moving bytes is not failed when its peer's
connection closes, and the only gloo-side probe that sees the close (a receive kept pending on
a tag nobody sends on) needs a thread blocked in native code per peer per group, which nothing
can release: ``Work.abort`` is not exposed to Python, and neither ``destroy_process_group`` nor
the backend's ``shutdown``/``abort`` wake it (measured, torch 2.13). Such a thread woken by a
peer's exit while this interpreter is finalising ends in ``std::terminate`` ("terminate called
without an active exception", SIGABRT): 8 of 20 healthy torchrun jobs aborted at exit that way.

So every process that makes a distgrad call on a group of more than one rank listens on one
TCP socket of its own and writes its machine's boot id and its address to the default store
(``distgrad/alive/<global rank>``). A rank whose wait lasts a tick connects once to each peer
it waits on and, at every tick, polls those connections with a zero timeout. The kernel
completes a connection on a listening socket by itself (nobody needs to accept it) and resets
it when the listening process dies, however it dies, so a dead peer is seen within a tick. A
peer on this machine whose listener refuses the connection is gone too; on another machine a
refusal may only mean a wrong address, and a false "your peer died" is far worse than a
slower one, so such a peer is not watched (nor one that publishes a loopback address).

Costs, whatever the number of groups: one listening socket per process, and one connected
socket per peer process this one has waited on for a tick (gloo itself holds one per peer per
group). A poll of W - 1 sockets per tick of a long wait. No thread.

A peer on this machine, in this process's pid namespace, is also looked at directly: its pid
and start time are published beside the address, and ``/proc/<pid>/stat`` says at once whether
that process is running, exiting (the kernel has begun to tear it down: its sockets may not be
closed yet) or a zombie (killed or exited, not yet reaped by its parent: its exit status and
signal are there), with no wait. Every tick of a wait looks there too (:func:`dead`): a killed
process's sockets reset only once its memory is freed, tens to hundreds of milliseconds later.
:func:`verdict` is the question an error asks: gone (and how), running, or not known (no
address yet, another machine whose connection has not closed), so that a message never calls
a peer's process running on a guess.

The sockets are closed in a child made by ``fork`` (a data loader's worker, say), so a dead
rank's children do not keep its listener open, and when the default process group is
destroyed (the next group's store gets a new address).
"""

from __future__ import annotations

import atexit
import contextlib
import functools
import os
import select
import socket
import threading
import time
from collections.abc import Sequence
from typing import Any, Literal, NamedTuple

import torch.distributed as dist

__all__ = ["Verdict", "dead", "forget", "publish", "verdict"]

_CONNECT_TIMEOUT_S = 2.0
_RETRY_S = 1.0  # how often to look again for the address of a peer that published none
_KEY = "distgrad/alive/{rank}"

_lock = threading.Lock()
_listener: socket.socket | None = None
_published_in: int | None = None  # id() of the store the address was written to
_store_keep: Any = None  # that store, held so that its id is not reused while published
# Connections to peers' listeners, by global rank; None: the peer published no address.
_peers: dict[int, socket.socket | None] = {}
_retry_at: dict[int, float] = {}
# Peers found dead, by global rank, with why: a dead peer stays dead.
_gone: dict[int, str] = {}
# Peers' processes on this machine and in this pid namespace, by global rank: (pid, start time
# in clock ticks since boot), read with their addresses.
_procs: dict[int, tuple[int, int]] = {}

_PF_EXITING = 0x4  # include/linux/sched.h: the process is being torn down


class Verdict(NamedTuple):
    """What is known of a peer's process: ``state`` is "gone", "running" or "unknown"; ``why``
    says how it was seen (for "gone": how the process ended, where that can be known)."""

    state: Literal["gone", "running", "unknown"]
    why: str


def _default_store() -> Any:
    try:
        return dist.distributed_c10d._get_default_store()
    except Exception:  # no default group
        return None


def _host() -> str:
    """The address peers on other machines reach this process at: the interface gloo is told
    to use, else the one this machine routes to the rendezvous through, else the host name's."""
    ifname = os.environ.get("GLOO_SOCKET_IFNAME", "").split(",")[0]
    if ifname:
        with contextlib.suppress(OSError):
            return _interface_address(ifname)
    master = os.environ.get("MASTER_ADDR")
    if master:
        with (
            contextlib.suppress(OSError),
            socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe,
        ):
            probe.connect((master, 1))  # a UDP connect sends nothing: it only picks a route
            return str(probe.getsockname()[0])
    with contextlib.suppress(OSError):
        return socket.gethostbyname(socket.gethostname())
    return "127.0.0.1"


@functools.cache
def _machine() -> str:
    """What tells this machine from another: its boot id (its host name where none)."""
    with contextlib.suppress(OSError), open("/proc/sys/kernel/random/boot_id") as f:
        return f.read().strip()
    return socket.gethostname()


def _pid_namespace() -> str:
    try:
        return os.readlink("/proc/self/ns/pid").replace(" ", "")
    except OSError:
        return "-"


def _me() -> str:
    """This process as peers on this machine find it in /proc: pid, pid namespace, start time."""
    stat = _stat(os.getpid())
    start = stat[1] if stat is not None else -1
    return f"{os.getpid()} {_pid_namespace()} {start}"


def _stat(pid: int) -> tuple[bytes, int, int, int] | None:
    """(state, start time, flags, exit code) of ``pid`` from /proc (None: no such process)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            raw = f.read()
    except OSError:
        return None
    # The command name (field 2) is in parentheses and may hold spaces: split after it.
    fields = raw[raw.rindex(b")") + 2 :].split()
    exit_code = int(fields[49]) if len(fields) > 49 else 0  # Linux 3.5+
    return fields[0], int(fields[19]), int(fields[6]), exit_code


def _ended(status: int) -> str:
    """How a process ended, from its wait status (0: not readable, or a clean exit)."""
    signal_number = status & 0x7F
    if signal_number:
        import signal

        try:
            name = signal.Signals(signal_number).name
        except ValueError:
            name = f"signal {signal_number}"
        return f"killed by {name}"
    return f"exited with code {(status >> 8) & 0xFF}"


def _process_state(rank: int) -> Verdict:
    """What /proc says of ``rank``'s process (on this machine, in this pid namespace)."""
    found = _procs.get(rank)
    if found is None:
        return Verdict("unknown", "")
    pid, start = found
    stat = _stat(pid)
    if stat is None or stat[1] != start:  # reaped (or its pid reused since)
        return Verdict("gone", "its process is gone")
    state, _, flags, exit_code = stat
    if state in (b"Z", b"X"):
        how = f" ({_ended(exit_code)})" if exit_code else ""
        return Verdict("gone", f"its process has ended{how}")
    if flags & _PF_EXITING:
        return Verdict("gone", "its process is ending (killed, or it exited)")
    return Verdict("running", f"its process {pid} is running")


def _interface_address(ifname: str) -> str:
    if ifname == "lo":
        return "127.0.0.1"
    import fcntl
    import struct

    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        packed = struct.pack("256s", ifname.encode()[:15])
        info = fcntl.ioctl(probe.fileno(), 0x8915, packed)  # SIOCGIFADDR
        return socket.inet_ntoa(info[20:24])


def publish() -> None:
    """Listen, and write this process's address to the default store (once per store)."""
    global _listener, _published_in, _store_keep
    store = _default_store()
    if store is None or _published_in == id(store):
        return
    with _lock:
        if _published_in == id(store):
            return
        try:
            if _listener is None:
                listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
                listener.bind(("", 0))
                listener.listen(socket.SOMAXCONN)
                listener.setblocking(False)
                _listener = listener
            address = f"{_machine()} {_host()}:{_listener.getsockname()[1]} {_me()}"
            store.set(_KEY.format(rank=dist.get_rank()), address)
        except Exception:  # no store, no socket: peers fall back on the group's timeout
            return
        _published_in, _store_keep = id(store), store


def dead(global_ranks: Sequence[int], settle_s: float = 0.0) -> tuple[int, str] | None:
    """The first of ``global_ranks`` whose process is gone, with how that was seen, connecting
    to those not yet connected; ``settle_s`` waits that long for a close that is on its way."""
    for rank in global_ranks:
        if rank in _gone:
            return rank, _gone[rank]
    conns: list[tuple[int, socket.socket]] = []
    for rank in global_ranks:
        conn = _peers[rank] if rank in _peers else _connect(rank)
        if rank in _gone:
            return rank, _gone[rank]
        # Issue 37: a killed process is "exiting" in /proc at once, but its sockets reset only
        # once the kernel has freed its memory: measured on a loaded 2-core machine, 25-550 ms
        # after the kill for 0-1,000 MB (benchmarks/results/faults.md). A peer on this machine
        # is looked at in /proc too (one small read per tick).
        if rank in _procs:
            seen = _process_state(rank)
            if seen.state == "gone":
                _gone[rank] = seen.why
                return rank, seen.why
        if conn is not None:
            conns.append((rank, conn))
    if not conns:
        return None
    poller = select.poll()
    by_fd = {}
    for rank, conn in conns:
        poller.register(conn, select.POLLIN | select.POLLERR | select.POLLHUP)
        by_fd[conn.fileno()] = rank
    for fd, _ in poller.poll(int(settle_s * 1000)):
        rank = by_fd[fd]
        why = _closed(_peers[rank])
        if why is not None:
            _gone[rank] = _how(rank, why)
            return rank, _gone[rank]
    return None


def verdict(rank: int) -> Verdict:
    """Whether ``rank``'s process (a global rank) is gone, running, or not known, asked when a
    connection to it closed (after :func:`dead` let resets on their way arrive): /proc where it
    can tell, with no wait, else distgrad's liveness connection. Never "running" on a guess:
    only /proc says so, or a liveness connection that is open."""
    if rank in _gone:
        return Verdict("gone", _gone[rank])
    # Issue 37: a peer not yet published when a wait first looked (a job's first call) was not
    # looked for again for a second, so a kill in that second was "not seen dead": ask now.
    conn = _peers[rank] if rank in _peers else _connect(rank, force=True)
    if rank in _gone:
        return Verdict("gone", _gone[rank])
    seen = _process_state(rank)
    if seen.state == "gone":
        _gone[rank] = seen.why
        return seen
    if conn is not None:
        why = _closed(conn)
        if why is not None:
            _gone[rank] = _how(rank, why)
            return Verdict("gone", _gone[rank])
        if seen.state == "unknown":
            return Verdict("running", "its liveness connection is open")
    return seen


def _how(rank: int, seen: str) -> str:
    """How ``rank``'s death was seen, with how its process ended where /proc can tell."""
    state = _process_state(rank)
    return state.why if state.state == "gone" and "(" in state.why else seen


def _closed(conn: socket.socket | None) -> str | None:
    """Why ``conn`` is closed, or None if it is open (a peer never writes to it)."""
    if conn is None:
        return None
    try:
        data = conn.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT)
    except BlockingIOError:
        return None
    except OSError as exc:
        return f"its process reset distgrad's liveness connection ({os.strerror(exc.errno or 0)})"
    return None if data else "its process closed distgrad's liveness connection"


def _connect(rank: int, force: bool = False) -> socket.socket | None:
    """Connect to ``rank``'s listener (None: it published no address, or is not reachable).
    A peer that had published nothing is looked for again after ``_RETRY_S`` (the ticks of a
    wait need not ask the store every 20 ms), or at once with ``force`` (an error asking)."""
    now = time.monotonic()
    if _retry_at.get(rank, 0.0) > now and not force:
        return None
    store = _default_store()
    key = _KEY.format(rank=rank)
    try:
        if store is None or not store.check([key]):
            _retry_at[rank] = now + _RETRY_S  # it may not have made its first call yet
            return None
        machine, address, *me = store.get(key).decode().split(" ")
        host, port = address.rsplit(":", 1)
    except Exception:
        _retry_at[rank] = now + _RETRY_S
        return None
    if machine == _machine() and len(me) == 3 and me[1] == _pid_namespace() and me[1] != "-":
        _procs[rank] = (int(me[0]), int(me[2]))
    # On this machine a refused connection proves the peer gone; across machines it may only
    # be a wrong address (a host name that resolves to loopback), which must never be taken
    # for a death: such a peer is simply not watched.
    local = machine == _machine()
    if local:
        host = "127.0.0.1"
    elif host.startswith("127."):
        _peers[rank] = None
        return None
    conn = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    conn.settimeout(_CONNECT_TIMEOUT_S)
    try:
        conn.connect((host, int(port)))
    except ConnectionRefusedError:
        conn.close()
        if local:
            _gone[rank] = _how(rank, "nothing listens at its address any more: its process is gone")
        else:
            _peers[rank] = None
        return None
    except OSError:
        conn.close()
        _peers[rank] = None  # unreachable (a firewall?): the group's timeout still holds
        return None
    conn.setblocking(False)
    _peers[rank] = conn
    return conn


def forget() -> None:
    """Close every connection and forget the store (the default group is gone)."""
    with _lock:
        _close(listener=False)


def _close(listener: bool) -> None:
    global _listener, _published_in, _store_keep
    for conn in _peers.values():
        if conn is not None:
            with contextlib.suppress(OSError):
                conn.close()
    _peers.clear()
    _gone.clear()
    _procs.clear()
    _retry_at.clear()
    _published_in = _store_keep = None
    if listener and _listener is not None:
        with contextlib.suppress(OSError):
            _listener.close()
        _listener = None


def _after_fork_in_child() -> None:
    """A forked child is not the rank: it must not keep the rank's sockets open."""
    global _lock
    _lock = threading.Lock()  # another thread of the parent may have held it at the fork
    _close(listener=True)


def _close_at_exit() -> None:
    with _lock:
        _close(listener=True)


os.register_at_fork(after_in_child=_after_fork_in_child)
atexit.register(_close_at_exit)
