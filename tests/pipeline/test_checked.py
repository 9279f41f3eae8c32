"""Programs written with distgrad.pipeline, checked by dg.testing.check_pipeline against the
same model in one process on the whole batch (the loss as the mean over microbatches of each
microbatch's MSE): right ones agree on every stage's every parameter at 1e-10 in float64, and
planted mistakes get their diagnosis. The float64 MLP and its split are the checker's own
(tests/testing/pipelines_to_check.py).
"""

from __future__ import annotations

import pytest

from distgrad.testing import PipelineReport, check_pipeline
from tests.pipeline import programs as p
from tests.testing import pipelines_to_check as m


def _check(program: object, **kwargs: object) -> PipelineReport:
    options: dict[str, object] = {"world_size": 2, "rtol": 1e-10, "atol": 1e-12, **kwargs}
    return check_pipeline(m.make_mlp, m.split, m.batch(), m.mse, schedule=program, **options)  # type: ignore[arg-type]


def _grads(report: PipelineReport) -> dict[str, str]:
    return {c.name: c.diagnosis for c in report.checks if c.what == "grad" and c.step == 0}


def test_a_distgrad_pipeline_program_agrees_with_one_process() -> None:
    """2 ranks, one stage each, 2 steps: gradients and updates."""
    report = _check(p.distgrad_program, steps=2)
    assert report.ok, str(report)
    assert max(c.max_abs_error for c in report.checks) < 1e-10


@pytest.mark.parametrize(
    "options",
    [
        pytest.param({"world_size": 4}, id="4 ranks", marks=pytest.mark.slow),
        pytest.param({"stages_per_rank": 2}, id="2 stages per rank, looped"),
        pytest.param(
            {"stages_per_rank": 2, "layout": "v"}, id="2 stages per rank, V", marks=pytest.mark.slow
        ),
        pytest.param(
            {"world_size": 4, "mesh_shape": (2, 2), "data_parallel": "fsdp2"}, id="pp x dp, FSDP2"
        ),
    ],
)
def test_a_distgrad_pipeline_program_agrees_in_every_layout(options: dict[str, object]) -> None:
    report = _check(p.distgrad_program, **options)
    assert report.ok, str(report)


def test_under_ddp_a_program_syncs_once_after_the_last_microbatch() -> None:
    """pp x dp with DDP on dp: the program that keeps DDP's sync for the last microbatch's
    backward (no_sync before it) agrees; the one that forwards every microbatch first, which
    DDP's reducer does not follow, is diagnosed as missing the dp average."""
    options = {"world_size": 4, "mesh_shape": (2, 2), "data_parallel": "ddp"}
    report = _check(p.distgrad_program_ddp, **options)
    assert report.ok, str(report)
    plain = _grads(_check(p.distgrad_program, **options))
    assert {d.split(":")[0] for d in plain.values()} == {"missing an average over mesh dim 'dp'"}


def test_mistakes_in_a_distgrad_pipeline_program_get_their_diagnosis() -> None:
    """The loss never divided by the number of microbatches: every gradient scaled by 4;
    every boundary detached: stage 0 gets no gradient, stage 1 agrees."""
    undivided = _check(p.distgrad_program_undivided)
    assert set(_grads(undivided).values()) == {"scaled by 4 (the number of microbatches)"}
    detached = _grads(_check(p.distgrad_program_detached))
    first = [n for n in detached if int(n.split(".")[0]) < 4]  # stage 0's blocks
    assert all(detached[n].startswith("missing: no gradient reached it on stage 0") for n in first)
    assert {detached[n] for n in detached if n not in first} == {"agree"}
