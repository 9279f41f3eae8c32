"""The checker: it passes right code and names what is wrong with wrong code.

Each test runs a real distributed computation (gloo, 2 or 3 ranks) of a loss written for one
rank against the same function in one process on the whole batch. Inputs are float64.
"""

from __future__ import annotations

import pytest
import torch

from distgrad.errors import GradientMismatchError
from distgrad.testing import GradReport, check_against_single_process
from tests.testing import losses_to_check as L


def _batch(rows: int = 6) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
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
    """Argument errors are ValueError/TypeError with the offending value, before any rank starts."""
    with pytest.raises(ValueError, match="world_size must be at least 1"):
        check_against_single_process(L.right, _batch(), world_size=0)
    with pytest.raises(ValueError, match="same length along shard_dim"):
        check_against_single_process(L.right, {"q": torch.ones(3, 4), "k": torch.ones(4, 4)})
    with pytest.raises(ValueError, match="shard_sizes must be 2"):
        check_against_single_process(L.right, _batch(), shard_sizes=[1, 2])
    with pytest.raises(TypeError, match="scalar tensor"):
        check_against_single_process(lambda q, k: q, _batch(), world_size=1)
