"""Check distributed code against the same computation in one process on the whole batch.

The user writes one function for one rank, ``fn(*shards)`` or ``fn(model, *shards)`` (a dict of
inputs binds by parameter name: ``fn(model, **shards)``), returning that rank's scalar loss. It
may use distgrad collectives (which act on a group of one process when no process group
exists, so the same function is its own single-process reference), a model, any loss. The
checker runs it

1. once, in this process, on the whole batch: the reference loss and gradients;
2. on ``world_size`` local processes in distgrad's debug mode (every collective call validated
   across ranks), each on its shard of every input, each calling ``loss.backward()``,

and compares the losses, each rank's input gradients with its slice of the reference, and the
parameter gradients combined over ranks the way training combines them (averaged, as
DistributedDataParallel does, or summed).

What "equal" means: the ranks together differentiate ``J = sum_r loss_r`` (docs/semantics.md).
Training matches single-process training when the combined parameter gradients equal
``dL/dθ``: with averaging that needs ``dJ/dx = N dL/dx`` for every input row ``x`` (each rank
returns the global loss, or its local mean over even shards), with summing ``dJ/dx = dL/dx``
(each rank returns its share). The checker compares against exactly that and, on a mismatch,
reads the losses and gradients for the likely cause (``_report``).
"""

from __future__ import annotations

import inspect
import os
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace

import torch
import torch.distributed as dist
from torch import Tensor, nn

from distgrad._exchange.handshake import debug_enabled, set_debug
from distgrad.collectives._common import near_even
from distgrad.errors import CheckArgumentError, NotALossError
from distgrad.testing import _simulate
from distgrad.testing._diagnose import Tolerance
from distgrad.testing._ranks import copy_on, made, run_job, state_of
from distgrad.testing._report import Combine, GradReport, RunResult, build_report

# The checker's errors live in distgrad.errors; importing them from here keeps working.
__all__ = ["CheckArgumentError", "NotALossError", "check_against_single_process"]

Inputs = Mapping[str, Tensor] | Sequence[Tensor]


@dataclass(frozen=True)
class _Job:
    """Everything a rank needs, pickled to it."""

    fn: Callable[..., Tensor]
    names: tuple[str, ...]
    by_name: bool  # a dict of inputs: pass them as keyword arguments
    shards: tuple[tuple[Tensor, ...], ...]  # shards[rank][i]: rank's slice of input i
    make_model: Callable[[], nn.Module] | None
    model_state: dict[str, Tensor] | None
    backward_ranks: tuple[int, ...] | None  # None: every rank back-propagates its loss
    debug: bool

    def on_rank(self, rank: int, world_size: int) -> RunResult:
        if self.debug:  # validate every collective call across ranks (docs/semantics.md)
            os.environ["DISTGRAD_DEBUG"] = "1"
            set_debug(True)
        leaves = [_leaf(t.detach().clone()) for t in self.shards[rank]]
        return self.run(leaves, self._model(), [rank])[0]

    def every_rank(self, world_size: int) -> list[RunResult]:
        """Every rank's run in one program (``_simulate``): ``fn`` called on tensors that hold
        each rank's shard."""
        was_debug = debug_enabled()
        set_debug(self.debug)
        try:
            ranks = range(world_size)
            leaves = [
                _leaf(_simulate.stacked([self.shards[r][i] for r in ranks]))
                for i in range(len(self.names))
            ]
            return self.run(leaves, self._model(), list(ranks))
        finally:
            set_debug(was_debug)

    def run(
        self, leaves: Sequence[Tensor], model: nn.Module | None, ranks: Sequence[int]
    ) -> list[RunResult]:
        """``fn`` on ``leaves``, one backward of the loss (times 0 on a rank that does not
        back-propagate: it still joins the backward's collectives), and the loss and
        gradients of each of ``ranks`` (more than one: the slots of a simulation)."""
        prefix = [model] if model is not None else []
        named = dict(zip(self.names, leaves, strict=True)) if self.by_name else {}
        loss = self.fn(*prefix, **named) if self.by_name else self.fn(*prefix, *leaves)
        if not isinstance(loss, Tensor) or loss.numel() != 1:
            raise NotALossError(
                "the checked function must return this rank's loss as a scalar tensor, got "
                f"{type(loss).__name__}{'' if not isinstance(loss, Tensor) else tuple(loss.shape)}"
            )
        if loss.requires_grad:
            weights = [
                float(self.backward_ranks is None or r in self.backward_ranks) for r in ranks
            ]
            weight = (
                weights[0]
                if len(ranks) == 1
                else _simulate.stacked([torch.tensor(w, dtype=loss.dtype) for w in weights])
            )
            torch.autograd.backward((loss * weight).reshape(()))
        params = dict(model.named_parameters()) if model is not None else {}
        return [
            RunResult(
                loss=float(_simulate.local(loss.detach().reshape(()), r).item()),
                input_grads={
                    n: copy_on(t.grad, r) for n, t in zip(self.names, leaves, strict=True)
                },
                param_grads={n: copy_on(p.grad, r) for n, p in params.items()},
            )
            for r in ranks
        ]

    def _model(self) -> nn.Module | None:
        if self.make_model is None or self.model_state is None:
            return None
        return made(self.make_model, self.model_state)


def check_against_single_process(
    fn: Callable[..., Tensor],
    inputs: Inputs,
    *,
    world_size: int = 2,
    model: Callable[[], nn.Module] | None = None,
    shard_dim: int = 0,
    shard_sizes: Sequence[int] | None = None,
    gradients: Combine = "averaged",
    rtol: float | None = None,
    atol: float | None = None,
    timeout: float = 120.0,
    raise_on_mismatch: bool = False,
    debug: bool = True,
    simulate: bool = False,
) -> GradReport:
    """Run ``fn`` on one process and on ``world_size`` processes and compare the gradients.

    ``fn(*shards)`` (or ``fn(model, *shards)`` when ``model`` is given) returns this rank's
    scalar loss. ``inputs`` is the global batch: a list or tuple of tensors, passed
    positionally in that order, or a dict of name to tensor, passed by parameter name
    (``fn(**shards)``, in whatever order ``fn`` declares them). Each is split along
    ``shard_dim`` into ``shard_sizes`` (default: as even as possible, larger shards first); a
    0-dim input (a temperature, say) goes whole to every rank and its gradient is combined over
    ranks like a parameter's. Floating-point inputs are differentiated. Run the checker under
    ``if __name__ == "__main__":`` in a script: the ranks are started processes that import the
    script's module.

    The single-process reference runs in this process, where no process group exists:
    distgrad's collectives act on a group of one process there, but ``torch.distributed``
    calls such as ``dist.get_world_size()`` raise (guard them with ``dist.is_initialized()``).
    The ranks run in distgrad's debug mode (:func:`distgrad.set_debug`), which validates every
    collective call across ranks, including where in the code each rank made it;
    ``debug=False`` turns it off for code whose ranks legitimately call from different lines.
    ``model`` is a picklable zero-argument factory (a module-level function or class); every
    process gets the reference model's exact parameters. ``fn`` must be picklable too (defined
    at module level).

    ``gradients`` says how training combines the ranks' parameter gradients: "averaged"
    (DistributedDataParallel, the default) or "summed". The update equals single-process
    training when the input gradients are ``N`` times (averaged) or exactly (summed) the
    single-process ones, and the combined parameter gradients equal the single-process ones.

    Tolerances default to ``rtol=1e-7, atol=1e-10`` for float64 inputs and ``rtol=1e-4,
    atol=1e-6`` otherwise (the ranks reduce in a different order than one process does).

    ``simulate=True`` runs every rank in this process (torch's ``LocalTensorMode`` over a
    fake process group) instead of starting processes: the same report, or
    :class:`~distgrad.errors.CheckArgumentError` for code that cannot be simulated truthfully
    (a Python decision whose per-rank runs disagree, an op LocalTensorMode has no rule for);
    docs/checker.md lists what simulates.

    Returns a :class:`GradReport`; with ``raise_on_mismatch=True`` a mismatch raises
    :class:`~distgrad.errors.GradientMismatchError` with the report's table and diagnosis.
    Arguments it cannot use raise :class:`~distgrad.errors.CheckArgumentError`, and a function
    that returns no scalar tensor :class:`~distgrad.errors.NotALossError`, before any process
    starts.

    Args:
        fn: the loss: ``fn(*shards)`` or ``fn(model, *shards)``, this rank's scalar loss.
        inputs: the global batch: a list or tuple of tensors, or a dict of name to tensor.
        world_size: the ranks.
        model: a picklable zero-argument factory of the model, or None.
        shard_dim: the dimension the inputs are split along.
        shard_sizes: every rank's shard size (default: as even as possible, larger first).
        gradients: how training combines the ranks' gradients: ``"averaged"`` or ``"summed"``.
        rtol: the relative tolerance (default: by dtype, above).
        atol: the absolute tolerance (default: by dtype, above).
        timeout: seconds the ranks may take.
        raise_on_mismatch: raise ``GradientMismatchError`` instead of returning a mismatch.
        debug: run the ranks in debug mode.
        simulate: run every rank in this process instead of starting processes.

    Returns:
        A ``GradReport``: the losses, every gradient's check, and what is wrong.

    Raises:
        CheckArgumentError: arguments it cannot use, or (``simulate=True``) code that cannot be
            simulated truthfully; before any process starts.
        NotALossError: ``fn`` returned no scalar tensor.
        GradientMismatchError: with ``raise_on_mismatch=True``, a mismatch.
        RankFailedError: a rank failed or timed out.

    Example:
        >>> g = torch.Generator().manual_seed(0)
        >>> q, k = torch.randn(2, 8, 3, dtype=torch.float64, generator=g)
        >>> report = dg.testing.check_against_single_process(
        ...     dg.losses.info_nce, {"query": q, "key": k}, world_size=4, simulate=True
        ... )
        >>> report.ok
        True
        >>> naive = dg.testing.check_against_single_process(  # a local sum, under DDP averaging
        ...     lambda x: x.pow(2).sum(), {"x": q}, simulate=True
        ... )
        >>> naive.ok, naive.diagnoses[0][:33]
        (False, 'every gradient is scaled by 1/2 (')
    """
    if world_size < 1:
        raise CheckArgumentError(f"world_size must be at least 1, got {world_size}")
    if gradients not in ("averaged", "summed"):
        raise CheckArgumentError(f"gradients must be 'averaged' or 'summed', got {gradients!r}")
    names, tensors = _normalise(inputs)
    by_name = isinstance(inputs, Mapping)
    _check_binding(fn, names, by_name, model is not None)
    sizes = _shard_sizes(tensors, shard_dim, shard_sizes, world_size)
    tol = Tolerance.default(tensors, rtol, atol)
    reference_model = model() if model is not None else None
    state = state_of(reference_model) if reference_model is not None else None
    shards = tuple(
        tuple(torch.split(t, sizes, dim=shard_dim)[rank] if _shardable(t) else t for t in tensors)
        for rank in range(world_size)
    )
    job = _Job(fn, names, by_name, shards, model, state, None, debug)
    reference = _reference_run(job, tensors, reference_model)

    def run(job: _Job) -> list[RunResult]:
        return run_job(
            job, world_size, simulate=simulate, timeout=timeout, who="check_against_single_process"
        )

    def probe() -> list[RunResult]:
        # Only rank 0 back-propagates: gradients that reach other ranks crossed a rank.
        return run(replace(job, backward_ranks=(0,)))

    report = build_report(
        reference, run(job), sizes, shard_dim, combine=gradients, tol=tol, probe=probe
    )
    if raise_on_mismatch:
        report.raise_if_mismatch()
    return report


def _check_binding(
    fn: Callable[..., Tensor], names: Sequence[str], by_name: bool, has_model: bool
) -> None:
    """Raise CheckArgumentError, before any process starts, if ``fn`` cannot take the inputs."""
    try:
        signature = inspect.signature(fn)
    except (TypeError, ValueError):
        return  # no signature to inspect (a builtin): let the call decide
    prefix = [None] if has_model else []
    model = "the model and " if has_model else ""
    title = f"{getattr(fn, '__name__', 'fn')}{signature}"
    try:
        if by_name:
            signature.bind(*prefix, **dict.fromkeys(names))
        else:
            signature.bind(*prefix, *names)
    except TypeError as exc:
        if by_name:
            raise CheckArgumentError(
                f"{title} cannot take {model}the inputs {', '.join(names)} by name ({exc}): a "
                "dict's keys are bound to the function's parameters by name; rename the keys, "
                "or pass a list or tuple to bind the inputs by position"
            ) from None
        raise CheckArgumentError(
            f"{title} cannot take {model}{len(names)} input tensor(s) positionally "
            f"({len(names) + len(prefix)} arguments): {exc}"
        ) from None


def _reference_run(job: _Job, tensors: Sequence[Tensor], model: nn.Module | None) -> RunResult:
    """The single-process run; a torch.distributed call that needs a process group gets a hint."""
    try:
        return job.run([_leaf(t.detach().clone()) for t in tensors], model, [0])[0]
    except ValueError as exc:
        if dist.is_initialized() or "process group has not been initialized" not in str(exc):
            raise
        _add_note(
            exc,
            "distgrad: the checker's single-process reference runs the function in this process, "
            "without a process group (distgrad's collectives act on a group of one process "
            "there). Guard torch.distributed calls: dist.get_world_size() if "
            "dist.is_initialized() else 1, and likewise dist.get_rank() (0).",
        )
        raise


def _add_note(exc: BaseException, note: str) -> None:
    if hasattr(exc, "add_note"):  # Python 3.11+: shown under the traceback
        exc.add_note(note)
    else:
        exc.args = (f"{exc.args[0] if exc.args else ''}\n{note}", *exc.args[1:])


def _normalise(inputs: Inputs) -> tuple[tuple[str, ...], tuple[Tensor, ...]]:
    if isinstance(inputs, Mapping):
        items = list(inputs.items())
        names = tuple(str(k) for k, _ in items)
        tensors = tuple(v for _, v in items)
    else:
        tensors = tuple(inputs)
        names = tuple(f"input {i}" for i in range(len(tensors)))
    for name, t in zip(names, tensors, strict=True):
        if not isinstance(t, Tensor):
            raise CheckArgumentError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if not tensors:
        raise CheckArgumentError("inputs is empty: give the global batch the function runs on")
    return names, tensors


def _shardable(t: Tensor) -> bool:
    return t.dim() > 0


def _shard_sizes(
    tensors: Sequence[Tensor], dim: int, sizes: Sequence[int] | None, world_size: int
) -> list[int]:
    lengths = {t.shape[dim] for t in tensors if _shardable(t)}
    if len(lengths) != 1:
        raise CheckArgumentError(
            f"every input must have the same length along shard_dim={dim}, got {sorted(lengths)}"
        )
    total = lengths.pop()
    if sizes is None:
        return near_even(total, world_size)
    if len(sizes) != world_size or sum(sizes) != total or min(sizes) < 0:
        raise CheckArgumentError(
            f"shard_sizes must be {world_size} non-negative ints adding up to {total}, "
            f"got {list(sizes)}"
        )
    return list(sizes)


def _leaf(t: Tensor) -> Tensor:
    """A fresh copy of an input made a leaf: differentiated when floating-point."""
    return t.requires_grad_(t.is_floating_point())
