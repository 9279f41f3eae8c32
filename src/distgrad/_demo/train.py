"""`distgrad demo`: train one small contrastive model three ways and compare.

1. one process on the full batch (the truth);
2. N processes with DistributedDataParallel, NT-Xent over candidates gathered with
   ``dg.all_gather``;
3. the same with the widespread local-only GatherLayer (wrong on purpose).

Everything is float64 and seeded, so run 2 should track run 1 to rounding error while run 3
drifts. At every step each distributed run also measures how far its (DDP-averaged) gradient
is from the single-process gradient at the same parameters, and how far its parameters are
from those of the one-process run after the same number of steps.
"""

from __future__ import annotations

import math
import sys
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor, nn
from torch.nn.parallel import DistributedDataParallel

import distgrad as dg
from distgrad._demo.naive import LocalOnlyGather

Gather = Callable[[Tensor], Tensor]
FEATURES, HIDDEN, EMBED, CLUSTERS = 16, 32, 8, 8
TEMPERATURE, LR = 0.5, 1.0


@dataclass(frozen=True)
class Settings:
    world_size: int = 2
    steps: int = 60
    batch: int = 64  # global batch: pairs of views
    seed: int = 0


@dataclass
class Curve:
    """One run, per step: the loss and, for distributed runs, the relative deviation of the
    gradient from the one-process gradient at the same parameters and the relative distance of
    the parameters from the one-process run's."""

    name: str
    losses: list[float] = field(default_factory=list)
    deviations: list[float] = field(default_factory=list)
    distances: list[float] = field(default_factory=list)


def _flat(model: nn.Module) -> Tensor:
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


def make_model(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(FEATURES, HIDDEN), nn.Tanh(), nn.Linear(HIDDEN, EMBED)).double()


def make_views(settings: Settings) -> tuple[Tensor, Tensor]:
    """Two noisy views of points drawn around a few centres: the global batch of every step."""
    gen = torch.Generator().manual_seed(settings.seed * 100_003 + 1)
    centres = torch.randn(
        CLUSTERS,
        FEATURES,
        dtype=torch.float64,
        generator=torch.Generator().manual_seed(settings.seed),
    )
    base = centres[torch.randint(CLUSTERS, (settings.batch,), generator=gen)]
    base = base + 0.3 * torch.randn(base.shape, dtype=torch.float64, generator=gen)
    noise = 0.1 * torch.randn((2, *base.shape), dtype=torch.float64, generator=gen)
    return base + noise[0], base + noise[1]


def nt_xent(z1: Tensor, z2: Tensor, gather: Gather, offset: int) -> Tensor:
    """SimCLR's NT-Xent for this rank's anchors, mean over them.

    Candidates are every rank's views of both kinds, gathered: [2B, D] with rank r's first views
    at rows offset(r) .. and all second views after all first views. The positive of anchor i of
    the first view is the second view of the same sample, and the other way round; each anchor
    is excluded from its own candidates.
    """
    b_local = len(z1)
    z1, z2 = F.normalize(z1, dim=1), F.normalize(z2, dim=1)
    first, second = gather(z1), gather(z2)  # [B, D] each
    b = len(first)
    candidates = torch.cat([first, second])  # [2B, D]
    anchors = torch.cat([z1, z2])  # [2 B_local, D]
    logits = anchors @ candidates.T / TEMPERATURE  # [2 B_local, 2B]
    rows = torch.arange(b_local)
    own = torch.cat([rows + offset, rows + offset + b])
    positive = torch.cat([rows + offset + b, rows + offset])
    logits = logits.masked_fill(F.one_hot(own, 2 * b).bool(), float("-inf"))
    return F.cross_entropy(logits, positive)


def _identity(x: Tensor) -> Tensor:
    return x


def _full_batch_grad(model: nn.Module, z_inputs: tuple[Tensor, Tensor]) -> tuple[float, Tensor]:
    model.zero_grad()
    loss = nt_xent(model(z_inputs[0]), model(z_inputs[1]), _identity, 0)
    torch.autograd.backward(loss)
    grad = torch.cat([p.grad.reshape(-1) for p in model.parameters() if p.grad is not None])
    model.zero_grad()
    return float(loss.item()), grad


def train_single(settings: Settings) -> tuple[Curve, list[Tensor]]:
    """The one-process run: its curve and its parameters after every step."""
    model = make_model(settings.seed)
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    curve = Curve("one process")
    trajectory = []
    for step in range(settings.steps):
        views = make_views(settings)
        optimizer.zero_grad()
        loss = nt_xent(model(views[0]), model(views[1]), _identity, 0)
        torch.autograd.backward(loss)
        optimizer.step()
        curve.losses.append(float(loss.item()))
        trajectory.append(_flat(model))
        _progress(curve.name, step + 1, settings.steps)
    return curve, trajectory


def train_distributed(
    rank: int, world_size: int, settings: Settings, naive: bool, trajectory: list[Tensor]
) -> Curve:
    """One rank of a DDP run; rank 0 returns the curve. ``trajectory``: the one-process run's
    parameters after every step."""
    gather: Gather = LocalOnlyGather.apply if naive else dg.all_gather  # type: ignore[assignment]
    name = "naive GatherLayer" if naive else "distgrad"
    model = make_model(settings.seed)
    probe = make_model(settings.seed)  # rank 0's copy for the single-process gradient
    ddp = DistributedDataParallel(model)
    optimizer = torch.optim.SGD(ddp.parameters(), lr=LR)
    b_local = settings.batch // world_size
    offset = rank * b_local
    curve = Curve(name)
    for step in range(settings.steps):
        views = make_views(settings)
        local = tuple(v[offset : offset + b_local] for v in views)
        optimizer.zero_grad()
        loss = nt_xent(ddp(local[0]), ddp(local[1]), gather, offset)
        torch.autograd.backward(loss)  # DDP averages the parameter gradients over ranks
        global_loss = loss.detach().clone()
        dist.all_reduce(global_loss)  # for the log: the mean of equal-sized local means
        if rank == 0:
            grad = torch.cat([p.grad.reshape(-1) for p in model.parameters() if p.grad is not None])
            probe.load_state_dict(model.state_dict())
            _, truth = _full_batch_grad(probe, views)
            curve.losses.append(float(global_loss.item()) / world_size)
            curve.deviations.append(float((grad - truth).norm() / truth.norm()))
        optimizer.step()
        if rank == 0:
            truth_after = trajectory[step]
            distance = (_flat(model) - truth_after).norm() / truth_after.norm()
            curve.distances.append(float(distance))
            _progress(name, step + 1, settings.steps)
    return curve


def _progress(name: str, done: int, total: int) -> None:
    """A bar redrawn in place on a terminal; one line per run when stderr is a file or pipe."""
    if done < total and not sys.stderr.isatty():
        return
    width = 30
    filled = width * done // total
    bar = "#" * filled + "." * (width - filled)
    end = "\n" if done == total else ""
    sys.stderr.write(f"\r  {name:<18} [{bar}] {done}/{total}{end}")
    sys.stderr.flush()


COLUMNS = (
    "run",
    "final loss",
    "max |loss - one process|",
    "max gradient deviation",
    "max parameter distance",
)


def summary_rows(curves: list[Curve]) -> list[tuple[str, ...]]:
    """The header, then one row per run; deviations and distances are relative (see Curve)."""
    truth = curves[0].losses
    rows: list[tuple[str, ...]] = [COLUMNS]
    for curve in curves:
        gap = max(abs(a - b) for a, b in zip(curve.losses, truth, strict=True))
        dev = f"{max(curve.deviations):.1e}" if curve.deviations else "-"
        dist = f"{max(curve.distances):.1e}" if curve.distances else "-"
        rows.append((curve.name, f"{curve.losses[-1]:.6f}", f"{gap:.1e}", dev, dist))
    return rows


def is_finite(curves: list[Curve]) -> bool:
    return all(math.isfinite(x) for c in curves for x in c.losses)
