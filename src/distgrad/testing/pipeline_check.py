"""Check a model split into pipeline stages against the whole model in one process.

``check_pipeline(make_model, split, batch, loss_fn, schedule="1F1B", world_size=2, ...)``

1. in this process: ``model = make_model()`` runs the whole ``batch`` (``(*inputs, target)``)
   at once, and the loss is the mean over the microbatches (the rows each pipeline replica's
   schedule gives each microbatch) of ``loss_fn(output_rows, target_rows)``: what torch's
   schedules train with their default ``scale_grads=True``; then ``backward`` and
   ``optimizer.step()``, ``steps`` times, recording every parameter's gradient and update;
2. on ``world_size`` local processes (:func:`~distgrad.testing.run_on_ranks`, gloo): a
   DeviceMesh (``pp``, or ``pp`` x ``dp``), the same initial parameters, ``split(model,
   n_stages)`` into stage modules holding the model's own parameters, each rank keeping its
   stages (``_schedules``: torch's layouts), wrapped for data parallel over ``dp`` if asked
   (FSDP2, DDP), and the same steps through torch's schedule (``PipelineStage``, ``step``) or
   the user's program; every stage's copy of every parameter is recorded under the full
   model's name (found by identity), so a parameter two stages hold (tied embeddings) is seen
   on both;
3. diagnoses every parameter's gradient and update with the engine every checker shares
   (``_diagnose``): its rows are the copies, one per stage that holds it and data-parallel
   replica. The findings in pipeline words: agree; scaled by the number of microbatches or of
   stages (or a data-parallel size); missing (no gradient reached it: a detached boundary, a
   weight-gradient step that never runs, read from which stages miss theirs); a tied
   parameter whose stage copies were never summed (naming both stages); wrong.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal, Protocol

import torch
from torch import Tensor, nn

from distgrad.errors import CheckArgumentError
from distgrad.testing._diagnose import Tolerance, compare, diagnose
from distgrad.testing._ranks import full_value, made, plain_named, state_of
from distgrad.testing._report import ParameterCheck, PipelineReport, pipeline_words
from distgrad.testing._schedules import Layout, Plan, plan
from distgrad.testing.launch import run_on_ranks
from distgrad.testing.model_check import MakeOptimizer, default_optimizer

__all__ = [
    "DataParallel",
    "Microbatches",
    "PipelineProgram",
    "PipelineReport",
    "check_pipeline",
]

LossFn = Callable[[Tensor, Tensor], Tensor]
Split = Callable[[nn.Module, int], Sequence[nn.Module]]
DataParallel = Literal["fsdp2", "ddp"] | Callable[[nn.Module, Any], nn.Module] | None
#: Called on every rank after the pipeline's backward and before the optimizer step, with the
#: rank's stage modules, their stage indices and the mesh: where a user sums a tied
#: parameter's gradient between the stages that hold it.
FinalizeGrads = Callable[[Sequence[nn.Module], Sequence[int], Any], None]


@dataclass(frozen=True)
class Microbatches:
    """One rank's share of the batch in a pipeline program (``schedule=`` a callable), made by
    ``check_pipeline``: the batch's rows split over data parallel, then into microbatches.

    Attributes:
        inputs: each microbatch's model inputs (a tuple per microbatch), on the rank holding
            stage 0, else None.
        targets: each microbatch's target, on the rank holding the last stage, else None.
        stage_ranks: stage index -> the pipeline group's rank holding it (its length is the
            number of stages).
        count: the number of microbatches, what ``len()`` returns.

    Example:
        >>> x, y = torch.ones(4, 3), torch.zeros(4, 1)
        >>> on_rank_0 = dg.testing.Microbatches(  # stage 0 of 2: the inputs, no targets
        ...     [(part,) for part in x.tensor_split(2)], None, {0: 0, 1: 1}, 2
        ... )
        >>> len(on_rank_0), on_rank_0.inputs[1][0].shape, on_rank_0.targets
        (2, torch.Size([2, 3]), None)
    """

    inputs: list[tuple[Tensor, ...]] | None
    targets: list[Tensor] | None
    stage_ranks: Mapping[int, int]
    count: int

    def __len__(self) -> int:
        return self.count


class PipelineProgram(Protocol):
    """A pipeline written without torch's schedules: what ``check_pipeline(schedule=...)``
    runs on every rank, once per training step, in place of a torch schedule.

    It gets this rank's stage modules and their stage indices (ascending), its
    :class:`Microbatches`, the per-microbatch ``loss_fn(output, target)`` and the pipeline's
    process group; it runs every microbatch forward and backward, sending activations and
    gradients between the ranks, and leaves each stage parameter's gradient of the mean over
    microbatches of ``loss_fn`` in ``.grad`` (the checker zeroes them before each step and
    steps the optimizer after). It returns the per-microbatch losses on the rank holding the
    last stage (for the report), or None. ``check_pipeline`` pickles it to the ranks, so it is
    defined at module level (or is an instance of a module-level class).

    Args:
        stages: this rank's stage modules (wrapped for data parallel if asked).
        stage_indices: their stage indices, ascending.
        microbatches: this rank's share of the batch (:class:`Microbatches`).
        loss_fn: ``loss_fn(output, target)``, one microbatch's loss.
        group: the pipeline's process group (the mesh's ``"pp"`` dim).

    Returns:
        The per-microbatch losses on the rank holding the last stage; None elsewhere.

    Example:
        >>> def program(stages, stage_indices, microbatches, loss_fn, group, /):
        ...     # every stage on this rank (here one): no transfers
        ...     losses = []
        ...     for (x,), y in zip(microbatches.inputs, microbatches.targets):
        ...         loss = loss_fn(stages[0](x), y)
        ...         (loss / len(microbatches)).backward()  # .grad: the microbatches' mean
        ...         losses.append(loss.detach())
        ...     return losses
        >>> g = torch.Generator().manual_seed(0)
        >>> x, y = torch.randn(4, 3, generator=g), torch.randn(4, 1, generator=g)
        >>> model = torch.nn.Linear(3, 1)
        >>> micro = dg.testing.Microbatches(
        ...     [(part,) for part in x.tensor_split(2)], list(y.tensor_split(2)), {0: 0}, 2
        ... )
        >>> len(program([model], [0], micro, torch.nn.functional.mse_loss, None))  # 2 losses
        2
        >>> whole = torch.nn.functional.mse_loss(model(x), y)  # equal microbatches: the mean
        >>> torch.allclose(model.weight.grad, torch.autograd.grad(whole, model.weight)[0])
        True
    """

    def __call__(
        self,
        stages: Sequence[nn.Module],
        stage_indices: Sequence[int],
        microbatches: Microbatches,
        loss_fn: LossFn,
        group: Any,
        /,
    ) -> Sequence[Tensor] | None: ...


# One step on one rank: (stage, full parameter name) -> (gradient, value after, value before).
_Record = dict[tuple[int, str], tuple[Tensor | None, Tensor | None, Tensor | None]]
# What a rank reports: its per-microbatch losses at each step (None without the last stage),
# each step's record, its mesh coordinates.
_RankRun = tuple[list[list[float] | None], list[_Record], tuple[int, ...]]


@dataclass(frozen=True)
class _Job:
    """Everything a rank needs, pickled to it."""

    make_model: Callable[[], nn.Module]
    split: Split
    loss_fn: LossFn
    state: dict[str, Tensor]
    inputs: tuple[Tensor, ...]
    target: Tensor
    plan: Plan
    mesh_shape: tuple[int, ...]
    mesh_dim_names: tuple[str, ...]
    data_parallel: DataParallel
    finalize_grads: FinalizeGrads | None
    n_microbatches: int
    steps: int
    optimizer: MakeOptimizer

    @property
    def pp(self) -> int:
        return self.mesh_dim_names.index("pp")

    def dp_dim(self) -> int | None:
        return next((d for d in range(len(self.mesh_shape)) if d != self.pp), None)


def _on_rank(rank: int, world_size: int, job: _Job) -> _RankRun:
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", job.mesh_shape, mesh_dim_names=job.mesh_dim_names)
    coords = tuple(mesh.get_coordinate() or ())
    pp_group = mesh.get_group("pp")
    n_stages, ranks = job.plan.n_stages, job.plan.ranks
    own = sorted(s for s, r in ranks.items() if r == coords[job.pp])
    model = made(job.make_model, job.state)
    stages = _split(job, model, rank)
    # Named before wrapping: a wrapper may replace the parameter objects (FSDP2's DTensors),
    # never their names within the stage (DDP's "module." is dropped by plain_named).
    names = [_full_names(model, stages[s], s, rank) for s in own]
    mods = [_wrapped(job, stages[s], mesh) for s in own]
    dp = job.dp_dim()
    index, parts = (coords[dp], job.mesh_shape[dp]) if dp is not None else (0, 1)
    inputs = tuple(t.tensor_split(parts)[index] for t in job.inputs)
    target = job.target.tensor_split(parts)[index]
    if job.plan.program is not None:
        program = job.plan.program
        n = job.n_microbatches
        micro = Microbatches(
            list(zip(*(t.tensor_split(n) for t in inputs), strict=True)) if 0 in own else None,
            list(target.tensor_split(n)) if n_stages - 1 in own else None,
            dict(ranks),
            n,
        )

        def run() -> list[float] | None:
            out = program(mods, own, micro, job.loss_fn, pp_group)
            return None if out is None else [float(x.detach()) for x in out]
    else:
        run = _torch_runner(job, mods, own, pp_group, inputs, target)
    unique = list({id(p): p for m in mods for p in m.parameters()}.values())
    opt = job.optimizer(unique)
    losses: list[list[float] | None] = []
    records: list[_Record] = []
    for _ in range(job.steps):
        opt.zero_grad(set_to_none=True)
        before = _values(mods, own, names, lambda p: p)
        losses.append(run())
        if job.finalize_grads is not None:
            job.finalize_grads(mods, own, mesh)
        grads = _values(mods, own, names, lambda p: p.grad)
        opt.step()
        after = _values(mods, own, names, lambda p: p)
        records.append({k: (grads[k], after[k], before[k]) for k in after})
    return losses, records, coords


def _torch_runner(
    job: _Job,
    mods: list[nn.Module],
    own: list[int],
    group: Any,
    inputs: tuple[Tensor, ...],
    target: Tensor,
) -> Callable[[], list[float] | None]:
    from torch.distributed.pipelining import PipelineStage

    n_stages = job.plan.n_stages
    cpu = torch.device("cpu")
    stages = [
        PipelineStage(m, s, n_stages, cpu, group=group) for s, m in zip(own, mods, strict=True)
    ]
    assert job.plan.schedule is not None
    options = {"loss_fn": job.loss_fn, **job.plan.kwargs}
    held: Any = stages[0] if job.plan.single else stages
    schedule = job.plan.schedule(held, job.n_microbatches, **options)

    def run() -> list[float] | None:
        args = inputs if 0 in own else ()
        if n_stages - 1 not in own:
            schedule.step(*args)
            return None
        losses: list[Tensor] = []
        schedule.step(*args, target=target, losses=losses)
        return [float(x.detach()) for x in losses]

    return run


def _split(job: _Job, model: nn.Module, rank: int | None) -> list[nn.Module]:
    n = job.plan.n_stages
    stages = list(job.split(model, n))
    if len(stages) != n or not all(isinstance(s, nn.Module) for s in stages):
        kinds = [type(s).__name__ for s in stages]
        raise CheckArgumentError(
            f"check_pipeline{_on(rank)}: split(model, {n}) must return {n} stage modules "
            f"(nn.Module), got {len(stages)}: {kinds}"
        )
    return stages


def _full_names(model: nn.Module, stage: nn.Module, index: int, rank: int | None) -> dict[str, str]:
    """Stage-local parameter name -> the full model's name of the same parameter object."""
    full = {id(p): n for n, p in model.named_parameters()}
    names = {}
    for local, p in stage.named_parameters():
        if id(p) not in full:
            raise CheckArgumentError(
                f"check_pipeline{_on(rank)}: stage {index}'s parameter {local!r} is not a "
                "parameter of the model make_model() returned: split must return modules "
                "holding the model's own parameters (its submodules, or modules built around "
                "them), not copies"
            )
        names[local] = full[id(p)]
    return names


def _listing(items: Sequence[str]) -> str:
    return items[0] if len(items) == 1 else ", ".join(items[:-1]) + " and " + items[-1]


def _on(rank: int | None) -> str:
    return "" if rank is None else f" on rank {rank}"


def _wrapped(job: _Job, stage: nn.Module, mesh: Any) -> nn.Module:
    dp = job.dp_dim()
    if job.data_parallel is None or dp is None:
        return stage
    dp_mesh = mesh[job.mesh_dim_names[dp]]
    if job.data_parallel == "fsdp2":
        from torch.distributed.fsdp import fully_shard

        fully_shard(stage, mesh=dp_mesh)
        return stage
    if job.data_parallel == "ddp":
        from torch.nn.parallel import DistributedDataParallel

        # find_unused_parameters=True keeps DDP's reducer from rebuilding its buckets after the
        # first step, which fails under torch's schedules (measured, torch 2.13, GPipe on a
        # 2x2 mesh: the second step's forward raises "rebuilt parameter indices size is not
        # same as original model parameters size ... 8 versus 16"; 1F1B survives it).
        return DistributedDataParallel(
            stage, process_group=dp_mesh.get_group(), find_unused_parameters=True
        )
    assert callable(job.data_parallel)
    return job.data_parallel(stage, dp_mesh)


def _values(
    mods: Sequence[nn.Module],
    own: Sequence[int],
    names: Sequence[dict[str, str]],
    pick: Callable[[nn.Parameter], Tensor | None],
) -> dict[tuple[int, str], Tensor | None]:
    """Every stage's copy of its parameters (or their gradients) under the full names."""
    return {
        (s, name_of[local]): full_value(pick(p))
        for m, s, name_of in zip(mods, own, names, strict=True)
        for local, p in plain_named(m)
    }


def check_pipeline(
    make_model: Callable[[], nn.Module],
    split: Split,
    batch: Sequence[Tensor],
    loss_fn: LossFn,
    *,
    schedule: str | type | PipelineProgram | functools.partial[Any] = "1F1B",
    world_size: int = 2,
    stages_per_rank: int | None = None,
    n_microbatches: int = 4,
    mesh_shape: Sequence[int] | None = None,
    mesh_dim_names: Sequence[str] | None = None,
    data_parallel: DataParallel = None,
    finalize_grads: FinalizeGrads | None = None,
    schedule_kwargs: Mapping[str, Any] | None = None,
    layout: Layout | None = None,
    steps: int = 1,
    optimizer: MakeOptimizer = default_optimizer,
    rtol: float | None = None,
    atol: float | None = None,
    timeout: float = 120.0,
    raise_on_mismatch: bool = False,
    simulate: bool = False,
) -> PipelineReport:
    """Run ``steps`` training steps of ``make_model()`` split into pipeline stages on
    ``world_size`` local ranks, and of the whole model in this process on the whole
    ``batch``; compare every parameter's gradient and update, on every stage that holds it,
    and diagnose each (docs/checker.md, "Pipelines").

    ``split(model, n_stages)`` returns the ``n_stages`` stage modules, in order, holding the
    model's own parameters (its submodules, or modules around them); a stage's output is the
    next stage's input. ``batch`` is ``(*inputs, target)``: the inputs go to stage 0, the
    target to the loss after the last stage, both split along dim 0 over data parallel and
    then into ``n_microbatches``. ``loss_fn(output, target)`` is one microbatch's loss; the
    single-process truth is the mean over microbatches of it (torch's default
    ``scale_grads=True``), the model run on the whole batch at once.

    ``schedule``: a torch schedule by name (``"GPipe"``, ``"1F1B"``, ``"Interleaved1F1B"``,
    ``"LoopedBFS"``, ``"InterleavedZeroBubble"``, ``"ZBVZeroBubble"``, ``"DualPipeV"``), a
    schedule class (or a ``functools.partial`` of one binding keywords; ``schedule_kwargs``
    are passed to its constructor too, and may replace ``loss_fn`` or set
    ``scale_grads``), or a :class:`PipelineProgram`. ``stages_per_rank`` defaults to 1 for
    single-stage schedules and programs, 2 for multi-stage ones; stage ``s`` is on pipeline
    rank ``s % pp`` (loop layout), or down and back up the ranks in the V layout of
    ZBVZeroBubble and DualPipeV (``layout="v"`` for a program).

    ``mesh_shape`` (default ``(world_size,)``) and ``mesh_dim_names`` (default ``("pp",)``,
    ``("pp", "dp")`` for two dims) make the mesh; the pipeline runs over ``"pp"`` and the batch
    is split over the other dim, whose ranks each run the pipeline on their rows;
    ``data_parallel`` (``"fsdp2"``: ``fully_shard`` of each stage over it, ``"ddp"``, or a
    callable ``(stage_module, dp_mesh) -> module``) averages the gradients over it.
    ``finalize_grads(stage_modules, stage_indices, mesh)`` runs on every rank after the
    backward and before the optimizer step (sum a tied parameter's gradient there).
    ``optimizer`` makes the optimizer from a rank's parameters (default SGD, lr 0.1). The
    functions must pickle (module level).

    ``simulate=True`` is refused: a pipeline's ranks run different stages' code and exchange
    activations point to point, which torch's LocalTensorMode cannot run in one program.

    Tolerances default to ``rtol=1e-7, atol=1e-10`` for a float64 model, ``1e-4, 1e-6``
    otherwise. Raises :class:`CheckArgumentError` before any process starts for arguments it
    cannot use, :class:`~distgrad.errors.RankFailedError` when a rank fails, and
    :class:`~distgrad.errors.GradientMismatchError` with ``raise_on_mismatch`` on a mismatch.

    Args:
        make_model: a picklable zero-argument factory of the whole model.
        split: ``split(model, n_stages)`` returns the stage modules, in order, holding the
            model's own parameters.
        batch: ``(*inputs, target)``, the global batch (dim 0 the rows).
        loss_fn: ``loss_fn(output, target)``, one microbatch's loss.
        schedule: a torch schedule's name or class (or a ``functools.partial`` of one binding
            keywords), or a :class:`PipelineProgram` (default ``"1F1B"``).
        world_size: the ranks started.
        stages_per_rank: the stages each pipeline rank holds (default: 1 for single-stage
            schedules and programs, 2 for multi-stage schedules).
        n_microbatches: the microbatches each pipeline replica splits its rows into.
        mesh_shape: the mesh's shape, ``(pp,)`` or ``(pp, dp)`` (default ``(world_size,)``).
        mesh_dim_names: the mesh's dimension names, one of them ``"pp"`` (default ``("pp",)``,
            ``("pp", "dp")`` for two dims).
        data_parallel: over the mesh's data dim: ``"fsdp2"``, ``"ddp"``, a callable
            ``(stage_module, dp_mesh) -> module``, or None (each replica keeps its own
            gradients).
        finalize_grads: ``finalize_grads(stage_modules, stage_indices, mesh)``, run on every
            rank after the backward and before the optimizer step (None: nothing runs).
        schedule_kwargs: more keywords for the schedule's constructor (``scale_grads``, or a
            ``loss_fn`` of its own).
        layout: a program's stage layout, ``"loop"`` or ``"v"`` (torch's schedules imply
            theirs).
        steps: the training steps compared.
        optimizer: makes the optimizer from a rank's parameters (default SGD, lr 0.1).
        rtol: the relative tolerance (default: by dtype, above).
        atol: the absolute tolerance (default: by dtype, above).
        timeout: seconds the ranks may take.
        raise_on_mismatch: raise ``GradientMismatchError`` instead of returning a mismatch.
        simulate: refused when True (above); pipelines run on processes.

    Returns:
        A :class:`PipelineReport`: every stage's copy of every parameter's gradient and update
        against one process, each with its diagnosis.

    Raises:
        CheckArgumentError: arguments it cannot use (a schedule that cannot take the layout, a
            batch that does not divide into the microbatches, a split that does not return the
            model's own parameters in ``n_stages`` modules, ``simulate=True``); before any
            process starts.
        RankFailedError: a rank failed or timed out.
        GradientMismatchError: with ``raise_on_mismatch=True``, a mismatch.

    Example:
        >>> import copy, functools, itertools
        >>> model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Linear(4, 1)).double()
        >>> g = torch.Generator().manual_seed(0)
        >>> x = torch.randn(8, 3, dtype=torch.float64, generator=g)
        >>> y = torch.randn(8, 1, dtype=torch.float64, generator=g)
        >>> report = dg.testing.check_pipeline(
        ...     functools.partial(copy.deepcopy, model),  # make_model: a fresh copy each call
        ...     itertools.islice,  # split(model, 2): its two layers, a stage each
        ...     (x, y),
        ...     torch.nn.functional.mse_loss,
        ...     schedule="GPipe",
        ...     n_microbatches=2,
        ... )
        >>> report.ok, report.schedule, report.stage_ranks
        (True, 'ScheduleGPipe', {0: 0, 1: 1})
    """
    if simulate:
        raise CheckArgumentError(
            "check_pipeline: simulate=True cannot run a pipeline: each rank runs its own "
            "stages' code (a different Python path per rank, which the one-program "
            "simulation refuses) and the stages exchange activations and gradients with "
            "point-to-point isend/irecv, which torch's LocalTensorMode runs only under "
            "LocalRunnerMode, a thread per rank; drop simulate=True to check it on processes"
        )
    shape, names = _mesh_arguments(world_size, mesh_shape, mesh_dim_names)
    if data_parallel is not None and len(shape) < 2:
        raise CheckArgumentError(
            f"check_pipeline: data_parallel={data_parallel!r} needs a mesh with a data dim "
            f"beside 'pp' (mesh_shape=(pp, dp)), got mesh_shape {shape}"
        )
    if isinstance(data_parallel, str) and data_parallel not in ("fsdp2", "ddp"):
        raise CheckArgumentError(
            f"check_pipeline: data_parallel must be 'fsdp2', 'ddp', a callable or None, got "
            f"{data_parallel!r}"
        )
    if steps < 1:
        raise CheckArgumentError(f"check_pipeline: steps must be at least 1, got {steps}")
    if n_microbatches < 1:
        raise CheckArgumentError(
            f"check_pipeline: n_microbatches must be at least 1, got {n_microbatches}"
        )
    pp = shape[names.index("pp")]
    resolved = plan(schedule, schedule_kwargs or {}, pp, stages_per_rank, n_microbatches, layout)
    tensors = tuple(batch)
    if len(tensors) < 2 or not all(isinstance(t, Tensor) and t.dim() > 0 for t in tensors):
        raise CheckArgumentError(
            "check_pipeline: batch must be (*inputs, target), at least two tensors with a "
            f"batch dim, got {[type(t).__name__ for t in tensors]}"
        )
    dp = math.prod(shape) // pp
    _check_rows(tensors, dp, n_microbatches, resolved)

    model = make_model()
    job = _Job(
        make_model, split, loss_fn, state_of(model), tensors[:-1], tensors[-1], resolved,
        shape, names, data_parallel, finalize_grads, n_microbatches, steps, optimizer,
    )  # fmt: skip
    probe = made(make_model, job.state)  # split's result checked before any process starts
    for index, stage in enumerate(_split(job, probe, None)):
        _full_names(probe, stage, index, None)
    ref_losses, ref = _reference(job, model, dp)
    tol = Tolerance.default(list(model.parameters()), rtol, atol)
    results: list[_RankRun] = run_on_ranks(_on_rank, world_size, args=(job,), timeout=timeout)
    report = PipelineReport(
        shape,
        names,
        ref_losses,
        [_replica_losses(results, step, job) for step in range(steps)],
        schedule=resolved.name,
        n_microbatches=n_microbatches,
        stage_ranks=resolved.ranks,
    )
    _Reader(job, ref, results, tol).fill(report)
    if raise_on_mismatch:
        report.raise_if_mismatch()
    return report


def _mesh_arguments(
    world_size: int, mesh_shape: Sequence[int] | None, mesh_dim_names: Sequence[str] | None
) -> tuple[tuple[int, ...], tuple[str, ...]]:
    shape = tuple(mesh_shape) if mesh_shape is not None else (world_size,)
    if math.prod(shape) != world_size or min(shape, default=0) < 1:
        raise CheckArgumentError(
            f"check_pipeline: mesh_shape {shape} must multiply to world_size {world_size}"
        )
    if len(shape) > 2:
        raise CheckArgumentError(
            f"check_pipeline: the mesh has a 'pp' dim and at most one data dim, got "
            f"mesh_shape {shape}"
        )
    default = ("pp",) if len(shape) == 1 else ("pp", "dp")
    names = tuple(mesh_dim_names) if mesh_dim_names is not None else default
    if len(names) != len(shape) or len(set(names)) != len(names) or "pp" not in names:
        raise CheckArgumentError(
            f"check_pipeline: mesh_dim_names must name each of the {len(shape)} mesh dims "
            f"once, one of them 'pp' (the pipeline's), got {list(names)}"
        )
    return shape, names


def _check_rows(tensors: Sequence[Tensor], dp: int, n: int, resolved: Plan) -> None:
    rows = {t.shape[0] for t in tensors}
    if len(rows) != 1:
        raise CheckArgumentError(
            f"check_pipeline: every tensor of batch must have the same rows, got {sorted(rows)}"
        )
    (count,) = rows
    if resolved.program is None and count % (dp * n):
        raise CheckArgumentError(
            f"check_pipeline: {resolved.name} sends every microbatch in the shape of the "
            f"first, so the batch's {count} rows must divide evenly into {dp} data-parallel "
            f"part(s) x {n} microbatches"
        )
    if count < dp * n:
        raise CheckArgumentError(
            f"check_pipeline: the batch's {count} rows cannot make {dp} data-parallel "
            f"part(s) x {n} microbatches"
        )


def _chunks(t: Tensor, dp: int, n: int) -> list[Tensor]:
    """The rows of each microbatch, replica by replica, as the ranks split them."""
    return [mb for part in t.tensor_split(dp) for mb in part.tensor_split(n)]


def _reference(job: _Job, model: nn.Module, dp: int) -> tuple[list[float], list[_Record]]:
    """The whole model on the whole batch: ``steps`` steps, the loss the mean of the
    microbatches' losses; records under ``(-1, name)``."""
    opt = job.optimizer(model.parameters())
    losses: list[float] = []
    records: list[_Record] = []
    for _ in range(job.steps):
        opt.zero_grad(set_to_none=True)
        before = {n: p.detach().clone() for n, p in model.named_parameters()}
        out = model(*job.inputs)
        parts = zip(
            _chunks(out, dp, job.n_microbatches),
            _chunks(job.target, dp, job.n_microbatches),
            strict=True,
        )
        loss = torch.stack([job.loss_fn(o, t) for o, t in parts]).mean()
        torch.autograd.backward(loss)
        grads = {n: full_value(p.grad) for n, p in model.named_parameters()}
        opt.step()
        losses.append(float(loss.detach()))
        records.append(
            {
                (-1, n): (grads[n], p.detach().clone(), before[n])
                for n, p in model.named_parameters()
            }
        )
    return losses, records


def _replica_losses(results: Sequence[_RankRun], step: int, job: _Job) -> list[float]:
    """Each data-parallel replica's loss at ``step`` (the mean of its microbatches'), from
    the rank holding its last stage; NaN when the program reported none."""
    out = []
    for losses, _, _ in results:
        mine = losses[step]
        if mine is not None:
            out.append(sum(mine) / len(mine) if mine else math.nan)
    return out


class _Reader:
    """Reads every parameter of every step against the reference."""

    def __init__(self, job: _Job, ref: list[_Record], results: list[_RankRun], tol: Tolerance):
        self.job, self.ref, self.results, self.tol = job, ref, results, tol
        self.holders: dict[str, list[int]] = {}
        for _, records, _ in results:
            for s, name in records[0]:
                self.holders.setdefault(name, [])
                if s not in self.holders[name]:
                    self.holders[name].append(s)
        for stages in self.holders.values():
            stages.sort()
        self.scaled = job.plan.schedule is not None and job.plan.kwargs.get("scale_grads", True)
        dp = job.dp_dim()
        self.dp = (job.mesh_dim_names[dp], job.mesh_shape[dp]) if dp is not None else None
        n, n_stages = job.n_microbatches, job.plan.n_stages
        self.sizes = {"the number of microbatches": n}
        if n_stages == n:
            self.sizes = {"the number of microbatches, which is also the number of stages": n}
        else:
            self.sizes["the number of stages"] = n_stages
        if self.dp is not None:
            self.sizes[f"the size of mesh dim {self.dp[0]!r}"] = self.dp[1]

    def fill(self, report: PipelineReport) -> None:
        names = [name for _, name in self.ref[0]]
        unknown = sorted(set(names) - set(self.holders))
        if unknown:
            raise CheckArgumentError(
                f"check_pipeline: parameters {unknown} are in no stage: split must give every "
                "parameter of the model to a stage"
            )
        for step in range(self.job.steps):
            missing = self._missing_stages(step)
            for name in names:
                report.checks += self._checks(step, name, missing)

    def _copies(self, step: int, name: str, index: int) -> dict[tuple[int, ...], Tensor | None]:
        """Every stage copy of ``name``'s record ``index``, keyed by place: (its slot among
        the stages holding it, its data-parallel coordinate)."""
        slots = self.holders[name]
        out: dict[tuple[int, ...], Tensor | None] = {}
        dp = self.job.dp_dim()
        for _, records, coords in self.results:
            for (s, n), record in records[step].items():
                if n == name:
                    place = (slots.index(s),) + ((coords[dp],) if dp is not None else ())
                    out[place] = record[index]
        return out

    def _missing_stages(self, step: int) -> set[int]:
        """The stages none of whose parameters received a gradient (where the reference's
        is not zero)."""
        seen: dict[int, bool] = {}
        for _, records, _ in self.results:
            for (s, name), (grad, _, _) in records[step].items():
                want = self.ref[step][(-1, name)][0]
                if want is None or not bool((want != 0).any()):
                    continue
                none = grad is None or not bool((grad != 0).any())
                seen[s] = seen.get(s, True) and none
        return {s for s, none in seen.items() if none}

    def _where(self, stage: int) -> str:
        rank = self.job.plan.ranks[stage]
        who = "rank" if self.dp is None else "pipeline rank"
        return f"stage {stage} ({who} {rank})"

    def _missing_words(self, name: str, stages: set[int], missing: set[int]) -> str:
        places = ", ".join(self._where(s) for s in sorted(stages))
        head = f"missing: no gradient reached it on {places}"
        s = min(stages)
        later = [t for t in range(s + 1, self.job.plan.n_stages) if t not in missing]
        if s not in missing:
            return head + (
                ": it is off the path to the loss inside its stage (a .detach() or a "
                "no_grad inside the stage module)"
            )
        if not later:
            return head + ": no stage after it receives a gradient either (the loss does not "
            "reach the model's output, or the backward never runs)"
        b = later[0]
        if all(t in missing for t in range(b)):
            if b == 1:
                return head + (
                    ": stage 0 receives no gradient while stage 1 does: the activation stage 0 "
                    "sends stage 1 is detached (at stage 0's output or stage 1's input), or "
                    "stage 0's weight-gradient step never runs"
                )
            text = (
                f": stages 0-{b - 1} receive no gradient while stage {b} does: the gradient "
                f"stops at a detached activation at the boundary into stage {b}"
            )
            if self.job.plan.splits_backward is not False:
                text += (
                    f", or into stage {b - 1} (where the backward is split, as in the "
                    "zero-bubble schedules, a stage's weight step follows from its input-"
                    "gradient step, which a detached input ends, so that stage loses its "
                    "weight gradient too)"
                )
            return head + text
        return head + (
            f": stage {s}'s weight-gradient step never runs (stages before it receive their "
            "gradients, so no boundary is cut)"
        )

    def _checks(self, step: int, name: str, missing: set[int]) -> list[ParameterCheck]:
        ref = self.ref[step][(-1, name)]
        slots = self.holders[name]
        checks = []
        for what, index in (("grad", 0), ("update", 1)):
            copies = self._copies(step, name, index)
            want = ref[index]
            if what == "update":
                starts = self._copies(step, name, 2)
                assert ref[2] is not None and want is not None
                want = want - ref[2]
                copies = {
                    k: None if v is None or starts[k] is None else v - starts[k]  # type: ignore[operator]
                    for k, v in copies.items()
                }
            checks.append(self._check(step, name, what, want, copies, slots, missing))
        return checks

    def _check(
        self,
        step: int,
        name: str,
        what: str,
        want: Tensor | None,
        copies: Mapping[tuple[int, ...], Tensor | None],
        slots: list[int],
        missing: set[int],
    ) -> ParameterCheck:
        held = tuple(slots)
        if want is None:
            ok = all(v is None for v in copies.values())
            text = "agree" if ok else "a gradient in the pipeline where one process has none"
            return ParameterCheck(step, name, what, ok, 0.0, text, held)
        rows = [compare(name, place, got, want, self.tol) for place, got in copies.items()]
        err = max((r.max_abs_error for r in rows), default=0.0)
        if all(r.ok for r in rows):
            return ParameterCheck(step, name, what, True, err, "agree", held)
        empty = {
            slots[place[0]]
            for place, got in copies.items()
            if got is None or not bool((got != 0).any())
        }
        if empty and bool((want != 0).any()) and len(empty) == len(slots):
            return ParameterCheck(
                step, name, what, False, err, self._missing_words(name, empty, missing), held
            )
        dims = [("stages", len(slots))] + ([self.dp] if self.dp is not None else [])
        finding = diagnose(rows, self.tol, sizes=self.sizes, replica_dims=dims)
        text = pipeline_words(finding, rows, self.tol, [self._where(s) for s in slots])
        ranks = {self.job.plan.ranks[s] for s in slots}
        if text.startswith("wrong") and len(slots) > 1 and len(ranks) == 1 and self.scaled:
            # Measured (ZBVZeroBubble, a tied embedding on stages 0 and 3 of rank 0): wrong by
            # 0.4034; with scale_grads=False and the loss divided by n_microbatches, it agrees.
            text += (
                f"; {_listing([f'stage {s}' for s in slots])} share this one parameter on "
                f"rank {ranks.pop()}, and torch's schedule divides each stage's gradients by "
                "the number of microbatches on its own (scale_grads), so the shared gradient "
                "is divided more than once, part way through its accumulation (pass "
                "scale_grads=False and a loss divided by n_microbatches instead)"
            )
        return ParameterCheck(step, name, what, False, err, text, held)
