"""DistributedOptimizer: step parameters on their owners with a context's gradients."""

from __future__ import annotations

import threading
from collections.abc import Sequence
from typing import Any

import torch
from torch.distributed import rpc as torch_rpc

from distgrad.errors import RpcAutogradError
from distgrad.rpc.calls import RRef
from distgrad.rpc.context import lookup

__all__ = ["DistributedOptimizer"]

# One lock per worker: concurrent steps on one worker (several trainers) run one at a time.
_step_lock = threading.Lock()


class _LocalOptimizer:
    """Lives on a parameters' owner: a ``torch.optim`` optimizer over its local parameters."""

    def __init__(
        self,
        optimizer_class: type[torch.optim.Optimizer],
        rrefs: list[Any],
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
    ) -> None:
        self.params = [rref.local_value() for rref in rrefs]
        self.optimizer = optimizer_class(self.params, *args, **kwargs)

    def step(self, context_id: int) -> None:
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


def _make(*args: Any) -> _LocalOptimizer:
    return _LocalOptimizer(*args)


def _check(optimizer_rref: Any) -> None:
    optimizer_rref.local_value()


def _step(optimizer_rref: Any, context_id: int) -> None:
    optimizer_rref.local_value().step(context_id)


class DistributedOptimizer:
    """Step parameters spread over workers, each on its owner, with a context's gradients.

    ``params_rref`` lists references to parameters (:class:`distgrad.rpc.RRef` or torch's
    ``RRef``); one ``optimizer_class(params, *args, **kwargs)`` is created on each distinct
    owner. :meth:`step` runs every owner's optimizer with the gradients that owner holds in the
    context, in parallel. A parameter with no gradient in the context is left untouched. Steps
    on one worker (from several callers) run one at a time.

    Cost: construction, one RPC per owner; each step, one RPC per owner.
    """

    def __init__(
        self,
        optimizer_class: type[torch.optim.Optimizer],
        params_rref: Sequence[Any],
        *args: Any,
        **kwargs: Any,
    ) -> None:
        by_owner: dict[str, list[Any]] = {}
        for ref in params_rref:
            raw = ref.torch_rref if isinstance(ref, RRef) else ref
            by_owner.setdefault(str(raw.owner_name()), []).append(raw)
        self._optimizers = [
            (owner, torch_rpc.remote(owner, _make, args=(optimizer_class, rrefs, args, kwargs)))
            for owner, rrefs in by_owner.items()
        ]
        for owner, rref in self._optimizers:
            try:
                # Surface a constructor error now, not at the first step.
                torch_rpc.rpc_sync(owner, _check, args=(rref,))
            except Exception as exc:
                raise RpcAutogradError(
                    f"DistributedOptimizer: creating {optimizer_class.__name__} on {owner} "
                    f"failed: {type(exc).__name__}: {str(exc).splitlines()[0][:300]}"
                ) from None

    def step(self, context_id: int) -> None:
        """Run one step on every owner with its gradients in ``context_id``.

        Raises :class:`~distgrad.errors.RpcAutogradError` naming the first owner that failed
        (after every owner has finished).
        """
        futures = [
            (owner, torch_rpc.rpc_async(owner, _step, args=(rref, context_id)))
            for owner, rref in self._optimizers
        ]
        errors: list[str] = []
        for owner, fut in futures:
            try:
                fut.wait()
            except Exception as exc:
                errors.append(
                    f"{owner}: {type(exc).__name__}: {str(exc).strip().splitlines()[0][:300]}"
                )
        if errors:
            raise RpcAutogradError("DistributedOptimizer.step failed on " + "; ".join(errors))
