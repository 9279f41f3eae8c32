"""A function of torch's replaced by a wrapper of distgrad's, once per process.

``_transport`` wraps ``torch.distributed.rpc.api._to_worker_info`` (the guard on torch's own
calls) and ``_ddp`` wraps ``DistributedDataParallel.forward``; each wrapper calls the function
it replaced, kept here.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any, Generic, TypeVar

__all__ = ["Patch"]

F = TypeVar("F", bound=Callable[..., Any])


class Patch(Generic[F]):
    """``original``: what ``owner.name`` was before :meth:`install` put a wrapper there (None
    until then)."""

    def __init__(self) -> None:
        self.original: F | None = None
        self._lock = threading.Lock()

    def install(self, owner: object, name: str, wrapper: F) -> None:
        """Put ``wrapper`` at ``owner.name`` (idempotent: once per process, whichever thread
        asks first; a later call costs one attribute read)."""
        if self.original is not None:
            return
        with self._lock:
            if self.original is None:
                self.original = getattr(owner, name)
                setattr(owner, name, wrapper)
