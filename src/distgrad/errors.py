"""Every error distgrad raises on purpose.

The hierarchy::

    DistgradError
    ├── CollectiveArgumentError    a collective was called with invalid arguments (a ValueError)
    │   └── CollectiveMismatchError    ranks disagree on shape, dtype, device or arguments
    ├── CheckArgumentError         the checker cannot use its arguments (a ValueError)
    ├── NotALossError              the checked function returned no scalar loss (a TypeError)
    ├── GradientMismatchError      the checker found a gradient that differs from the reference
    ├── PeerGoneError              a peer's process is gone, seen by distgrad's liveness check
    │                              (torch's DistBackendError too, as gloo raises for a closed
    │                              connection)
    ├── PipelineError              distributed autograd over point-to-point (distgrad.pipeline)
    │                              was misused or failed (a RuntimeError)
    ├── RankFailedError            a process started by run_on_ranks failed or timed out
    ├── UnsupportedOptionError     a drop-in loss (distgrad.integrations) was given a peer
    │                              library's option it cannot honour (a ValueError)
    └── RpcAutogradError           distributed autograd over RPC failed (a RuntimeError, as
        │                          torch.distributed.autograd raises)
        └── UnknownContextError    the autograd context id is not known on this worker

Both collective errors are raised on every rank of the group with the same message, before any
data moves: a rank that finds a problem with its own arguments still takes part in the metadata
exchange, so its peers learn of the problem instead of waiting for it.
"""

from __future__ import annotations

from typing import Any

from torch.distributed import DistBackendError

__all__ = [
    "CheckArgumentError",
    "CollectiveArgumentError",
    "CollectiveMismatchError",
    "DistgradError",
    "GradientMismatchError",
    "NotALossError",
    "PeerGoneError",
    "PipelineError",
    "RankFailedError",
    "RpcAutogradError",
    "UnknownContextError",
    "UnsupportedOptionError",
]


class DistgradError(Exception):
    """Base class of every error distgrad raises on purpose.

    Raised by:
        Nothing directly: every other error of ``distgrad.errors`` derives from it, so ``except
        DistgradError`` catches everything distgrad raises on purpose.

    Example:
        >>> try:
        ...     dg.all_reduce(torch.ones(2), op="mean")
        ... except dg.errors.DistgradError as error:
        ...     print(type(error).__name__)
        CollectiveArgumentError
    """


class CollectiveArgumentError(DistgradError, ValueError):
    """A collective was called with invalid arguments on at least one rank.

    Raised on every rank of the group with the same message, which names the op, the rank that
    passed the argument, what it passed and what was expected.

    Raised by:
        Every collective (``distgrad.all_gather``, ...), loss and parallel pattern, at the call,
        for an argument that is invalid on its own (an unknown op, a dim out of range, a sizes list
        of the wrong length).

    Example:
        >>> dg.all_reduce(torch.ones(2), op="mean")
        Traceback (most recent call last):
        ...
        distgrad.errors.CollectiveArgumentError: all_reduce(op='mean') on rank 0: op must be ...
    """


class CollectiveMismatchError(CollectiveArgumentError):
    """Ranks called a collective with arguments that do not fit together.

    Raised on every rank of the group with the same message, which names the op, the ranks
    that disagree and what each of them passed.

    Raised by:
        Every collective, loss and parallel pattern on two or more ranks, while the group's first
        calls are checked across ranks, in debug mode (``set_debug``) and with the data guard
        (``set_guard``).

    Example:
        >>> issubclass(dg.errors.CollectiveMismatchError, dg.errors.CollectiveArgumentError)
        True
    """


class CheckArgumentError(DistgradError, ValueError):
    """The checker was given arguments it cannot use; raised before any process starts.

    Raised by:
        ``distgrad.testing.check_against_single_process``, ``check_parallel_model``,
        ``run_on_ranks(simulate=True)`` (code that cannot be simulated truthfully) and the
        ``distgrad check`` command (exit 2).

    Example:
        >>> dg.testing.check_against_single_process(lambda x: x.sum(), {"y": torch.ones(2)})
        Traceback (most recent call last):
        ...
        distgrad.errors.CheckArgumentError: <lambda>(x) cannot take the inputs y by name ...
    """


class NotALossError(DistgradError, TypeError):
    """The function given to the checker returned something other than a scalar tensor.

    Raised by:
        ``distgrad.testing.check_against_single_process`` and ``distgrad check``, from the
        single-process run, before any rank starts.

    Example:
        >>> inputs = {"x": torch.ones(2, 1, dtype=torch.float64)}
        >>> dg.testing.check_against_single_process(lambda x: x, inputs, simulate=True)
        Traceback (most recent call last):
        ...
        distgrad.errors.NotALossError: ... loss as a scalar tensor, got Tensor(2, 1)
    """


class GradientMismatchError(DistgradError):
    """A distributed computation's loss or gradients differ from the single-process reference.

    Raised by:
        ``distgrad.testing.check_against_single_process(raise_on_mismatch=True)`` and
        ``check_parallel_model(raise_on_mismatch=True)``, with the report as its message.

    Example:
        >>> inputs = {"x": torch.ones(4, dtype=torch.float64)}  # a local sum, checked averaged
        >>> dg.testing.check_against_single_process(
        ...     lambda x: x.sum(), inputs, simulate=True, raise_on_mismatch=True
        ... )
        Traceback (most recent call last):
        ...
        distgrad.errors.GradientMismatchError: distgrad check on 2 ranks, ...: MISMATCH
        ...
    """


class PeerGoneError(DistgradError, DistBackendError):
    """A peer's process is gone, as distgrad's liveness check saw it while this rank waited.

    Raised (with distgrad's account of the op, the pass and the peer first) when gloo would
    not have failed the operation in flight. Also a ``torch.distributed.DistBackendError``,
    what gloo raises for a closed connection, so code written against torch catches it.

    Raised by:
        Any collective, loss or pattern waiting on a peer whose process has ended (docs/faults.md).

    Example:
        >>> issubclass(dg.errors.PeerGoneError, torch.distributed.DistBackendError)
        True
    """


class PipelineError(DistgradError, RuntimeError):
    """Distributed autograd over point-to-point (``distgrad.pipeline``) was misused or failed:
    a transfer outside a context, a backward run twice over the same transfers, a context left
    with transfers no backward ran. The message names the rank, the transfer and what to do.

    A ``RuntimeError`` too, as torch's own autograd and point-to-point errors are, so code
    written against torch catches it.

    Raised by:
        ``distgrad.pipeline.send``, ``isend``, ``recv`` and ``irecv`` called outside a
        ``distgrad.pipeline.context()``; ``context()`` entered inside another on one thread, or
        left with transfers no backward ran; ``backward``, ``backward_weights`` and
        ``get_gradients`` given a context id unknown on this rank, or a weight step out of
        order (a split backward's halves).

    Example:
        >>> dg.pipeline.get_gradients(12345)  # no context has that id on this rank
        Traceback (most recent call last):
        ...
        distgrad.errors.PipelineError: no dg.pipeline context with id 12345 on this rank ...
    """


class RankFailedError(DistgradError):
    """One or more ranks started by :func:`distgrad.testing.run_on_ranks` failed or timed out.

    The message holds every failing rank's traceback, the earliest failure first; ``results``
    maps each rank whose function returned to its value.

    Raised by:
        ``distgrad.testing.run_on_ranks`` and the checkers that start ranks with it.

    Example:
        >>> import operator
        >>> dg.testing.run_on_ranks(operator.getitem, 1)  # getitem(rank, world_size) raises
        Traceback (most recent call last):
        ...
        distgrad.errors.RankFailedError: getitem failed on 1 of 1 ranks (earliest first):
        ...
    """

    def __init__(self, message: str, results: dict[int, Any] | None = None) -> None:
        super().__init__(message)
        self.results: dict[int, Any] = dict(results or {})


class UnsupportedOptionError(DistgradError, ValueError):
    """A drop-in loss of :mod:`distgrad.integrations` was given an option of its peer library
    that it cannot honour exactly (a memory bank, a hardness weighting, horovod, ...).

    Raised for an option when the loss is built, before any data moves; the message names the
    argument, what was passed and what to do instead. A ``ValueError`` too, so code that
    catches a bad argument's ``ValueError`` catches it.

    Raised by:
        The constructors of ``distgrad.integrations.open_clip.ClipLoss`` and ``SigLipLoss``,
        ``distgrad.integrations.lightly.NTXentLoss``, and
        ``distgrad.integrations.sentence_transformers.MultipleNegativesRankingLoss`` and
        ``CachedMultipleNegativesRankingLoss``, for the options each one's docstring lists;
        and the sentence-transformers losses' forward, given fewer than two columns.

    Example:
        >>> dg.integrations.open_clip.ClipLoss(use_horovod=True)
        Traceback (most recent call last):
        ...
        distgrad.errors.UnsupportedOptionError: ClipLoss: use_horovod=True is not supported ...
    """


class RpcAutogradError(DistgradError, RuntimeError):
    """Distributed autograd over RPC failed; the message names the worker where it started.

    A ``RuntimeError`` too, as the errors of ``torch.distributed.autograd`` are, so code written
    against torch catches it.

    Raised by:
        ``distgrad.rpc.backward``, ``get_gradients``, ``DistributedOptimizer.step`` and the calls
        recorded in a context, on the worker that started the work.

    Example:
        >>> try:
        ...     dg.rpc.get_gradients(12345)
        ... except dg.errors.RpcAutogradError as error:  # here its subclass, UnknownContextError
        ...     print(type(error).__name__)
        UnknownContextError
    """


class UnknownContextError(RpcAutogradError):
    """The autograd context id is unknown on this worker (never created, or already released).

    Raised by:
        ``distgrad.rpc.backward``, ``get_gradients`` and ``DistributedOptimizer.step`` given an id
        that is not a live context on this worker.

    Example:
        >>> dg.rpc.get_gradients(12345)
        Traceback (most recent call last):
        ...
        distgrad.errors.UnknownContextError: Could not find autograd context with id: 12345 ...
    """
