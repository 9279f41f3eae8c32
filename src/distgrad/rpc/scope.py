"""Distributed autograd contexts: one per forward/backward pass, known to every worker it touches.

Gradients never go to ``.grad``: a backward pass stores each worker's gradients in that
worker's copy of the context; read them with :func:`get_gradients`. When the ``with`` block
exits, the context is released on this worker and on every worker it touched, transitively,
also when the block raised.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

from torch import Tensor

from distgrad.errors import RpcAutogradError
from distgrad.rpc import _context, _ddp, _fsdp, _identity, _release, _transport
from distgrad.rpc._context import DistAutogradContext

__all__ = ["DistAutogradContext", "context", "current_context_id", "debug_state", "get_gradients"]

current_context_id = _identity.current_context_id


@contextlib.contextmanager
def context(*, wait_for_release: bool = False) -> Iterator[int]:
    """Open a distributed autograd context on this thread and yield its id.

    The id is unique across workers (the worker id sits in its high 16 bits). RPCs made through
    :mod:`distgrad.rpc` inside the block carry the id and record send/recv pairs for tensors
    that require grad; torch's own ``rpc_sync``/``rpc_async``/``remote`` are refused inside
    the block (they would record nothing). A thread has at most one open context; opening a
    second one raises :class:`~distgrad.errors.RpcAutogradError`.

    On exit the context is dropped here at once, and a release goes to every worker this
    worker exchanged messages with (each forwards it to the workers it knows of). By default
    the release travels in the background, as in PyTorch, and this worker does not wait;
    ``wait_for_release=True`` waits until every worker has dropped the context and raises
    :class:`~distgrad.errors.RpcAutogradError` if one could not be reached (unless the block
    itself raised). :func:`~distgrad.rpc.shutdown` waits for releases still in flight.

    Cost: creating a context is local. On exit, the release for each worker it touched rides
    on this worker's next call to that worker made inside a context (no message of its own);
    releases that find no call within 5 ms go out as one message per worker.

    Args:
        wait_for_release: on exit, wait until every worker has dropped the context.

    Returns:
        A context manager; ``with`` it gives the context's id.

    Raises:
        RpcAutogradError: this thread is already in a context; with ``wait_for_release=True``, a
            worker could not be reached to release it.

    Example:
        >>> x = torch.ones(2, requires_grad=True)
        >>> with dg.rpc.context() as context_id:
        ...     y = dg.rpc.rpc_sync("worker0", torch.mul, args=(x, 3))  # a recorded call
        ...     dg.rpc.backward(context_id, [y.sum()])
        ...     grads = dg.rpc.get_gradients(context_id)
        >>> grads[x], x.grad  # the context holds the gradient; .grad is untouched
        (tensor([3., 3.]), None)
    """
    if current_context_id() is not None:
        raise RpcAutogradError(  # torch's words first: programs and torch's tests match them
            "Already have an autograd context id for this thread: this thread is already in "
            f"autograd context {current_context_id()}, and a thread can be in only one "
            "context at a time"
        )
    _transport.install_guard()
    _ddp.install()
    _fsdp.install()
    context_id = _identity.new_id()
    _context.get_or_create(context_id)
    _identity.set_current(context_id)
    failed = True
    try:
        yield context_id
        failed = False
    finally:
        _identity.set_current(None)
        if not wait_for_release:
            _release.release_in_background(context_id)
        elif (errors := _release.release(context_id, sender=None)) and not failed:
            raise RpcAutogradError(
                f"autograd context {context_id} could not be released on every worker: "
                + "; ".join(errors)
            )


def get_gradients(context_id: int) -> dict[Tensor, Tensor]:
    """This worker's gradients in the context: a dict from each tensor to its gradient.

    Only tensors of this worker that a distributed backward reached appear; their ``.grad`` is
    untouched. Each gradient is a tensor of its own, like ``.grad`` (see docs/rpc.md).
    Raises :class:`~distgrad.errors.UnknownContextError` for an unknown id.

    Args:
        context_id: the context's id, as ``context()`` gave it.

    Returns:
        A dict from each of this worker's tensors that the backward reached to its gradient.

    Raises:
        UnknownContextError: the id is not a live context on this worker.

    Example:
        >>> w = torch.tensor([2.0], requires_grad=True)
        >>> with dg.rpc.context() as context_id:
        ...     dg.rpc.backward(context_id, [(w * w).sum()])
        ...     dg.rpc.get_gradients(context_id)[w]
        tensor([4.])
    """
    return _context.lookup(context_id).gradients()


_COUNTER_NAMES = (
    "gradient_messages_sent",
    "gradient_tensors_sent",
    "gradient_messages_received",
    "gradient_replies_sent",
    "gradient_replies_received",
    "lineage_messages_sent",
    "engine_runs",
    "release_messages_sent",
    "release_failures",
    "contexts_dropped_peer_gone",
)


def debug_state() -> dict[str, int]:
    """Counts on this worker, for leak checks and message accounting.

    ``contexts`` (live), ``passes_in_flight`` (backward work running or waiting for answers),
    ``smart_passes`` (SMART state held), ``sends`` and ``recvs`` (records in live contexts), and
    running totals since the worker started: ``gradient_messages_sent``,
    ``gradient_tensors_sent`` (``None`` gradients are not counted: they travel as ``None``),
    ``gradient_messages_received``, ``gradient_replies_sent`` and ``gradient_replies_received``
    (gradients that rode back inside the answer to a gradient message),
    ``lineage_messages_sent``, ``engine_runs`` (calls of the local autograd engine),
    ``release_messages_sent`` (release messages: for releases that found no call to ride on,
    or with ``wait_for_release=True``), ``release_failures`` and ``contexts_dropped_peer_gone``
    (contexts released because a worker they involve stopped answering).

    Returns:
        A dict of counts, by the names above.

    Raises:
        Nothing: before ``init_rpc`` and after ``shutdown`` too.

    Example:
        >>> state = dg.rpc.debug_state()
        >>> state["contexts"], state["passes_in_flight"]  # no context is open
        (0, 0)
    """
    contexts = _context.live_contexts()
    return {
        **dict.fromkeys(_COUNTER_NAMES, 0),
        **_context.counters,
        "contexts": len(contexts),
        "passes_in_flight": sum(c.passes_in_flight for c in contexts),
        "smart_passes": sum(len(c.pass_states) for c in contexts),
        "sends": sum(len(c.sends) for c in contexts),
        "recvs": sum(len(c.recvs) for c in contexts),
    }
