"""DistributedOptimizer: step parameters on their owners with a context's gradients."""

from __future__ import annotations

import contextlib
import threading
import weakref
from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor
from torch.distributed import rpc as torch_rpc

from distgrad.errors import RpcAutogradError
from distgrad.rpc import _identity, _transport
from distgrad.rpc._context import lookup
from distgrad.rpc._local import use_process_threads
from distgrad.rpc.calls import RRef

__all__ = ["DistributedOptimizer"]

_UNSET = -1.0  # torch's "use the agent's default timeout"
# One lock per worker: concurrent steps on one worker (several trainers) run one at a time.
_step_lock = threading.Lock()


class _LocalOptimizer:
    """Lives on a parameters' owner: a ``torch.optim`` optimizer over its local parameters."""

    def __init__(
        self,
        optimizer_class: type[torch.optim.Optimizer],
        rrefs: list[torch_rpc.RRef[Tensor]],
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
    ) -> None:
        use_process_threads()  # on an RPC thread: see distgrad.rpc._local
        self.params: list[Tensor] = [rref.local_value() for rref in rrefs]
        self.optimizer = optimizer_class(self.params, *args, **kwargs)

    def step(self, context_id: int) -> None:
        use_process_threads()  # on an RPC thread: see distgrad.rpc._local
        grads = lookup(context_id).gradients()
        with _step_lock:
            saved = [p.grad for p in self.params]
            try:
                # A parameter without a gradient in the context keeps grad None: untouched.
                for p in self.params:
                    p.grad = grads.get(p)
                self.optimizer.step()
            finally:
                for p, grad in zip(self.params, saved, strict=True):
                    p.grad = grad


# The local optimizers living on this worker, by id (ids are unique across workers).
_local: dict[int, _LocalOptimizer] = {}


def _make(
    optimizer_id: int,
    optimizer_class: type[torch.optim.Optimizer],
    rrefs: list[torch_rpc.RRef[Tensor]],
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
) -> None:
    _local[optimizer_id] = _LocalOptimizer(optimizer_class, rrefs, args, kwargs)


def _step(optimizer_id: int, context_id: int) -> None:
    _local[optimizer_id].step(context_id)


def _drop(optimizer_id: int) -> None:
    _local.pop(optimizer_id, None)


def _drop_everywhere(owners: list[str], optimizer_id: int) -> None:
    for owner in owners:
        # RPC may already be shut down: then nothing is left to drop.
        with contextlib.suppress(Exception):
            _transport.call_async(owner, _drop, (optimizer_id,), _UNSET)


class DistributedOptimizer:
    """Step parameters spread over workers, each on its owner, with a context's gradients.

    ``params_rref`` lists references to parameters (:class:`distgrad.rpc.RRef` or torch's
    ``RRef``); one ``optimizer_class(params, *args, **kwargs)`` is created on each distinct
    owner. :meth:`step` runs every owner's optimizer with the gradients that owner holds in the
    context, in parallel. A parameter with no gradient in the context is left untouched
    (``.grad`` is set only for the duration of the step and then restored). Steps on one worker
    (from several callers) run one at a time.

    Cost: construction, one RPC per owner; each step, one RPC per owner, in parallel. The local
    optimizers are dropped when this object is garbage collected.

    Args:
        optimizer_class: the local optimizer each owner makes (``torch.optim.SGD``, ...).
        params_rref: references to the parameters, on their owners.
        *args: ``optimizer_class``'s positional arguments after the parameters.
        **kwargs: its keyword arguments.

    Raises:
        RpcAutogradError: an owner could not make its optimizer; ``step`` raises it naming every
            owner that failed.

    Example:
        >>> w = torch.ones(2, requires_grad=True)
        >>> optimizer = dg.rpc.DistributedOptimizer(torch.optim.SGD, [dg.rpc.RRef(w)], lr=0.5)
        >>> with dg.rpc.context() as context_id:
        ...     dg.rpc.backward(context_id, [(w * w).sum()])  # gradient 2 w
        ...     optimizer.step(context_id)
        >>> w
        tensor([0., 0.], requires_grad=True)
    """

    def __init__(
        self,
        optimizer_class: type[torch.optim.Optimizer],
        params_rref: Sequence[RRef[Any] | torch_rpc.RRef[Any]],
        *args: Any,
        **kwargs: Any,
    ) -> None:
        by_owner: dict[str, list[torch_rpc.RRef[Tensor]]] = {}
        for ref in params_rref:
            raw = ref.torch_rref if isinstance(ref, RRef) else ref
            by_owner.setdefault(str(raw.owner_name()), []).append(raw)
        self._id = _identity.new_id()
        self._owners = sorted(by_owner)
        futures = [
            (
                owner,
                _transport.call_async(
                    owner, _make, (self._id, optimizer_class, by_owner[owner], args, kwargs), _UNSET
                ),
            )
            for owner in self._owners
        ]
        weakref.finalize(self, _drop_everywhere, self._owners, self._id)
        for owner, fut in futures:
            try:
                fut.wait()
            except Exception as exc:
                raise RpcAutogradError(
                    f"DistributedOptimizer: creating {optimizer_class.__name__} on {owner} "
                    f"failed: {_transport.describe_error(exc)}"
                ) from None

    def step(self, context_id: int) -> None:
        """Run one step on every owner with its gradients in ``context_id``.

        Raises :class:`~distgrad.errors.RpcAutogradError` naming each owner that failed (after
        every owner has finished), e.g. because the context is unknown there.
        """
        futures = [
            (owner, _transport.call_async(owner, _step, (self._id, context_id), _UNSET))
            for owner in self._owners
        ]
        errors: list[str] = []
        for owner, fut in futures:
            try:
                fut.wait()
            except Exception as exc:
                errors.append(f"{owner}: {_transport.describe_error(exc)}")
        if errors:
            raise RpcAutogradError("DistributedOptimizer.step failed on " + "; ".join(errors))
