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
4. diagnoses every parameter at the first step where it differs (:func:`diagnose`).

The diagnoses, per parameter, for its gradient and for its update:

* ``agree``;
* ``missing a reduction over mesh dim 'tp'``: the ranks along that dim hold different
  gradients whose sum is the reference (each holds only its part: a sequence-parallel
  LayerNorm's weight, never all-reduced over TP); ``missing an average`` likewise;
* ``scaled by 1/2 (the size of mesh dim 'dp')`` or ``by 2 (...)``: a loss averaged twice, a
  gradient reduced twice, a bias added on every TP rank;
* ``wrong``: no reduction or factor explains it (a local-only GatherLayer drops the terms
  that flow through other ranks' rows); the best least-squares scale is shown.
"""

from __future__ import annotations

import functools
import inspect
import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor, nn

from distgrad.errors import CheckArgumentError, GradientMismatchError
from distgrad.testing import _simulate
from distgrad.testing.launch import run_on_ranks

__all__ = ["ModelReport", "ParameterCheck", "check_parallel_model", "diagnose"]

Batch = Mapping[str, Tensor] | Sequence[Tensor]
MakeOptimizer = Callable[[Iterable[nn.Parameter]], torch.optim.Optimizer]

default_optimizer: MakeOptimizer = functools.partial(torch.optim.SGD, lr=0.1)


@dataclass(frozen=True)
class ParameterCheck:
    """One parameter's gradient (``what="grad"``) or update (``"update"``: what the optimizer
    step changed, and the value after it) at one step."""

    step: int
    name: str
    what: str
    ok: bool
    max_abs_error: float
    diagnosis: str


@dataclass
class ModelReport:
    """What :func:`check_parallel_model` found; ``ok`` when every gradient and update agrees."""

    mesh_shape: tuple[int, ...]
    mesh_dim_names: tuple[str, ...]
    reference_losses: list[float]
    rank_losses: list[list[float]]  # [step][rank]
    checks: list[ParameterCheck] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return all(c.ok for c in self.checks)

    @property
    def diagnoses(self) -> dict[str, str]:
        """Every parameter's diagnosis: its first failing check's (gradient before update),
        or ``agree``."""
        found: dict[str, str] = {}
        for check in self.checks:
            if not check.ok and check.name not in found:
                found[check.name] = f"{check.what}: {check.diagnosis}"
        return {c.name: found.get(c.name, "agree") for c in self.checks}

    def __str__(self) -> str:
        mesh = ", ".join(
            f"{n}={s}" for n, s in zip(self.mesh_dim_names, self.mesh_shape, strict=True)
        )
        lines = [f"mesh ({mesh}); {len(self.reference_losses)} step(s)"]
        for step, (want, got) in enumerate(
            zip(self.reference_losses, self.rank_losses, strict=True)
        ):
            lines.append(f"step {step}: loss single process {want:.6g}; per rank {_g(got)}")
        lines.append(f"{'parameter':<28} {'step':>4} {'what':<6} {'max abs err':>11}  diagnosis")
        for c in self.checks:
            if not c.ok or c.step == 0:
                shown = "ok" if c.ok else c.diagnosis
                lines.append(
                    f"{c.name:<28} {c.step:>4} {c.what:<6} {c.max_abs_error:>11.2e}  {shown}"
                )
        lines.append("Diagnosis:")
        wrong = {n: d for n, d in self.diagnoses.items() if d != "agree"}
        if not wrong:
            lines.append("- every parameter's gradient and update agree with one process")
        for name, diagnosis in wrong.items():
            lines.append(f"- {name}: {diagnosis}")
        return "\n".join(lines)

    def raise_if_mismatch(self) -> None:
        """Raise :class:`GradientMismatchError` with the report unless everything agrees."""
        if not self.ok:
            raise GradientMismatchError(str(self))


def _g(values: Sequence[float]) -> str:
    return "[" + ", ".join(f"{v:.6g}" for v in values) + "]"


@dataclass(frozen=True)
class _Job:
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
    state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    losses, ref = _train(model, loss_fn, tensors, keys, steps, optimizer, takes_mesh, None)
    ref_losses = [float(x) for x in losses]  # type: ignore[arg-type]
    floating = [p for p in model.parameters() if p.is_floating_point()]
    wide = all(p.dtype == torch.float64 for p in floating)
    rtol = rtol if rtol is not None else (1e-7 if wide else 1e-4)
    atol = atol if atol is not None else (1e-10 if wide else 1e-6)

    job = _Job(
        make_model, parallelize, loss_fn, state, tensors, keys, shape, names,
        tuple(data), steps, optimizer, takes_mesh,
    )  # fmt: skip
    results: list[Any]
    if simulate:
        results = _simulate.run_simulated(
            lambda: _simulated_ranks(job, world_size), world_size, "check_parallel_model"
        )
    else:
        results = run_on_ranks(_rank_run, world_size, args=(job,), timeout=timeout)
    report = ModelReport(
        shape, names, ref_losses, [list(x) for x in zip(*(r[0] for r in results), strict=True)]
    )
    coords = [r[2] for r in results]
    missing = sorted(set(ref[0]) ^ set(results[0][1][0]))
    if missing:
        raise CheckArgumentError(
            f"check_parallel_model: parameters {missing} are not in both the plain and the "
            "parallelized model: parallelize must keep every parameter's name"
        )
    for step in range(steps):
        for name, (want_grad, want_param, before) in ref[step].items():
            for what, index, want in (("grad", 0, want_grad), ("update", 1, want_param)):
                pieces = [r[1][step][name][index] for r in results]
                if want is None or any(p is None for p in pieces):
                    ok = want is None and all(p is None for p in pieces)
                    text = "agree" if ok else "no gradient on some ranks or in one process"
                    report.checks.append(ParameterCheck(step, name, what, ok, 0.0, text))
                    continue
                probe = [r[1][0][name][2] for r in results]
                replicas, dims = _assemble(name, pieces, coords, shape, names, want.shape, probe)
                if what == "update":  # compare what the step changed, not the values
                    assert before is not None
                    old = _assemble(
                        name, [r[1][step][name][2] for r in results], coords, shape, names,
                        want.shape, probe,
                    )[0]  # fmt: skip
                    values = diagnose(replicas, want, dims, names, shape, rtol, atol)
                    replicas = {k: v - old[k] for k, v in replicas.items()}
                    want = want - before
                err = max(
                    float((v - want).abs().max()) if v.numel() else 0.0 for v in replicas.values()
                )
                text = diagnose(replicas, want, dims, names, shape, rtol, atol)
                if what == "update" and text == "agree" and values != "agree":
                    text = "the values differ from one process's although this step's update agrees"
                report.checks.append(ParameterCheck(step, name, what, text == "agree", err, text))
    if raise_on_mismatch:
        report.raise_if_mismatch()
    return report


def _default_names(ndim: int) -> tuple[str, ...]:
    return (
        ("dp", "tp") if ndim == 2 else ("dp",) if ndim == 1 else tuple(f"d{i}" for i in range(ndim))
    )


def _call(
    loss_fn: Callable[..., Tensor],
    model: nn.Module,
    tensors: Sequence[Tensor],
    keys: tuple[str, ...] | None,
    takes_mesh: bool,
    mesh: Any,
) -> Tensor:
    extra = {"mesh": mesh} if takes_mesh else {}
    if keys is not None:
        return loss_fn(model, **dict(zip(keys, tensors, strict=True)), **extra)
    return loss_fn(model, *tensors, **extra)


# What one step records per parameter: (gradient, value after the step, value before it).
_Record = dict[str, tuple[Tensor | None, Tensor | None, Tensor | None]]


def _train(
    model: nn.Module,
    loss_fn: Callable[..., Tensor],
    tensors: Sequence[Tensor],
    keys: tuple[str, ...] | None,
    steps: int,
    make_optimizer: MakeOptimizer,
    takes_mesh: bool,
    mesh: Any,
) -> tuple[list[Tensor | None], list[_Record]]:
    opt = make_optimizer(model.parameters())
    losses, records = [], []
    for _ in range(steps):
        opt.zero_grad(set_to_none=True)
        before = {n: _full(p) for n, p in _named(model)}
        loss = _call(loss_fn, model, tensors, keys, takes_mesh, mesh)
        torch.autograd.backward(loss)
        grads = {n: _full(p.grad) for n, p in _named(model)}
        opt.step()
        after = {n: _full(p) for n, p in _named(model)}
        losses.append(_full(loss.detach()))
        records.append({n: (grads[n], after[n], before[n]) for n in after})
    return losses, records


# What wrappers insert into parameter names (DDP, FSDP1, activation checkpointing, compile).
_WRAPPERS = ("module", "_fsdp_wrapped_module", "_checkpoint_wrapped_module", "_orig_mod")


def _named(model: nn.Module) -> list[tuple[str, nn.Parameter]]:
    """The parameters under the names the plain model gives them, wrappers' parts dropped."""
    return [
        (".".join(part for part in name.split(".") if part not in _WRAPPERS), p)
        for name, p in model.named_parameters()
    ]


def _full(t: Tensor | None) -> Tensor | None:
    """A DTensor's whole value (a collective over its mesh), or the local tensor, detached."""
    if t is None:
        return None
    from torch.distributed.tensor import DTensor

    if isinstance(t, DTensor):
        t = t.full_tensor()
    return t.detach().clone()


def _rank_run(
    rank: int, world_size: int, job: _Job
) -> tuple[list[float], list[_Record], tuple[int, ...]]:
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", job.mesh_shape, mesh_dim_names=job.mesh_dim_names)
    coords = tuple(mesh.get_coordinate() or ())
    model = job.make_model()
    model.load_state_dict(job.state)
    model = job.parallelize(model, mesh)
    # This rank's rows: split over the data dims, in the order the mesh lists them.
    index, parts = 0, 1
    for dim, name in enumerate(job.mesh_dim_names):
        if name in job.data:
            index, parts = index * job.mesh_shape[dim] + coords[dim], parts * job.mesh_shape[dim]
    local = tuple(t.tensor_split(parts)[index] if t.dim() else t for t in job.batch)
    losses, records = _train(
        model, job.loss_fn, local, job.names, job.steps, job.optimizer, job.takes_mesh, mesh
    )
    return [float(x) for x in losses], records, coords  # type: ignore[arg-type]


def _simulated_ranks(
    job: _Job, world_size: int
) -> list[tuple[list[float], list[_Record], tuple[int, ...]]]:
    """Every rank's ``_rank_run``, simulated in this process (``_simulate``): one program on
    tensors holding each rank's value; each rank's rows and coordinates from its index in the
    mesh, as ``init_device_mesh`` lays the ranks out (row-major)."""
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", job.mesh_shape, mesh_dim_names=job.mesh_dim_names)
    coords = [_coordinates(r, job.mesh_shape) for r in range(world_size)]
    model = job.make_model()
    model.load_state_dict(job.state)
    try:
        model = job.parallelize(model, mesh)
    except Exception as exc:  # measured: DDP's constructor fails on LocalTensor parameters
        raise _simulate._Refused(
            f"parallelize failed under LocalTensorMode ({type(exc).__name__}: {exc})"
        ) from exc
    _refuse_wrappers(model)
    rows = [_rows_of(c, job) for c in coords]
    local = tuple(
        _simulate.stacked([t.tensor_split(rows[r][1])[rows[r][0]] for r in range(world_size)])
        if t.dim()
        else t
        for t in job.batch
    )
    losses, records = _train(
        model, job.loss_fn, local, job.names, job.steps, job.optimizer, job.takes_mesh, mesh
    )

    def mine(t: Tensor | None, rank: int) -> Tensor | None:
        return None if t is None else _simulate.local(t, rank).clone()

    return [
        (
            [float(_simulate.local(x, r)) for x in losses if x is not None],
            [
                {n: (mine(g, r), mine(a, r), mine(b, r)) for n, (g, a, b) in step.items()}
                for step in records
            ],
            coords[r],
        )
        for r in range(world_size)
    ]


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


def _rows_of(coords: tuple[int, ...], job: _Job) -> tuple[int, int]:
    """Which part of the batch a rank at ``coords`` gets, and into how many it is split."""
    index, parts = 0, 1
    for dim, name in enumerate(job.mesh_dim_names):
        if name in job.data:
            index, parts = index * job.mesh_shape[dim] + coords[dim], parts * job.mesh_shape[dim]
    return index, parts


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


def diagnose(
    replicas: Mapping[tuple[int, ...], Tensor],
    want: Tensor,
    dims: Sequence[int],
    names: Sequence[str],
    shape: Sequence[int],
    rtol: float,
    atol: float,
) -> str:
    """What the reassembled distributed tensors (one per replica, keyed by the coordinates
    along the mesh dims ``dims``) are, compared with the single-process ``want``."""

    def close(a: Tensor, b: Tensor) -> bool:
        return bool(torch.allclose(a.to(b.dtype), b, rtol=rtol, atol=atol))

    values = list(replicas.values())
    if all(close(v, want) for v in values):
        return "agree"
    positions = list(dims)
    for i, m in enumerate(positions):  # replicas that differ along one mesh dim
        groups: dict[tuple[int, ...], list[Tensor]] = {}
        for key, v in replicas.items():
            groups.setdefault(key[:i] + key[i + 1 :], []).append(v)
        if all(all(close(v, g[0]) for v in g) for g in groups.values()):
            continue  # the replicas along this dim agree: nothing is missing over it
        sums = [torch.stack(g).sum(0) for g in groups.values()]
        if all(close(s, want) for s in sums):
            return (
                f"missing a reduction over mesh dim {names[m]!r}: its {shape[m]} ranks hold "
                "different parts whose sum is the single-process value (all-reduce it over "
                f"{names[m]!r})"
            )
        if all(close(s / len(g), want) for s, g in zip(sums, groups.values(), strict=True)):
            return (
                f"missing an average over mesh dim {names[m]!r}: its {shape[m]} ranks hold "
                "different values whose mean is the single-process value"
            )
    first = values[0]
    same = all(close(v, first) for v in values)
    scale = _best_scale(first, want)
    if same and scale is not None:
        sizes = {names[m]: shape[m] for m in range(len(shape)) if shape[m] > 1}
        factors = {f"{n}": s for n, s in sizes.items()}
        if len(sizes) > 1:
            factors[" and ".join(sizes)] = math.prod(sizes.values())
        for label, n in factors.items():
            for factor, shown in ((1 / n, f"1/{n}"), (float(n), f"{n}")):
                if close(first, want * factor):
                    what = "sizes of mesh dims" if " and " in label else "size of mesh dim"
                    return f"scaled by {shown} (the {what} {label!r})"
    how = "the ranks disagree" if not same else "the ranks agree with each other"
    shown = "-" if scale is None else f"{scale:.4g}"
    return (
        f"wrong: no reduction over a mesh dim or factor explains it ({how}; best scale "
        f"{shown}): terms are missing, as when a local-only backward (a GatherLayer) drops the "
        "gradient that flows through other ranks' rows"
    )


def _best_scale(got: Tensor, want: Tensor) -> float | None:
    denom = float((want * want).sum())
    return None if denom == 0 else float((got.to(want.dtype) * want).sum()) / denom
