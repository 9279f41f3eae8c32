"""Which pipeline a check runs: a torch schedule (by name or class) or a program of the user's,
how many stages it holds per rank, and which rank holds each stage.

The rules are torch 2.13's (``torch/distributed/pipelining/schedules.py``), checked here so that
a schedule that cannot take the arguments is refused before any process starts:

* ``PipelineScheduleSingle`` (GPipe, 1F1B): one stage per rank, stage ``r`` on rank ``r``;
* ``PipelineScheduleMulti`` in the loop layout (Interleaved1F1B, LoopedBFS,
  InterleavedZeroBubble): ``k`` stages per rank, stage ``s`` on rank ``s % pp``; the two
  interleaved schedules need ``n_microbatches`` a multiple of ``max(1, n_microbatches // pp)``;
* the V layout (ZBVZeroBubble, DualPipeV): exactly 2 stages per rank, rank ``r`` holding
  stages ``r`` and ``2 pp - 1 - r`` (so rank 0 holds the first and the last); DualPipeV needs at
  least as many microbatches as stages.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

from distgrad.errors import CheckArgumentError

__all__ = ["Layout", "Plan", "SCHEDULE_NAMES", "plan", "stage_ranks"]

Layout = Literal["loop", "v"]

# The short names torch's get_schedule_class takes, and the classes' own names.
SCHEDULE_NAMES = (
    "GPipe",
    "1F1B",
    "Interleaved1F1B",
    "LoopedBFS",
    "InterleavedZeroBubble",
    "ZBVZeroBubble",
    "DualPipeV",
)
_V_SCHEDULES = ("ScheduleZBVZeroBubble", "ScheduleDualPipeV")
_SPLIT = ("ScheduleInterleavedZeroBubble", "ScheduleZBVZeroBubble", "ScheduleDualPipeV")
_ROUNDS = ("ScheduleInterleaved1F1B", "ScheduleInterleavedZeroBubble")


@dataclass(frozen=True)
class Plan:
    """A pipeline, resolved: what runs (``schedule``: a torch schedule class; or ``program``),
    its name for the report, and the stage layout."""

    name: str
    schedule: type | None
    program: Callable[..., Any] | None
    kwargs: Mapping[str, Any] = field(default_factory=dict)
    pp_size: int = 1
    stages_per_rank: int = 1
    layout: Layout = "loop"
    single: bool = True  # a PipelineScheduleSingle: the schedule takes one stage, not a list

    @property
    def splits_backward(self) -> bool | None:
        """Whether each stage's backward is an input-gradient step and a separate
        weight-gradient step (the zero-bubble schedules); None for a program (unknown)."""
        if self.schedule is None:
            return None
        return any(b.__name__ in _SPLIT for b in self.schedule.__mro__)

    @property
    def n_stages(self) -> int:
        return self.pp_size * self.stages_per_rank

    @property
    def ranks(self) -> dict[int, int]:
        """The pipeline rank holding each stage."""
        return stage_ranks(self.pp_size, self.n_stages, self.layout)


def stage_ranks(pp_size: int, n_stages: int, layout: Layout) -> dict[int, int]:
    """Stage index -> pipeline rank: ``s % pp`` in the loop layout; in the V layout down the
    ranks and back up (stage ``s`` and ``2 pp - 1 - s`` on one rank), as torch lays it out."""
    if layout == "loop":
        return {s: s % pp_size for s in range(n_stages)}
    return {s: s % pp_size if (s // pp_size) % 2 == 0 else pp_size - 1 - s % pp_size
            for s in range(n_stages)}  # fmt: skip


def plan(
    schedule: object,
    kwargs: Mapping[str, Any],
    pp_size: int,
    stages_per_rank: int | None,
    n_microbatches: int,
    layout: Layout | None,
) -> Plan:
    """Resolve ``schedule`` and check the layout against the schedule's rules; raise
    CheckArgumentError naming what the schedule needs."""
    from torch.distributed.pipelining import schedules as torch_schedules

    extra = dict(kwargs)
    if isinstance(schedule, functools.partial) and isinstance(schedule.func, type):
        extra = {**schedule.keywords, **extra}
        if schedule.args:
            raise CheckArgumentError(
                "check_pipeline: a functools.partial of a schedule class may bind keywords "
                f"only (the checker passes the stages and n_microbatches), got {schedule.args}"
            )
        schedule = schedule.func
    if isinstance(schedule, str):
        found = {n.lower(): n for n in SCHEDULE_NAMES}
        found.update({f"schedule{n.lower()}": n for n in SCHEDULE_NAMES})
        if schedule.lower() not in found:
            raise CheckArgumentError(
                f"check_pipeline: unknown schedule {schedule!r}; torch's schedules are "
                f"{', '.join(SCHEDULE_NAMES)} (or pass a schedule class, or a program)"
            )
        schedule = getattr(torch_schedules, "Schedule" + found[schedule.lower()])
    if isinstance(schedule, type):
        return _torch_plan(schedule, extra, pp_size, stages_per_rank, n_microbatches, layout)
    if not callable(schedule):
        raise CheckArgumentError(
            "check_pipeline: schedule must be a schedule name, a torch pipeline schedule "
            f"class or a program (a callable), got {type(schedule).__name__}"
        )
    if extra:
        raise CheckArgumentError(
            f"check_pipeline: schedule_kwargs {sorted(extra)} apply to torch schedules only; "
            "a program takes none"
        )
    spr = 1 if stages_per_rank is None else stages_per_rank
    _at_least_one(spr)
    name = getattr(schedule, "__name__", type(schedule).__name__)
    return Plan(f"program {name}", None, schedule, {}, pp_size, spr, layout or "loop", False)


def _torch_plan(
    cls: type,
    kwargs: dict[str, Any],
    pp_size: int,
    stages_per_rank: int | None,
    n_microbatches: int,
    layout: Layout | None,
) -> Plan:
    from torch.distributed.pipelining.schedules import (
        PipelineScheduleMulti,
        PipelineScheduleSingle,
    )

    name = cls.__name__
    for reserved in ("stage", "stages", "n_microbatches"):
        if reserved in kwargs:
            raise CheckArgumentError(
                f"check_pipeline: schedule_kwargs must not set {reserved!r}: the checker "
                "passes the stages and n_microbatches itself"
            )
    if issubclass(cls, PipelineScheduleSingle):
        spr = 1 if stages_per_rank is None else stages_per_rank
        if spr != 1:
            raise CheckArgumentError(
                f"check_pipeline: {name} runs one stage per rank (a PipelineScheduleSingle), "
                f"got stages_per_rank={spr}; use a multi-stage schedule (Interleaved1F1B, "
                "LoopedBFS, InterleavedZeroBubble, ZBVZeroBubble, DualPipeV) for more"
            )
        return Plan(name, cls, None, kwargs, pp_size, 1, "loop", True)
    if not issubclass(cls, PipelineScheduleMulti):
        raise CheckArgumentError(
            f"check_pipeline: schedule class {name} is not a torch pipeline schedule "
            "(a subclass of PipelineScheduleSingle or PipelineScheduleMulti)"
        )
    v = any(base.__name__ in _V_SCHEDULES for base in cls.__mro__)
    spr = 2 if stages_per_rank is None else stages_per_rank
    _at_least_one(spr)
    if v and spr != 2:
        raise CheckArgumentError(
            f"check_pipeline: {name} runs exactly 2 stages per rank in a V layout (rank r "
            f"holds stages r and 2*pp-1-r), got stages_per_rank={spr}"
        )
    own: Layout = "v" if v else "loop"
    if layout is not None and layout != own:
        raise CheckArgumentError(
            f"check_pipeline: {name} lays its stages out in the {own} layout, got "
            f"layout={layout!r} (layout= is for programs)"
        )
    n_stages = pp_size * spr
    if any(base.__name__ in _ROUNDS for base in cls.__mro__):
        rounds = max(1, n_microbatches // pp_size)
        if n_microbatches % rounds:
            raise CheckArgumentError(
                f"check_pipeline: {name} needs n_microbatches a multiple of its number of "
                f"rounds, max(1, n_microbatches // pp) = {rounds}, got {n_microbatches}"
            )
    if any(base.__name__ == "ScheduleDualPipeV" for base in cls.__mro__) and (
        n_microbatches < n_stages
    ):
        raise CheckArgumentError(
            f"check_pipeline: {name} needs at least as many microbatches as stages "
            f"({n_stages}), got n_microbatches={n_microbatches}"
        )
    return Plan(name, cls, None, kwargs, pp_size, spr, own, False)


def _at_least_one(spr: int) -> None:
    if spr < 1:
        raise CheckArgumentError(f"check_pipeline: stages_per_rank must be at least 1, got {spr}")
