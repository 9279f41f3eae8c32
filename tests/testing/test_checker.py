"""The checker: it passes right code and names what is wrong with wrong code.

Each test runs a real distributed computation (gloo, 2 or 3 ranks) of a loss written for one
rank against the same function in one process on the whole batch. Inputs are float64.
"""

from __future__ import annotations

import traceback

import pytest
import torch

from distgrad.errors import (
    CheckArgumentError,
    DistgradError,
    GradientMismatchError,
    NotALossError,
    RankFailedError,
)
from distgrad.testing import GradReport, check_against_single_process
from tests._support import seeded
from tests.testing import losses_to_check as L


def _batch(rows: int = 6) -> dict[str, torch.Tensor]:
    gen = seeded(0)
    return {
        "q": torch.randn(rows, 4, dtype=torch.float64, generator=gen),
        "k": torch.randn(rows, 4, dtype=torch.float64, generator=gen),
    }


def _diagnosis(report: GradReport) -> str:
    return " ".join(report.diagnoses)


@pytest.mark.parametrize("world_size", [1, 2, 3])
def test_right_code_agrees_on_even_and_uneven_shards(world_size: int) -> None:
    """Local means (even shards) and N/B-scaled sums (any shards) meet the averaged contract."""
    report = check_against_single_process(L.right, _batch(6), world_size=world_size)
    assert report.ok, str(report)
    uneven = [7 - world_size + 1] + [1] * (world_size - 1)
    report = check_against_single_process(
        L.right_for_uneven_shards, _batch(7), world_size=world_size, shard_sizes=uneven
    )
    assert report.ok, str(report)


def test_a_local_mean_on_uneven_shards_is_flagged_with_the_weighting_fix() -> None:
    """With 4 and 3 rows, local means weight rows unequally: the forward already differs."""
    report = check_against_single_process(L.right, _batch(7), world_size=2)
    assert not report.ok
    assert "The shards are uneven ([4, 3] rows)" in _diagnosis(report)


def test_parameter_gradients_agree_under_ddp_averaging() -> None:
    """Parameter gradients averaged over ranks equal one process's; summed, they do not."""
    report = check_against_single_process(L.with_model, _batch(), world_size=2, model=L.Projector)
    assert report.ok, str(report)
    assert any(c.name == "param linear.weight" and c.ok for c in report.checks)
    assert report.params_agree == {"averaged": True, "summed": False}
    assert "combined by (averaged: yes; summed: no)" in str(report)
    assert report.contracts == {"averaged": True, "summed": False}
    assert "contract: the gradients averaged over ranks (as DDP does) equal" in str(report)


def test_a_0_dim_input_goes_whole_to_every_rank_and_is_combined_like_a_parameter() -> None:
    """The temperature's gradients, averaged over ranks, equal the single-process one."""
    batch = {**_batch(), "temperature": torch.tensor(0.5, dtype=torch.float64)}
    report = check_against_single_process(L.with_temperature, batch, world_size=2)
    assert report.ok, str(report)
    assert [c.rank for c in report.checks if c.name == "temperature"] == [None]


def test_local_only_gather_on_a_global_loss_is_diagnosed_as_one_over_n() -> None:
    """Every rank computes the same global loss; a local-only backward gives exactly 1/N."""
    report = check_against_single_process(L.global_local_only, _batch(), world_size=2)
    assert not report.ok
    assert "scaled by 1/2" in _diagnosis(report)
    assert "local slice" in _diagnosis(report)
    assert check_against_single_process(L.global_right, _batch(), world_size=2).ok


def test_local_only_gather_on_a_contrastive_loss_misses_cross_rank_terms() -> None:
    """InfoNCE via a local-only gather: wrong by no factor; the probe finds no cross-rank flow."""
    report = check_against_single_process(L.local_only, _batch(), world_size=2)
    assert not report.ok
    assert report.contracts == {"averaged": False, "summed": False}
    assert "misses the terms that flow through other ranks" in _diagnosis(report)


def test_overwriting_the_local_slot_misses_cross_rank_terms() -> None:
    """Raw all_gather with the local slot put back: other ranks' rows carry no gradient home."""
    report = check_against_single_process(L.overwrite, _batch(), world_size=3)
    assert not report.ok
    assert "misses the terms that flow through other ranks" in _diagnosis(report)


def test_a_raw_all_reduce_in_the_loss_is_diagnosed() -> None:
    """A raw torch.distributed.all_reduce of a statistic hides its gradient from autograd."""
    report = check_against_single_process(L.raw_all_reduce, _batch(), world_size=2)
    assert not report.ok
    assert "misses the terms that flow through other ranks" in _diagnosis(report)


def test_a_backward_that_routes_slices_to_the_wrong_rank_is_named() -> None:
    """The summed gradient is right but goes to the next rank: the owner of the rows is named."""
    report = check_against_single_process(L.global_misrouted, _batch(), world_size=2)
    assert not report.ok
    assert "rank 0 received the gradient of rank 1's rows of k" in _diagnosis(report)


def test_losses_that_are_shares_get_loss_scaling_advice_under_ddp() -> None:
    """Shares meet the summed contract; under DDP averaging they give 1/N, fixed by scaling by N."""
    report = check_against_single_process(L.share, _batch(), world_size=2)
    assert not report.ok
    assert "multiply each rank's loss by 2" in _diagnosis(report)
    assert report.contracts == {"averaged": False, "summed": True}
    assert "contract: the gradients summed over ranks equal one process's" in str(report)
    assert check_against_single_process(L.share, _batch(), world_size=2, gradients="summed").ok


def test_summing_gradients_of_a_global_loss_is_diagnosed_as_n_times() -> None:
    """A global loss on every rank, gradients summed: N times too large."""
    report = check_against_single_process(
        L.global_right, _batch(), world_size=2, gradients="summed"
    )
    assert not report.ok
    assert "scaled by 2" in _diagnosis(report)
    assert "divide each rank's loss by 2" in _diagnosis(report)


def test_a_forward_that_already_differs_is_said_first() -> None:
    """Labels without the rank offset: the losses fit no convention, said before any gradient."""
    report = check_against_single_process(L.wrong_offsets, _batch(), world_size=2)
    assert not report.ok
    assert _diagnosis(report).startswith("the forward pass already differs")


def test_a_mismatch_on_some_ranks_only_names_them() -> None:
    """A gradient doubled on rank 1 of 3: ranks 0 and 2 agree, rank 1 does not."""
    report = check_against_single_process(L.scaled_on_rank_1, _batch(), world_size=3)
    assert not report.ok
    assert "agree on ranks [0, 2] but not on ranks [1]" in _diagnosis(report)


def test_a_gradient_cut_on_one_rank_is_named() -> None:
    """Rank 1's keys are gathered but detached from its leaf: no gradient reaches them."""
    report = check_against_single_process(L.cut_on_rank_1, _batch(), world_size=2)
    assert not report.ok
    assert "no gradient reaches k on rank 1" in _diagnosis(report)


def test_a_mismatch_with_no_simple_pattern_says_so_and_points_at_the_table() -> None:
    """Cross-rank gradients do flow (so not local-only), but no factor or rank explains it."""
    report = check_against_single_process(L.scaled_by_rank, _batch(), world_size=2)
    assert not report.ok
    assert "by no simple factor" in _diagnosis(report)


def test_non_finite_values_are_reported() -> None:
    """NaN on rank 1 only: reported as non-finite, while the single-process run is finite."""
    report = check_against_single_process(L.nan_on_rank_1, _batch(), world_size=2)
    assert not report.ok
    assert "non-finite" in _diagnosis(report)


def test_a_mismatch_raises_with_a_per_rank_table_on_request() -> None:
    """raise_on_mismatch=True raises GradientMismatchError whose text holds the table."""
    with pytest.raises(GradientMismatchError) as info:
        check_against_single_process(
            L.with_model_local_only,
            _batch(),
            world_size=2,
            model=L.Projector,
            raise_on_mismatch=True,
        )
    text = str(info.value)
    assert "MISMATCH" in text and "param linear.weight" in text
    assert any(line.startswith("tensor") and "max abs err" in line for line in text.splitlines())


def test_bad_arguments_raise_before_starting_processes() -> None:
    """Argument errors are distgrad errors (and ValueError/TypeError, as before) naming the
    offending value, raised before any rank starts."""
    with pytest.raises(CheckArgumentError, match="world_size must be at least 1"):
        check_against_single_process(L.right, _batch(), world_size=0)
    with pytest.raises(CheckArgumentError, match="same length along shard_dim"):
        check_against_single_process(L.right, {"q": torch.ones(3, 4), "k": torch.ones(4, 4)})
    with pytest.raises(CheckArgumentError, match="shard_sizes must be 2"):
        check_against_single_process(L.right, _batch(), shard_sizes=[1, 2])
    with pytest.raises(CheckArgumentError, match=r"k must be a torch\.Tensor, got list"):
        check_against_single_process(L.right, {"q": torch.ones(4, 2), "k": [1.0]})
    with pytest.raises(NotALossError, match="scalar tensor"):
        check_against_single_process(lambda q, k: q, _batch(), world_size=1)
    for error, builtin in ((CheckArgumentError, ValueError), (NotALossError, TypeError)):
        assert issubclass(error, DistgradError) and issubclass(error, builtin)


def _reversed_batch(widths: tuple[int, int] = (4, 4)) -> dict[str, torch.Tensor]:
    """The batch as a dict whose order (k, q) differs from the functions' (q, k)."""
    q, k = _batch()["q"][:, : widths[0]], _batch()["k"][:, : widths[1]]
    return {"k": k, "q": q}


def test_a_dict_of_inputs_binds_by_parameter_name_whatever_its_order() -> None:
    """widths(q, k) with q [6, 3] and k [6, 4], given as {"k": ..., "q": ...}."""
    batch = _reversed_batch(widths=(3, 4))
    report = check_against_single_process(L.widths, batch, world_size=2)
    assert report.ok, str(report)
    expected = L.widths(q=batch["q"], k=batch["k"])
    assert report.reference_loss == pytest.approx(float(expected), rel=1e-12)
    assert [c.name for c in report.checks if c.rank == 0] == ["k", "q"]


def test_a_list_of_inputs_stays_positional() -> None:
    q, k = _batch()["q"][:, :3], _batch()["k"]
    report = check_against_single_process(L.widths, [k, q], world_size=1)
    assert report.reference_loss == pytest.approx(float(L.widths(k, q)), rel=1e-12)
    assert [c.name for c in report.checks] == ["input 0", "input 1"]


def test_the_headline_diagnosis_describes_only_the_rows_it_applies_to() -> None:
    """A bug in the k path only, inputs given as {"k", "q"}: k's rows fail by exactly 1/2 on
    every rank and q's agree, so the diagnosis names k and says q agrees."""
    report = check_against_single_process(L.k_local_only, _reversed_batch(), world_size=2)
    assert not report.ok
    assert {c.name for c in report.checks if not c.ok} == {"k"}
    assert {c.name for c in report.checks if c.ok} == {"q"}
    diagnosis = _diagnosis(report)
    assert diagnosis.startswith("the gradient of k (q agrees) is scaled by 1/2: the backward")
    assert "every gradient" not in diagnosis


def test_a_dict_whose_keys_are_not_parameters_is_refused_before_starting_processes() -> None:
    with pytest.raises(CheckArgumentError, match=r"cannot take the inputs x, k by name") as info:
        check_against_single_process(L.right, {"x": torch.ones(4, 2), "k": torch.ones(4, 2)})
    assert "pass a list or tuple to bind the inputs by position" in str(info.value)


def test_the_ranks_run_in_debug_mode() -> None:
    """Rank 0 gathers from another line than rank 1: only debug mode's call-site check sees it."""
    with pytest.raises(RankFailedError, match="debug mode: ranks made this call from different"):
        check_against_single_process(L.calls_from_two_places, _batch(), world_size=2)
    report = check_against_single_process(
        L.calls_from_two_places, _batch(), world_size=2, debug=False
    )
    assert report.ok, str(report)


def test_an_unguarded_get_world_size_in_the_reference_run_gets_a_hint() -> None:
    with pytest.raises(ValueError, match="process group has not been initialized") as info:
        check_against_single_process(L.unguarded_world_size, _batch(), world_size=2)
    text = "".join(traceback.format_exception(info.value))
    assert "the checker's single-process reference runs the function in this process" in text
    assert "dist.get_world_size() if dist.is_initialized() else 1" in text
