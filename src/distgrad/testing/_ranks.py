"""One way to run a checker's job on every rank: started processes (:func:`run_on_ranks`) or
every rank simulated in this process (``_simulate``); and what a job does on any rank.

A job is a picklable object with two methods: ``on_rank(rank, world_size)``, one rank's
result in a started process, and ``every_rank(world_size)``, every rank's result from one
program in which each tensor holds every rank's value (the simulation's *slots*).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol, TypeVar

from torch import Tensor, nn

from distgrad.testing import _simulate
from distgrad.testing.launch import run_on_ranks

__all__ = ["Job", "copy_on", "full_value", "made", "plain_named", "run_job", "state_of"]

_R = TypeVar("_R")


class Job(Protocol[_R]):
    """What a checker runs on its ranks."""

    def on_rank(self, rank: int, world_size: int) -> _R: ...

    def every_rank(self, world_size: int) -> list[_R]: ...


def run_job(job: Job[_R], world_size: int, *, simulate: bool, timeout: float, who: str) -> list[_R]:
    """Every rank's result of ``job``, indexed by rank; ``who`` names the checker in errors."""
    if simulate:
        return _simulate.run_simulated(lambda: job.every_rank(world_size), world_size, who)
    return run_on_ranks(_on_rank, world_size, args=(job,), timeout=timeout)


def _on_rank(rank: int, world_size: int, job: Job[_R]) -> _R:
    return job.on_rank(rank, world_size)


def state_of(model: nn.Module) -> dict[str, Tensor]:
    """The model's parameters and buffers, detached copies: every rank starts from them."""
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def made(make_model: Callable[[], nn.Module], state: dict[str, Tensor]) -> nn.Module:
    """A fresh model holding ``state``: the reference's exact initial values."""
    model = make_model()
    model.load_state_dict(state)
    return model


def copy_on(t: Tensor | None, rank: int) -> Tensor | None:
    """Rank ``rank``'s value of ``t``, a detached copy (a plain tensor's value is its own)."""
    return None if t is None else _simulate.local(t, rank).detach().clone()


# What wrappers insert into parameter names (DDP, FSDP1, activation checkpointing, compile).
_WRAPPERS = ("module", "_fsdp_wrapped_module", "_checkpoint_wrapped_module", "_orig_mod")


def plain_named(model: nn.Module) -> list[tuple[str, nn.Parameter]]:
    """The parameters under the names the plain model gives them, wrappers' parts dropped."""
    return [
        (".".join(part for part in name.split(".") if part not in _WRAPPERS), p)
        for name, p in model.named_parameters()
    ]


def full_value(t: Tensor | None) -> Tensor | None:
    """A DTensor's whole value (a collective over its mesh), or the local tensor, detached."""
    if t is None:
        return None
    from torch.distributed.tensor import DTensor

    if isinstance(t, DTensor):
        t = t.full_tensor()
    return t.detach().clone()
