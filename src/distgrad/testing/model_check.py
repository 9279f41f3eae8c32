"""Check a parallelized model's training steps against the plain model in one process.

``check_parallel_model(make_model, parallelize, batch, loss_fn, world_size, mesh_shape=...)``

1. in this process: ``model = make_model()``, then ``steps`` training steps on the whole
   ``batch`` (``loss_fn(model, *batch)``, ``backward``, ``optimizer.step()``), recording every
   parameter's gradient and updated value after each step;
2. on ``world_size`` local processes (:func:`~distgrad.testing.run_on_ranks`): a DeviceMesh of
   ``mesh_shape`` (``init_device_mesh("cpu", ...)``), the same initial parameters,
   ``parallelize(model, mesh)``, and the same steps, each rank on its rows of the batch (split
   over the mesh dims named in ``data``, whole along the others);
3. reassembles every parameter and gradient into full tensors: a DTensor (tensor parallel,
   FSDP2's shards) by ``full_tensor()``; a plain tensor smaller than the reference (a
   dg.parallel shard) by concatenating the ranks' pieces along the one dim that differs, over
   the mesh dim whose ranks hold the pieces; a plain tensor of the reference's shape is a
   replica, one per rank;
4. diagnoses every parameter's gradient and update at every step with the engine both
   checkers share (``_diagnose``; its rows here: the replicas of the reassembled tensor).

The diagnoses, per parameter, for its gradient and for its update:

* ``agree``;
* ``missing a reduction over mesh dim 'tp'``: the ranks along that dim hold different
  gradients whose sum is the reference (each holds only its part: a sequence-parallel
  LayerNorm's weight, never all-reduced over TP); ``missing an average`` likewise;
* ``scaled by 1/2 (the size of mesh dim 'dp')`` or ``by 2 (...)``: a loss averaged twice, a
  gradient reduced twice, a bias added on every TP rank;
* ``no gradient on some ranks or in one process``; ``non-finite values``;
* ``wrong``: no reduction or factor explains it (a local-only GatherLayer drops the terms
  that flow through other ranks' rows); the best least-squares scale is shown.
"""

from __future__ import annotations

import functools
import inspect
import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

from distgrad.errors import CheckArgumentError
from distgrad.testing import _simulate
from distgrad.testing._diagnose import Row, Tolerance, compare, diagnose
from distgrad.testing._ranks import copy_on, full_value, made, plain_named, run_job, state_of
from distgrad.testing._report import ModelReport, ParameterCheck, parameter_words

__all__ = ["ModelReport", "ParameterCheck", "check_parallel_model"]

Batch = Mapping[str, Tensor] | Sequence[Tensor]
MakeOptimizer = Callable[[Iterable[nn.Parameter]], torch.optim.Optimizer]

default_optimizer: MakeOptimizer = functools.partial(torch.optim.SGD, lr=0.1)

# What one step records per parameter: (gradient, value after the step, value before it).
_Record = dict[str, tuple[Tensor | None, Tensor | None, Tensor | None]]
# What a rank reports: its loss at each step, each step's record, its mesh coordinates.
_RankRun = tuple[list[float], list[_Record], tuple[int, ...]]


@dataclass(frozen=True)
class _Job:
    """Everything a rank needs, pickled to it; and the training steps every run makes."""

    make_model: Callable[[], nn.Module]
    parallelize: Callable[[nn.Module, Any], nn.Module]
    loss_fn: Callable[..., Tensor]
    state: dict[str, Tensor]
    batch: tuple[Tensor, ...]
    names: tuple[str, ...] | None
    mesh_shape: tuple[int, ...]
    mesh_dim_names: tuple[str, ...]
    data: tuple[str, ...]
    steps: int
    optimizer: MakeOptimizer
    takes_mesh: bool

    def on_rank(self, rank: int, world_size: int) -> _RankRun:
        mesh = self._mesh()
        coords = tuple(mesh.get_coordinate() or ())
        model = self.parallelize(made(self.make_model, self.state), mesh)
        index, parts = self._rows_of(coords)
        local = tuple(t.tensor_split(parts)[index] if t.dim() else t for t in self.batch)
        losses, records = self.train(model, local, mesh)
        return [float(x) for x in losses], records, coords

    def every_rank(self, world_size: int) -> list[_RankRun]:
        """Every rank's ``on_rank``, simulated in this process (``_simulate``): one program on
        tensors holding each rank's value; each rank's rows and coordinates from its index in
        the mesh, as ``init_device_mesh`` lays the ranks out (row-major)."""
        mesh = self._mesh()
        coords = [_coordinates(r, self.mesh_shape) for r in range(world_size)]
        model = made(self.make_model, self.state)
        try:
            model = self.parallelize(model, mesh)
        except Exception as exc:  # measured: DDP's constructor fails on LocalTensor parameters
            raise _simulate._Refused(
                f"parallelize failed under LocalTensorMode ({type(exc).__name__}: {exc})"
            ) from exc
        _refuse_wrappers(model)
        rows = [self._rows_of(c) for c in coords]
        local = tuple(
            _simulate.stacked([t.tensor_split(parts)[index] for index, parts in rows])
            if t.dim()
            else t
            for t in self.batch
        )
        losses, records = self.train(model, local, mesh)

        def mine(record: _Record, rank: int) -> _Record:
            return {
                n: (copy_on(g, rank), copy_on(a, rank), copy_on(b, rank))
                for n, (g, a, b) in record.items()
            }

        return [
            (
                [float(_simulate.local(x, r)) for x in losses],
                [mine(record, r) for record in records],
                coords[r],
            )
            for r in range(world_size)
        ]

    def train(
        self, model: nn.Module, tensors: Sequence[Tensor], mesh: Any
    ) -> tuple[list[Tensor], list[_Record]]:
        """``steps`` optimizer steps on ``tensors``: each step's loss and record. ``mesh`` is
        None in the single process."""
        opt = self.optimizer(model.parameters())
        extra = {"mesh": mesh} if self.takes_mesh else {}
        losses, records = [], []
        for _ in range(self.steps):
            opt.zero_grad(set_to_none=True)
            before = {n: full_value(p) for n, p in plain_named(model)}
            if self.names is not None:
                loss = self.loss_fn(model, **dict(zip(self.names, tensors, strict=True)), **extra)
            else:
                loss = self.loss_fn(model, *tensors, **extra)
            torch.autograd.backward(loss)
            grads = {n: full_value(p.grad) for n, p in plain_named(model)}
            opt.step()
            after = {n: full_value(p) for n, p in plain_named(model)}
            losses.append(full_value(loss.detach()))
            records.append({n: (grads[n], after[n], before[n]) for n in after})
        return [x for x in losses if x is not None], records

    def _mesh(self) -> Any:
        from torch.distributed.device_mesh import init_device_mesh

        return init_device_mesh("cpu", self.mesh_shape, mesh_dim_names=self.mesh_dim_names)

    def _rows_of(self, coords: tuple[int, ...]) -> tuple[int, int]:
        """Which part of the batch a rank at ``coords`` gets, and into how many it is split:
        split over the data dims, in the order the mesh lists them."""
        index, parts = 0, 1
        for dim, name in enumerate(self.mesh_dim_names):
            if name in self.data:
                index = index * self.mesh_shape[dim] + coords[dim]
                parts *= self.mesh_shape[dim]
        return index, parts


def check_parallel_model(
    make_model: Callable[[], nn.Module],
    parallelize: Callable[[nn.Module, Any], nn.Module],
    batch: Batch,
    loss_fn: Callable[..., Tensor],
    world_size: int,
    *,
    mesh_shape: Sequence[int] | None = None,
    mesh_dim_names: Sequence[str] | None = None,
    data: Sequence[str] = (),
    steps: int = 1,
    optimizer: MakeOptimizer = default_optimizer,
    rtol: float | None = None,
    atol: float | None = None,
    timeout: float = 120.0,
    raise_on_mismatch: bool = False,
    simulate: bool = False,
) -> ModelReport:
    """Run ``steps`` training steps of ``make_model()`` in this process on the whole ``batch``
    and of ``parallelize(model, mesh)`` on ``world_size`` local ranks; compare every
    parameter's gradient and updated value, reassembled to full tensors, and diagnose each.

    ``mesh_shape`` (default ``(world_size,)``) and ``mesh_dim_names`` (default ``dp``, ``tp``
    for two dims, ``d0``, ``d1``, ... otherwise) make the mesh, as ``init_device_mesh("cpu",
    mesh_shape, mesh_dim_names=...)``. ``batch``: the global batch, a tuple of tensors (or a
    dict, passed by name), split along dim 0 over the mesh dims named in ``data`` (every rank
    the whole batch when empty). ``loss_fn(model, *batch)`` returns the loss; with a
    parameter named ``mesh`` it also gets the mesh (None in the single process). Training
    matches single-process training when each data-parallel rank returns the mean over its
    own rows and the gradients are averaged over ``data`` (FSDP2, DDP). ``parallelize`` must
    keep the parameters' names (replace a submodule by one with the same parameter names).
    ``optimizer`` makes the optimizer from the parameters (default SGD, lr 0.1). The
    functions must pickle (module level).

    ``simulate=True`` runs every rank in this process instead of starting processes (torch's
    ``LocalTensorMode``; docs/checker.md says what simulates), with the same report, or
    :class:`CheckArgumentError` when the code cannot be simulated truthfully.

    Tolerances default to ``rtol=1e-7, atol=1e-10`` for a float64 model, ``1e-4, 1e-6``
    otherwise. Raises :class:`CheckArgumentError` before any process starts for arguments it
    cannot use, :class:`~distgrad.errors.RankFailedError` when a rank fails, and
    :class:`GradientMismatchError` with ``raise_on_mismatch`` on a mismatch.

    Args:
        make_model: a picklable zero-argument factory of the plain model.
        parallelize: ``parallelize(model, mesh)`` returns the model to run on the ranks.
        batch: the global batch: a tuple of tensors, or a dict passed by name.
        loss_fn: ``loss_fn(model, *batch)`` returns the loss.
        world_size: the ranks.
        mesh_shape: the mesh's shape (default ``(world_size,)``).
        mesh_dim_names: the mesh's dimension names.
        data: the mesh dims the batch is split over (empty: every rank the whole batch).
        steps: the training steps compared.
        optimizer: makes the optimizer from the parameters (default SGD, lr 0.1).
        rtol: the relative tolerance (default: by dtype, above).
        atol: the absolute tolerance (default: by dtype, above).
        timeout: seconds the ranks may take.
        raise_on_mismatch: raise ``GradientMismatchError`` instead of returning a mismatch.
        simulate: run every rank in this process instead of starting processes.

    Returns:
        A ``ModelReport``: every parameter's gradient and update against one process.

    Raises:
        CheckArgumentError: arguments it cannot use, or (``simulate=True``) code that cannot be
            simulated truthfully; before any process starts.
        RankFailedError: a rank failed or timed out.
        GradientMismatchError: with ``raise_on_mismatch=True``, a mismatch.

    Example:
        >>> g = torch.Generator().manual_seed(0)
        >>> batch = (torch.randn(4, 2, dtype=torch.float64, generator=g),)
        >>> report = dg.testing.check_parallel_model(
        ...     lambda: torch.nn.Linear(2, 1).double(),  # the model
        ...     lambda model, mesh: model,  # parallelized: unchanged, every rank the whole batch
        ...     batch,
        ...     lambda model, x: model(x).pow(2).mean(),  # the loss
        ...     2,
        ...     simulate=True,
        ... )
        >>> report.ok
        True
    """
    shape = tuple(mesh_shape) if mesh_shape is not None else (world_size,)
    if math.prod(shape) != world_size or min(shape, default=0) < 1:
        raise CheckArgumentError(
            f"check_parallel_model: mesh_shape {shape} must multiply to world_size {world_size}"
        )
    names = tuple(mesh_dim_names) if mesh_dim_names is not None else _default_names(len(shape))
    if len(names) != len(shape) or len(set(names)) != len(names):
        raise CheckArgumentError(
            f"check_parallel_model: mesh_dim_names must name each of the {len(shape)} mesh "
            f"dims once, got {list(names)}"
        )
    unknown = [d for d in data if d not in names]
    if unknown:
        raise CheckArgumentError(
            f"check_parallel_model: data names mesh dims {unknown} that the mesh "
            f"{dict(zip(names, shape, strict=True))} does not have"
        )
    if steps < 1:
        raise CheckArgumentError(f"check_parallel_model: steps must be at least 1, got {steps}")
    keys = tuple(batch) if isinstance(batch, Mapping) else None
    tensors = tuple(batch.values()) if isinstance(batch, Mapping) else tuple(batch)
    takes_mesh = "mesh" in inspect.signature(loss_fn).parameters

    model = make_model()
    job = _Job(
        make_model, parallelize, loss_fn, state_of(model), tensors, keys, shape, names,
        tuple(data), steps, optimizer, takes_mesh,
    )  # fmt: skip
    losses, ref = job.train(model, tensors, None)
    tol = Tolerance.default(list(model.parameters()), rtol, atol)
    results = run_job(
        job, world_size, simulate=simulate, timeout=timeout, who="check_parallel_model"
    )
    report = ModelReport(
        shape,
        names,
        [float(x) for x in losses],
        [list(x) for x in zip(*(r[0] for r in results), strict=True)],
    )
    missing = sorted(set(ref[0]) ^ set(results[0][1][0]))
    if missing:
        raise CheckArgumentError(
            f"check_parallel_model: parameters {missing} are not in both the plain and the "
            "parallelized model: parallelize must keep every parameter's name"
        )
    sizes = {names[m]: shape[m] for m in range(len(shape)) if shape[m] > 1}
    if len(sizes) > 1:  # a factor may be the product of the mesh dims' sizes
        sizes[" and ".join(sizes)] = math.prod(sizes.values())
    for step in range(steps):
        for name, record in ref[step].items():
            report.checks += _parameter_checks(step, name, record, results, job, sizes, tol)
    if raise_on_mismatch:
        report.raise_if_mismatch()
    return report


def _parameter_checks(
    step: int,
    name: str,
    record: tuple[Tensor | None, Tensor | None, Tensor | None],
    results: Sequence[_RankRun],
    job: _Job,
    sizes: dict[str, int],
    tol: Tolerance,
) -> list[ParameterCheck]:
    """One parameter's gradient and update at ``step``, reassembled from every rank's piece
    and diagnosed (its rows: the replicas)."""
    shape, names = job.mesh_shape, job.mesh_dim_names
    coords = [r[2] for r in results]
    probe = [p for r in results if (p := r[1][0][name][2]) is not None]  # initial values

    def assembled(index: int) -> tuple[dict[tuple[int, ...], Tensor], tuple[int, ...]] | None:
        """Every rank's piece of the record's ``index`` reassembled; None if one is missing."""
        pieces = [r[1][step][name][index] for r in results]
        whole = [p for p in pieces if p is not None]
        want = record[index]
        if want is None or len(whole) < len(pieces):
            return None
        return _assemble(name, whole, coords, shape, names, want.shape, probe)

    def read(
        got: Mapping[tuple[int, ...], Tensor], want: Tensor, dims: tuple[int, ...]
    ) -> tuple[list[Row], str]:
        rows = [compare(name, key, v, want, tol) for key, v in got.items()]
        along = [(names[m], shape[m]) for m in dims]
        finding = diagnose(rows, tol, sizes=sizes, replica_dims=along)
        return rows, parameter_words(finding, rows, tol)

    checks = []
    for what, index in (("grad", 0), ("update", 1)):
        want, found = record[index], assembled(index)
        if want is None or found is None:
            ok = want is None and all(r[1][step][name][index] is None for r in results)
            text = "agree" if ok else "no gradient on some ranks or in one process"
            checks.append(ParameterCheck(step, name, what, ok, 0.0, text))
            continue
        replicas, dims = found
        rows, text = read(replicas, want, dims)
        if what == "update":  # compare what the step changed, not the values
            start, before = assembled(2), record[2]
            assert start is not None and before is not None
            values = text
            rows, text = read(
                {k: v - start[0][k] for k, v in replicas.items()}, want - before, dims
            )
            if text == "agree" and values != "agree":
                text = "the values differ from one process's although this step's update agrees"
        err = max((r.max_abs_error for r in rows), default=0.0)
        checks.append(ParameterCheck(step, name, what, text == "agree", err, text))
    return checks


def _default_names(ndim: int) -> tuple[str, ...]:
    return (
        ("dp", "tp") if ndim == 2 else ("dp",) if ndim == 1 else tuple(f"d{i}" for i in range(ndim))
    )


def _refuse_wrappers(model: nn.Module) -> None:
    """DDP's reducer (C++, buckets of raw storage) and FSDP2's sharded storage (resized in
    place) do not run on LocalTensors (measured: both fail inside torch)."""
    from torch.distributed.fsdp import FSDPModule
    from torch.nn.parallel import DistributedDataParallel

    for module in model.modules():
        for kind, name in ((DistributedDataParallel, "DistributedDataParallel"),
                           (FSDPModule, "FSDP2 (fully_shard)")):  # fmt: skip
            if isinstance(module, kind):
                raise _simulate._Refused(
                    f"{name} does not run under LocalTensorMode (its buffers are raw storage "
                    "outside the per-rank tensors)"
                )


def _coordinates(rank: int, shape: tuple[int, ...]) -> tuple[int, ...]:
    coords = []
    for size in reversed(shape):
        coords.append(rank % size)
        rank //= size
    return tuple(reversed(coords))


def _assemble(
    name: str,
    pieces: Sequence[Tensor],
    coords: Sequence[tuple[int, ...]],
    shape: tuple[int, ...],
    names: tuple[str, ...],
    want: torch.Size,
    probe: Sequence[Tensor],
) -> tuple[dict[tuple[int, ...], Tensor], tuple[int, ...]]:
    """Full tensors from every rank's piece, keyed by the coordinates along the mesh dims over
    which they are replicas; and those dims. ``probe``: every rank's piece of the parameter's
    initial value, which decides the layout: a piece is a slice over the mesh dim whose ranks
    hold different pieces (a dim whose ranks hold equal ones replicates it, as FSDP2's
    gathered shards do over data parallel)."""
    every = tuple(range(len(shape)))
    if all(p.shape == want for p in pieces):
        return {c: p for c, p in zip(coords, pieces, strict=True)}, every
    differ = {
        d for p in pieces for d in range(p.dim()) if p.dim() == len(want) and p.shape[d] != want[d]
    }
    fits: list[tuple[int, bool]] = []
    if len(differ) == 1:
        (tdim,) = differ
        for m in every:
            if _joined(pieces, coords, m, tdim, want) is not None:
                groups: dict[tuple[int, ...], list[Tensor]] = {}
                for c, p in zip(coords, probe, strict=True):
                    groups.setdefault(c[:m] + c[m + 1 :], []).append(p)
                distinct = all(
                    any(q.shape != g[0].shape or not torch.equal(q, g[0]) for q in g[1:])
                    for g in groups.values()
                )
                fits.append((m, distinct))
    if fits:
        m = next((m for m, distinct in fits if distinct), fits[0][0])
        whole = _joined(pieces, coords, m, tdim, want)
        assert whole is not None
        return whole, every[:m] + every[m + 1 :]
    shapes = sorted({tuple(p.shape) for p in pieces})
    mesh = dict(zip(names, shape, strict=True))
    raise CheckArgumentError(
        f"check_parallel_model: cannot reassemble {name} of shape {tuple(want)} from the ranks' "
        f"pieces of shapes {shapes} on the mesh {mesh}: a plain tensor piece "
        "must be the whole tensor or its slice along one dim over one mesh dim (use DTensor "
        "for other layouts)"
    )


def _joined(
    pieces: Sequence[Tensor],
    coords: Sequence[tuple[int, ...]],
    m: int,
    tdim: int,
    want: torch.Size,
) -> dict[tuple[int, ...], Tensor] | None:
    """The pieces concatenated along ``tdim`` over mesh dim ``m``, if that gives ``want``."""
    groups: dict[tuple[int, ...], list[tuple[int, Tensor]]] = {}
    for c, p in zip(coords, pieces, strict=True):
        groups.setdefault(c[:m] + c[m + 1 :], []).append((c[m], p))
    whole = {
        k: torch.cat([p for _, p in sorted(v, key=lambda cp: cp[0])], tdim)
        for k, v in groups.items()
    }
    return whole if all(w.shape == want for w in whole.values()) else None
