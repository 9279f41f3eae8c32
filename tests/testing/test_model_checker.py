"""check_parallel_model on planted mistakes: each gets its diagnosis, the right versions agree.

Semantics asserted (float64, one SGD step, the checker's default tolerances): tensor parallel
over a 1-D "tp" mesh of 2 ranks (the sum contract: each rank back-propagates its share, a
replicated parameter's gradient summed over TP): the right version agrees on every parameter;
with a sequence-parallel LayerNorm whose gradients are never summed over TP, its weight and
bias are "missing a reduction over mesh dim 'tp'", and a row-parallel bias added on every TP
rank is "scaled by 2 (the size of mesh dim 'tp')", while the other parameters agree. Data
parallel over a 2-rank "dp" mesh (InfoNCE over the global batch, gradients averaged by FSDP2
or DDP): the right version agrees; a loss averaged twice is "scaled by 1/2" on every
parameter; a plain GatherLayer is "wrong" on every parameter (no factor or reduction fits).
"""

from __future__ import annotations

import pytest

from distgrad.errors import CheckArgumentError, GradientMismatchError
from distgrad.testing import ModelReport, check_parallel_model
from tests.testing import models_to_check as m


def _grad_diagnoses(report: ModelReport) -> dict[str, str]:
    return {c.name: c.diagnosis for c in report.checks if c.what == "grad"}


def test_tensor_parallel_right_version_agrees() -> None:
    report = check_parallel_model(
        m.make_tp_net, m.tp_right, m.tp_batch(), m.tp_loss, 2, mesh_dim_names=("tp",)
    )
    assert report.ok, str(report)
    assert set(report.diagnoses.values()) == {"agree"}


def test_tensor_parallel_mistakes_get_their_diagnoses() -> None:
    report = check_parallel_model(
        m.make_tp_net, m.tp_wrong, m.tp_batch(), m.tp_loss, 2, mesh_dim_names=("tp",)
    )
    grads = _grad_diagnoses(report)
    for name in ("norm.weight", "norm.bias"):
        assert grads[name].startswith("missing a reduction over mesh dim 'tp'"), str(report)
    assert grads["fc2.bias"] == "scaled by 2 (the size of mesh dim 'tp')", str(report)
    for name in ("fc1.weight", "fc1.bias", "fc2.weight"):
        assert grads[name] == "agree", str(report)
    with pytest.raises(GradientMismatchError, match=r"norm\.weight: grad: missing a reduction"):
        report.raise_if_mismatch()


@pytest.mark.parametrize("parallelize", [m.fsdp, m.ddp], ids=["fsdp2", "ddp"])
def test_data_parallel_right_version_agrees(parallelize: object) -> None:
    report = check_parallel_model(
        m.make_encoder,
        parallelize,
        m.dp_batch(),
        m.dp_loss,
        2,
        data=("dp",),  # type: ignore[arg-type]
    )
    assert report.ok, str(report)


def test_a_loss_averaged_twice_is_scaled_by_one_over_the_dp_size() -> None:
    report = check_parallel_model(
        m.make_encoder, m.fsdp, m.dp_batch(), m.dp_loss_averaged_twice, 2, data=("dp",)
    )
    grads = _grad_diagnoses(report)
    assert set(grads.values()) == {"scaled by 1/2 (the size of mesh dim 'dp')"}, str(report)


def test_a_plain_gather_layer_is_wrong_by_no_factor() -> None:
    report = check_parallel_model(
        m.make_encoder, m.ddp, m.dp_batch(), m.dp_loss_gather_layer, 2, data=("dp",)
    )
    grads = _grad_diagnoses(report)
    assert all(
        d.startswith("wrong: no reduction over a mesh dim or factor") for d in grads.values()
    ), str(report)


def test_arguments_it_cannot_use_are_refused_before_any_process_starts() -> None:
    with pytest.raises(
        CheckArgumentError, match=r"mesh_shape \(3, 2\) must multiply to world_size 4"
    ):
        check_parallel_model(
            m.make_tp_net, m.tp_right, m.tp_batch(), m.tp_loss, 4, mesh_shape=(3, 2)
        )
    with pytest.raises(CheckArgumentError, match=r"data names mesh dims \['dp'\]"):
        check_parallel_model(
            m.make_tp_net,
            m.tp_right,
            m.tp_batch(),
            m.tp_loss,
            2,
            mesh_dim_names=("tp",),
            data=("dp",),
        )
