"""Starting and stopping RPC workers, and who this worker is.

The transport is ``torch.distributed.rpc`` with the TensorPipe backend; distgrad only adds its
own autograd bookkeeping on top. Ids of contexts and messages carry the worker id in their high
16 bits and a per-worker counter in the low 48, so they are unique across workers without any
coordination.
"""

from __future__ import annotations

import itertools
import threading
from typing import Any

from torch._C._distributed_rpc import WorkerInfo
from torch.distributed import rpc as torch_rpc

__all__ = ["init_rpc", "new_id", "shutdown", "worker_id", "worker_name"]

_ID_BITS = 48
_lock = threading.Lock()
_counter = itertools.count(1)
_timeout_s = 60.0  # the RPC timeout given to init_rpc


def init_rpc(
    name: str,
    rank: int,
    world_size: int,
    init_method: str | None = None,
    timeout: float = 60.0,
    *,
    num_worker_threads: int = 16,
) -> None:
    """Join an RPC group as worker ``name`` (TensorPipe over loopback TCP).

    ``init_method`` is a rendezvous URL (``"file:///path"`` or ``"tcp://host:port"``); ``timeout``
    (seconds) bounds every RPC, including the messages of a distributed backward pass. Each
    worker serves incoming calls on ``num_worker_threads`` threads; a distributed backward holds
    one thread per hop while it waits, so chains deeper than that need more threads.
    """
    global _timeout_s, _me
    _timeout_s = float(timeout)
    _me = None
    options = torch_rpc.TensorPipeRpcBackendOptions(
        num_worker_threads=num_worker_threads,
        rpc_timeout=timeout,
        init_method=init_method if init_method is not None else "env://",
        _transports=["uv"],  # loopback TCP; shared memory needs more host setup
    )
    torch_rpc.init_rpc(  # type: ignore[no-untyped-call]
        name, rank=rank, world_size=world_size, rpc_backend_options=options
    )


def shutdown(graceful: bool = True) -> None:
    """Leave the RPC group; with ``graceful=True`` wait until every worker has finished its work.

    Contexts still open on this worker are dropped.
    """
    from distgrad.rpc.context import _forget_all, wait_for_releases

    global _me
    wait_for_releases()
    try:
        torch_rpc.shutdown(graceful=graceful)
    finally:
        _forget_all()
        _me = None


def rpc_timeout() -> float:
    """The RPC timeout (seconds) this worker joined with."""
    return _timeout_s


# (name, id) of this worker, read from the agent once: asking the agent costs a few
# microseconds, and the engine asks several times per message.
_me: tuple[str, int] | None = None


def _whoami() -> tuple[str, int]:
    global _me
    if _me is None:
        info = torch_rpc.get_worker_info()
        _me = (str(info.name), int(info.id))
    return _me


def worker_name() -> str:
    """This worker's name in the RPC group."""
    return _whoami()[0]


def worker_id() -> int:
    """This worker's id (its rank) in the RPC group."""
    return _whoami()[1]


def name_of(to: str | int | WorkerInfo) -> str:
    """The name of a worker given by name, id or ``WorkerInfo``."""
    if isinstance(to, str):
        return to
    if isinstance(to, int):
        from torch.distributed.rpc import api

        agent: Any = api._get_current_rpc_agent()  # type: ignore[attr-defined]
        return str(agent.get_worker_info(to).name)
    return str(to.name)


def describe_error(exc: BaseException) -> str:
    """``Type: message`` of an error, unwrapping the text torch's RPC adds to remote errors."""
    lines = [line for line in str(exc).strip().splitlines() if line.strip()]
    if len(lines) >= 2 and "On WorkerInfo(" in lines[0]:
        return lines[1][:300]  # the remote exception's repr, e.g. ValueError('...')
    return f"{type(exc).__name__}: {lines[0][:300] if lines else ''}"


def new_id() -> int:
    """A new id, unique across workers: the worker id in the high 16 bits, a counter below."""
    with _lock:
        count = next(_counter)
    return (worker_id() << _ID_BITS) | count
