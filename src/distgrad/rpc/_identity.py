"""Who this worker is, which context this thread is in, and ids unique across workers.

Ids of contexts, messages, passes and optimizers carry the id of the worker that made them in
their high 16 bits and a per-worker counter in the low 48 (as torch's do), so they are unique
across workers without any coordination, and an id names the worker that created it.
"""

from __future__ import annotations

import itertools
import threading
from typing import Any

from torch._C._distributed_rpc import WorkerInfo
from torch.distributed import rpc as torch_rpc

__all__ = [
    "creator_of",
    "current_context_id",
    "forget",
    "name_of",
    "new_id",
    "rpc_timeout",
    "set_current",
    "set_rpc_timeout",
    "worker_id",
    "worker_name",
]

ID_BITS = 48
MAX_COUNT = (1 << ID_BITS) - 1
_lock = threading.Lock()
_counter = itertools.count(1)
_timeout_s = 60.0  # the RPC timeout this worker joined with
# (name, id) of this worker, read from the agent once: asking the agent costs a few
# microseconds, and the engine asks several times per message.
_me: tuple[str, int] | None = None
_local = threading.local()


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


def forget() -> None:
    """Drop what was learnt about this worker (it left its RPC group)."""
    global _me
    _me = None


def name_of(to: str | int | WorkerInfo) -> str:
    """The name of a worker given by name, id or ``WorkerInfo``."""
    if isinstance(to, str):
        return to
    if isinstance(to, int):
        from torch.distributed.rpc import api

        agent: Any = api._get_current_rpc_agent()  # type: ignore[attr-defined]
        return str(agent.get_worker_info(to).name)
    return str(to.name)


def new_id() -> int:
    """A new id, unique across workers: the worker id in the high 16 bits, a counter below."""
    with _lock:
        count = next(_counter)
    return (worker_id() << ID_BITS) | count


def creator_of(any_id: int) -> int:
    """The id of the worker that made ``any_id``."""
    return any_id >> ID_BITS


def rpc_timeout() -> float:
    """The RPC timeout (seconds) this worker joined with."""
    return _timeout_s


def set_rpc_timeout(seconds: float) -> None:
    global _timeout_s
    _timeout_s = float(seconds)


def current_context_id() -> int | None:
    """The id of the distributed autograd context this thread is in, or ``None``.

    Returns:
        The open context's id on this thread, or None outside one.

    Raises:
        Nothing.

    Example:
        >>> dg.rpc.current_context_id() is None
        True
        >>> with dg.rpc.context() as context_id:
        ...     dg.rpc.current_context_id() == context_id
        True
    """
    cid: int | None = getattr(_local, "context_id", None)
    return cid


def set_current(context_id: int | None) -> int | None:
    """Put this thread in ``context_id`` (``None``: in none); returns the previous one."""
    previous = current_context_id()
    _local.context_id = context_id
    return previous
