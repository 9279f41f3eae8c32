"""Joining and leaving an RPC group (TensorPipe), with distgrad's watchdog and guard."""

from __future__ import annotations

import warnings
from typing import Any

from torch._C._distributed_rpc import _is_current_rpc_agent_set
from torch.distributed import rpc as torch_rpc

from distgrad.errors import RpcAutogradError
from distgrad.rpc import _context, _identity, _liveness, _release, _transport

__all__ = ["init_rpc", "shutdown"]

_DEFAULT_TIMEOUT_S = 60.0
_TENSORPIPE = torch_rpc.BackendType.TENSORPIPE  # type: ignore[attr-defined]
_TORCH_OWN_BACKEND_WARNING = r"You are using a Backend .* as a ProcessGroup"


def init_rpc(
    name: str,
    backend: Any = None,
    rank: int = -1,
    world_size: int | None = None,
    rpc_backend_options: torch_rpc.TensorPipeRpcBackendOptions | None = None,
    *,
    init_method: str | None = None,
    timeout: float | None = None,
    num_worker_threads: int = 16,
) -> None:
    """Join an RPC group as worker ``name`` (TensorPipe); torch's signature, plus shortcuts.

    ``backend`` may only be ``None`` or ``BackendType.TENSORPIPE``. Either pass torch's
    ``rpc_backend_options``, or let distgrad build them from the keyword-only shortcuts:
    ``init_method`` (a rendezvous URL, ``"file:///path"`` or ``"tcp://host:port"``; default
    ``"env://"``), ``timeout`` (seconds, default 60; bounds every RPC, including the messages of
    a distributed backward) and ``num_worker_threads`` (a distributed backward holds one thread
    per hop while it waits, so chains deeper than that need more threads).

    Args:
        name: this worker's name, unique in the group.
        backend: ``None`` or ``BackendType.TENSORPIPE``.
        rank: this worker's rank.
        world_size: the number of workers.
        rpc_backend_options: torch's options; or the shortcuts below.
        init_method: the rendezvous URL.
        timeout: seconds every RPC may take (default 60).
        num_worker_threads: threads of the agent's pool.

    Returns:
        None, once every worker of the group has joined.

    Raises:
        ValueError: another backend, or options and shortcuts both given.
        RuntimeError: the rendezvous failed (torch's).

    Example:
        >>> import tempfile
        >>> where = f"file://{tempfile.mkdtemp()}/rpc"
        >>> dg.rpc.init_rpc("worker0", rank=0, world_size=1, init_method=where)
        >>> dg.rpc.rpc_sync("worker0", torch.neg, args=(torch.ones(1),))
        tensor([-1.])
        >>> dg.rpc.shutdown()
    """
    if backend is not None and backend != _TENSORPIPE:
        raise ValueError(f"init_rpc: distgrad.rpc runs on TensorPipe only, got backend={backend}")
    if rpc_backend_options is None:
        rpc_backend_options = torch_rpc.TensorPipeRpcBackendOptions(
            num_worker_threads=num_worker_threads,
            rpc_timeout=_DEFAULT_TIMEOUT_S if timeout is None else timeout,
            init_method="env://" if init_method is None else init_method,
            _transports=["uv"],  # loopback TCP; shared memory needs more host setup
        )
    elif init_method is not None or timeout is not None:
        raise ValueError(
            "init_rpc: pass either rpc_backend_options or the init_method/timeout shortcuts"
        )
    _identity.forget()
    _transport.forget()
    _identity.set_rpc_timeout(rpc_backend_options.rpc_timeout)
    with warnings.catch_warnings():
        # torch's TensorPipe setup calls all_gather_object on a ProcessGroupGloo backend it
        # made itself, and torch warns about that use of its own (torch 2.13: "You are using a
        # Backend ... as a ProcessGroup. This usage is deprecated"): nothing a caller can change.
        warnings.filterwarnings("ignore", _TORCH_OWN_BACKEND_WARNING, UserWarning)
        torch_rpc.init_rpc(  # type: ignore[no-untyped-call]
            name,
            backend=_TENSORPIPE,
            rank=rank,
            world_size=world_size,
            rpc_backend_options=rpc_backend_options,
        )
    _transport.install_guard()
    _liveness.ensure_started()


def shutdown(graceful: bool = True, timeout: float | None = None) -> None:
    """Leave the RPC group; with ``graceful=True`` first wait until every worker gets here.

    Returns within about ``timeout`` seconds (default: the RPC timeout) in any case. When a
    worker of the group is gone, or does not arrive in time, this worker still leaves (its
    contexts are dropped, its agent stopped) and then raises
    :class:`~distgrad.errors.RpcAutogradError` naming the workers it could not reach. Does
    nothing if this worker is not in an RPC group.

    Args:
        graceful: first wait until every worker calls ``shutdown``.
        timeout: seconds to wait (default: the RPC timeout).

    Returns:
        None.

    Raises:
        RpcAutogradError: a worker was gone or did not arrive in time (this worker has left).

    Example:
        >>> import tempfile
        >>> where = f"file://{tempfile.mkdtemp()}/rpc"
        >>> dg.rpc.init_rpc("worker0", rank=0, world_size=1, init_method=where)
        >>> dg.rpc.shutdown()
        >>> dg.rpc.shutdown()  # not in a group: nothing to do
    """
    if not _is_current_rpc_agent_set():
        return
    limit = _identity.rpc_timeout() if timeout is None else timeout
    me = _identity.worker_name()
    _liveness.stop()
    _release.wait_for_releases(min(limit, 10.0))
    problem = None
    try:
        gone = _unreachable_peers(limit) if graceful else []
        if gone:
            problem = f"could not reach {'; '.join(gone)}; left the group without waiting for it"
        with _transport.marked():  # torch's barrier makes RPCs, also if called in a context
            torch_rpc.shutdown(graceful=graceful and not gone, timeout=limit)
    except Exception as exc:
        problem = (
            f"the other workers did not all reach shutdown within {limit:g} s, so this worker "
            f"left without them ({_transport.describe_error(exc)})"
        )
    finally:
        _release.forget()
        _transport.forget()
        _context.forget_all()
        _identity.forget()
    if problem is not None:
        raise RpcAutogradError(f"shutdown on {me}: {problem}")


def _unreachable_peers(timeout: float) -> list[str]:
    """The workers of the group that fail a ping (a connection error, within ``timeout``)."""
    from torch.distributed.rpc import api

    agent: Any = api._get_current_rpc_agent()  # type: ignore[attr-defined]
    me = _identity.worker_name()
    peers = sorted(str(w.name) for w in agent.get_worker_infos() if w.name != me)
    pings = [(peer, _transport.ping(peer, timeout)) for peer in peers]
    gone = []
    for peer, fut in pings:
        try:
            fut.wait()
        except Exception as exc:
            gone.append(f"{peer} ({_transport.describe_error(exc)})")
    return gone
