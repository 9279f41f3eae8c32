"""check_pipeline: every torch schedule agrees with one process, each planted mistake gets its
named diagnosis, and arguments it cannot use are refused before any process starts.

Semantics asserted (float64, SGD, real gloo ranks): the single-process truth is the whole
model on the whole batch, its loss the mean over the microbatches of the per-microbatch MSE
(torch's default ``scale_grads=True``); every stage's copy of every parameter must have its
gradient and its update to 1e-10 (``rtol=atol=1e-10``). Every schedule torch 2.13 ships
agrees on 2 ranks at its default stages per rank (the default tier) and on 2 and 4 ranks
with 1 and 2 stages per rank where the schedule takes them, over two steps (the slow tier);
so does a pipeline over "pp" with FSDP2 or DDP over "dp" on a 2x2 mesh. The planted mistakes
(tests/testing/pipelines_to_check.py) and what the checker must say: a tied embedding whose
two stage copies are never summed, "tied between stage 0 (rank 0) and stage 1 (rank 1)"
(summed by the user between the two ranks, it agrees); the loss divided by the number of
microbatches twice, "scaled by 1/4 (the number of microbatches)", or not at all, "scaled by
4"; a detached boundary, "missing" on the stages before it, naming the boundary; a skipped
weight-gradient step, "missing" on that stage only; a hand-written isend/irecv program
without its division, divided by the number of stages too ("scaled by 1/2 (the number of
stages)"), or with a detached boundary, likewise; no data parallel on a pp x dp
mesh, "missing an average over mesh dim 'dp'".
"""

from __future__ import annotations

import time

import pytest
import torch

from distgrad.errors import CheckArgumentError, GradientMismatchError, RankFailedError
from distgrad.testing import PipelineReport, check_pipeline
from distgrad.testing._schedules import SCHEDULE_NAMES, stage_ranks
from tests.testing import pipelines_to_check as m

TIGHT = {"rtol": 1e-10, "atol": 1e-10}  # the bar: every schedule to 1e-10 in float64


def _mlp(schedule: object, **kwargs: object) -> PipelineReport:
    options: dict[str, object] = {"world_size": 2, "split": m.split, **TIGHT, **kwargs}
    return check_pipeline(
        m.make_mlp,
        batch=m.batch(),
        loss_fn=m.mse,
        schedule=schedule,
        **options,  # type: ignore[arg-type]
    )


def _grads(report: PipelineReport) -> dict[str, str]:
    return {c.name: c.diagnosis for c in report.checks if c.what == "grad" and c.step == 0}


def _assert_agrees(report: PipelineReport) -> float:
    assert report.ok, str(report)
    worst = max(c.max_abs_error for c in report.checks)
    assert worst < 1e-10, str(report)
    return worst


def test_every_torch_schedule_agrees_with_one_process_on_two_ranks() -> None:
    """2 ranks, each schedule's default stages per rank (1 for GPipe and 1F1B, 2 otherwise),
    4 microbatches."""
    for name in SCHEDULE_NAMES:
        report = _mlp(name)
        _assert_agrees(report)
        assert report.schedule == f"Schedule{name}"
    zbv = _mlp("ZBVZeroBubble")
    assert zbv.stage_ranks == {0: 0, 1: 1, 2: 1, 3: 0}  # the V: rank 0 holds first and last


def test_tied_embeddings_never_summed_name_both_stages() -> None:
    report = check_pipeline(
        m.make_tied, m.split_tied, m.tied_batch(), m.mse, schedule="GPipe", **TIGHT
    )
    grads = _grads(report)
    assert grads["embed"].startswith(
        "tied between stage 0 (rank 0) and stage 1 (rank 1): each stage's copy holds only its "
        "own stage's part"
    ), str(report)
    assert {d for n, d in grads.items() if n != "embed"} == {"agree"}, str(report)
    with pytest.raises(GradientMismatchError, match=r"embed: grad: tied between stage 0"):
        report.raise_if_mismatch()


def test_tied_embeddings_summed_between_the_two_stages_agree() -> None:
    report = check_pipeline(
        m.make_tied,
        m.split_tied,
        m.tied_batch(),
        m.mse,
        schedule="1F1B",
        finalize_grads=m.sum_tied_grads,
        steps=2,
        **TIGHT,
    )
    _assert_agrees(report)
    assert next(c for c in report.checks if c.name == "embed").stages == (0, 1)


def test_a_tied_embedding_on_one_rank_of_a_v_schedule_is_divided_twice_by_torch() -> None:
    """A finding about torch 2.13: in the V layout rank 0 holds the first and the last stage,
    so the tied embedding is one parameter there, whose gradient sums both uses, but each
    stage's scale_grads divides it by 4 on its own; with scale_grads=False and the loss divided
    by 4 instead, it agrees."""
    report = check_pipeline(
        m.make_tied, m.split_tied, m.tied_batch(), m.mse, schedule="ZBVZeroBubble", **TIGHT
    )
    grads = _grads(report)
    assert grads["embed"].startswith("wrong: no factor"), str(report)
    assert "stage 0 and stage 3 share this one parameter on rank 0" in grads["embed"]
    assert {d for n, d in grads.items() if n != "embed"} == {"agree"}, str(report)
    right = {"scale_grads": False, "loss_fn": m.mse_over_microbatches}
    _assert_agrees(
        check_pipeline(
            m.make_tied,
            m.split_tied,
            m.tied_batch(),
            m.mse,
            schedule="ZBVZeroBubble",
            schedule_kwargs=right,
            **TIGHT,
        )
    )


def test_a_loss_divided_by_the_microbatches_twice_or_not_at_all_is_scaled() -> None:
    """Twice: the schedule's loss divides by 4 and scale_grads divides again; not at all:
    scale_grads=False with a mean loss."""
    twice = _mlp("1F1B", schedule_kwargs={"loss_fn": m.mse_over_microbatches})
    assert set(_grads(twice).values()) == {"scaled by 1/4 (the number of microbatches)"}
    assert "- every parameter: grad: scaled by 1/4 (the number of microbatches)" in str(twice)
    never = _mlp(m.GPipeUnscaled)
    assert set(_grads(never).values()) == {"scaled by 4 (the number of microbatches)"}


def test_a_detached_boundary_leaves_the_stages_before_it_missing() -> None:
    """Stage 1 detaches its input: under 1F1B (2 stages) stage 0 misses its gradient; under
    InterleavedZeroBubble (4 stages) stage 1 too (its weight step follows from its
    input-gradient step), and the diagnosis names both possible cuts."""
    full = _grads(_mlp("1F1B", split=m.split_detached_at_1))
    first = [n for n in full if int(n.split(".")[0]) < 4]  # stage 0's blocks
    for name in first:
        assert full[name].startswith(
            "missing: no gradient reached it on stage 0 (rank 0): stage 0 receives no gradient "
            "while stage 1 does: the activation stage 0 sends stage 1 is detached"
        ), full
    assert {full[n] for n in full if n not in first} == {"agree"}, full
    split = _grads(_mlp("InterleavedZeroBubble", split=m.split_detached_at_1))
    cut = [n for n in split if int(n.split(".")[0]) < 4]  # stages 0 and 1
    for name in cut:
        assert "stages 0-1 receive no gradient while stage 2 does" in split[name], split
        assert (
            "the boundary into stage 2, or into stage 1 (where the backward is split"
            in (split[name])
        ), split
    assert {split[n] for n in split if n not in cut} == {"agree"}, split


def test_a_skipped_weight_gradient_step_is_missing_on_that_stage_only() -> None:
    report = _mlp(m.SkipsWeightStep)  # InterleavedZeroBubble whose stage 1 skips its W step
    grads = _grads(report)
    stage_1 = [n for n in grads if n.split(".")[0] in ("2", "3")]
    for name in stage_1:
        assert grads[name].startswith(
            "missing: no gradient reached it on stage 1 (rank 1): stage 1's weight-gradient "
            "step never runs"
        ), str(report)
    assert {grads[n] for n in grads if n not in stage_1} == {"agree"}, str(report)


def test_a_hand_written_program_is_checked_like_a_schedule() -> None:
    """isend/irecv and a manual backward: right; without / n_microbatches; divided by the
    number of stages too; detached."""
    _assert_agrees(_mlp(m.hand_program, steps=2))
    undivided = _mlp(m.hand_program_undivided)
    assert set(_grads(undivided).values()) == {"scaled by 4 (the number of microbatches)"}
    over_stages = _mlp(m.hand_program_over_stages)
    assert set(_grads(over_stages).values()) == {"scaled by 1/2 (the number of stages)"}
    detached = _grads(_mlp(m.hand_program_detached))
    first = [n for n in detached if int(n.split(".")[0]) < 4]  # stage 0's blocks
    for name in first:
        assert detached[name].startswith(
            "missing: no gradient reached it on stage 0 (rank 0): stage 0 receives no gradient "
            "while stage 1 does"
        ), detached
    assert {detached[n] for n in detached if n not in first} == {"agree"}


def test_pipeline_over_pp_with_ddp_over_dp_agrees() -> None:
    _assert_agrees(_mlp("1F1B", world_size=4, mesh_shape=(2, 2), data_parallel="ddp"))


def test_pipeline_over_pp_without_data_parallel_misses_the_dp_average() -> None:
    report = _mlp("GPipe", world_size=4, mesh_shape=(2, 2))
    assert {d.split(":")[0] for d in _grads(report).values()} == {
        "missing an average over mesh dim 'dp'"
    }, str(report)


def test_simulate_is_refused_naming_why() -> None:
    with pytest.raises(CheckArgumentError, match=r"simulate=True cannot run a pipeline.*"
                       r"LocalRunnerMode.*drop simulate=True"):  # fmt: skip
        check_pipeline(m.make_mlp, m.split, m.batch(), m.mse, simulate=True)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"schedule": "Zigzag"}, r"unknown schedule 'Zigzag'; torch's schedules are GPipe, 1F1B"),
        ({"schedule": "GPipe", "stages_per_rank": 2}, r"ScheduleGPipe runs one stage per rank"),
        ({"schedule": "DualPipeV", "stages_per_rank": 1}, r"exactly 2 stages per rank in a V"),
        (
            {"schedule": "DualPipeV", "n_microbatches": 2},
            r"at least as many microbatches as "
            r"stages \(4\), got n_microbatches=2",
        ),
        (
            {"schedule": "Interleaved1F1B", "n_microbatches": 5},
            r"multiple of its number of "
            r"rounds, max\(1, n_microbatches // pp\) = 2, got 5",
        ),
        ({"schedule": "ZBVZeroBubble", "layout": "loop"}, r"lays its stages out in the v layout"),
        ({"schedule": torch.nn.Linear}, r"Linear is not a torch pipeline schedule"),
        ({"schedule": 3}, r"schedule must be a schedule name, a torch pipeline schedule class"),
        (
            {"schedule": "GPipe", "schedule_kwargs": {"n_microbatches": 2}},
            r"must not set "
            r"'n_microbatches'",
        ),
        (
            {"schedule": m.hand_program, "schedule_kwargs": {"scale_grads": False}},
            r"apply to "
            r"torch schedules only",
        ),
        (
            {"world_size": 4, "mesh_shape": (3, 2)},
            r"mesh_shape \(3, 2\) must multiply to "
            r"world_size 4",
        ),
        (
            {"world_size": 4, "mesh_shape": (2, 2), "mesh_dim_names": ("dp", "tp")},
            r"one of "
            r"them 'pp'",
        ),
        ({"data_parallel": "ddp"}, r"needs a mesh with a data dim beside 'pp'"),
        (
            {"world_size": 4, "mesh_shape": (2, 2), "data_parallel": "zero"},
            r"data_parallel must"
            r" be 'fsdp2', 'ddp'",
        ),
        (
            {"n_microbatches": 3},
            r"ScheduleGPipe sends every microbatch in the shape of the "
            r"first, so the batch's 16 rows must divide evenly into 1 data-parallel part\(s\) x 3",
        ),
        (
            {"schedule": m.hand_program, "n_microbatches": 17},
            r"16 rows cannot make 1 "
            r"data-parallel part\(s\) x 17 microbatches",
        ),
        ({"steps": 0}, r"steps must be at least 1"),
        ({"batch": (torch.zeros(16, 4),)}, r"batch must be \(\*inputs, target\)"),
        ({"split": lambda model, n: [model]}, r"split\(model, 2\) must return 2 stage modules"),
        (
            {"split": lambda model, n: [torch.nn.Linear(4, 4), model]},
            r"stage 0's parameter "
            r"'weight' is not a parameter of the model make_model\(\) returned",
        ),
    ],
)
def test_arguments_it_cannot_use_are_refused_before_any_process_starts(
    kwargs: dict[str, object], match: str
) -> None:
    arguments: dict[str, object] = {"schedule": "GPipe", "batch": m.batch(), "split": m.split}
    arguments.update(kwargs)
    with pytest.raises(CheckArgumentError, match=match):
        check_pipeline(m.make_mlp, loss_fn=m.mse, **arguments)  # type: ignore[arg-type]


def test_stage_layouts_are_torchs() -> None:
    """The checker's stage -> rank map equals torch's own for the loop and the V layout."""
    from torch.distributed.pipelining._utils import generate_stage_to_rank_mapping

    for pp in (1, 2, 3, 4):
        for per in (1, 2, 3):
            assert stage_ranks(pp, pp * per, "loop") == generate_stage_to_rank_mapping(pp, pp * per)
        assert stage_ranks(pp, 2 * pp, "v") == generate_stage_to_rank_mapping(pp, 2 * pp, style="v")


# The slow tier: every schedule at 2 and 4 ranks with every number of stages per rank it
# takes, over two steps; and pipeline x data parallel on a 2x2 mesh.
_MATRIX = [
    (name, per)
    for name in SCHEDULE_NAMES
    for per in ((1,) if name in ("GPipe", "1F1B") else (2,) if "V" in name else (1, 2))
]


@pytest.mark.slow
@pytest.mark.parametrize("world_size", [2, 4])
@pytest.mark.parametrize(("schedule", "stages_per_rank"), _MATRIX)
def test_every_schedule_layout_agrees(schedule: str, stages_per_rank: int, world_size: int) -> None:
    """8 microbatches on 4 ranks (DualPipeV needs as many as its 8 stages), 4 on 2."""
    report = _mlp(
        schedule,
        world_size=world_size,
        stages_per_rank=stages_per_rank,
        n_microbatches=8 if world_size == 4 else 4,
        steps=2,
    )
    worst = _assert_agrees(report)
    print(f"{schedule} ranks={world_size} stages/rank={stages_per_rank}: max abs {worst:.1e}")


@pytest.mark.slow
@pytest.mark.parametrize("schedule", SCHEDULE_NAMES)
def test_pipeline_with_fsdp2_over_dp_agrees(schedule: str) -> None:
    report = _mlp(schedule, world_size=4, mesh_shape=(2, 2), data_parallel="fsdp2", steps=2)
    worst = _assert_agrees(report)
    print(f"{schedule} pp=2 x dp=2 FSDP2: max abs {worst:.1e}")


@pytest.mark.slow
@pytest.mark.parametrize("schedule", ["GPipe", "1F1B", "Interleaved1F1B", "LoopedBFS"])
def test_pipeline_with_ddp_over_dp_agrees(schedule: str) -> None:
    report = _mlp(schedule, world_size=4, mesh_shape=(2, 2), data_parallel="ddp", steps=2)
    worst = _assert_agrees(report)
    print(f"{schedule} pp=2 x dp=2 DDP: max abs {worst:.1e}")


@pytest.mark.slow
@pytest.mark.parametrize(
    ("schedule", "unaveraged"),
    [("InterleavedZeroBubble", (1, 2, 3)), ("ZBVZeroBubble", (1, 2, 3)), ("DualPipeV", (1, 2))],
)
def test_ddp_under_torchs_zero_bubble_schedules_misses_the_dp_average(
    schedule: str, unaveraged: tuple[int, ...]
) -> None:
    """A finding about torch 2.13, not a planted mistake: under the schedules that split the
    backward, DDP averages over "dp" only the stages whose last backward is a full one; a
    stage whose gradients come from the split weight step keeps its replica's own."""
    report = _mlp(schedule, world_size=4, mesh_shape=(2, 2), data_parallel="ddp")
    per_stage: dict[int, set[str]] = {}
    for check in report.checks:
        if check.what == "grad":
            per_stage.setdefault(check.stages[0], set()).add(check.diagnosis.split(":")[0])
    for stage, found in per_stage.items():
        want = "missing an average over mesh dim 'dp'" if stage in unaveraged else "agree"
        assert found == {want}, str(report)


@pytest.mark.slow
def test_a_program_whose_stage_never_sends_fails_within_the_timeout() -> None:
    """Nothing hangs: stage 1 waits for an activation stage 0 never sends; the check fails
    with RankFailedError naming the waiting rank within the group timeout (a third of
    ``timeout``), not at pytest's backstop."""
    start = time.monotonic()
    with pytest.raises(RankFailedError, match=r"rank 1"):
        _mlp(m.program_never_sends, timeout=12.0)
    assert time.monotonic() - start < 12.0
