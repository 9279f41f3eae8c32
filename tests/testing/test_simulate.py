"""simulate=True: the checkers run every rank in this process (torch's LocalTensorMode).

Semantics asserted: for every case of tests/testing/ (right code and each planted mistake),
the simulated check reaches the same verdict as the check on processes (same ``ok``, same
diagnoses, same contracts, the same per-rank losses and gradient errors to float64
rounding); code that one Python program cannot stand for (a call made from different lines
on different ranks, uneven shards, distgrad's losses and dg.parallel layers, which read the
rank as a Python int; DDP, FSDP2, a process group already in this process) is refused with
CheckArgumentError saying to drop simulate, never answered.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch

import distgrad as dg
from distgrad.errors import CheckArgumentError
from distgrad.testing import GradReport, check_against_single_process, check_parallel_model
from distgrad.testing.launch import run_on_ranks
from tests._support import seeded
from tests.testing import losses_to_check as L
from tests.testing import models_to_check as m


def _batch(rows: int = 6) -> dict[str, torch.Tensor]:
    gen = seeded(0)
    return {
        "q": torch.randn(rows, 4, dtype=torch.float64, generator=gen),
        "k": torch.randn(rows, 4, dtype=torch.float64, generator=gen),
    }


_T = torch.tensor(0.5, dtype=torch.float64)
# (function, inputs, keyword arguments) for every case of test_checker.py that reaches a report.
CASES: dict[str, tuple[Callable[..., Any], Any, dict[str, Any]]] = {
    "right 1 rank": (L.right, _batch(), {"world_size": 1}),
    "right 2 ranks": (L.right, _batch(), {}),
    "right 3 ranks": (L.right, _batch(), {"world_size": 3}),
    "with a model": (L.with_model, _batch(), {"model": L.Projector}),
    "a 0-dim input": (L.with_temperature, {**_batch(), "temperature": _T}, {}),
    "global loss, local-only gather": (L.global_local_only, _batch(), {}),
    "global loss, right": (L.global_right, _batch(), {}),
    "contrastive, local-only gather": (L.local_only, _batch(), {}),
    "overwriting the local slot": (L.overwrite, _batch(), {"world_size": 3}),
    "raw all_reduce": (L.raw_all_reduce, _batch(), {}),
    "misrouted backward": (L.global_misrouted, _batch(), {}),
    "shares under DDP": (L.share, _batch(), {}),
    "shares summed": (L.share, _batch(), {"gradients": "summed"}),
    "global loss summed": (L.global_right, _batch(), {"gradients": "summed"}),
    "wrong offsets": (L.wrong_offsets, _batch(), {}),
    "scaled on rank 1": (L.scaled_on_rank_1, _batch(), {"world_size": 3}),
    "cut on rank 1": (L.cut_on_rank_1, _batch(), {}),
    "scaled by rank": (L.scaled_by_rank, _batch(), {}),
    "NaN on rank 1": (L.nan_on_rank_1, _batch(), {}),
    "model, local-only gather": (L.with_model_local_only, _batch(), {"model": L.Projector}),
    "a bug in k only": (L.k_local_only, _batch(), {}),
    "widths by name": (L.widths, {"k": _batch()["k"], "q": _batch()["q"][:, :3]}, {}),
    "calls from two places, debug off": (L.calls_from_two_places, _batch(), {"debug": False}),
}


def _same_verdict(simulated: GradReport, processes: GradReport) -> None:
    assert simulated.ok == processes.ok, f"{simulated}\n---\n{processes}"
    assert simulated.diagnoses == processes.diagnoses
    assert simulated.contracts == processes.contracts
    assert simulated.params_agree == processes.params_agree
    assert simulated.losses == pytest.approx(processes.losses, rel=1e-12, nan_ok=True)
    for a, b in zip(simulated.checks, processes.checks, strict=True):
        assert (a.name, a.rank, a.ok, a.note) == (b.name, b.rank, b.ok, b.note)
        # Errors that are rounding agree to rounding; real errors to many digits.
        assert a.max_abs_error == pytest.approx(b.max_abs_error, rel=1e-6, abs=1e-13, nan_ok=True)


# The raw all_reduce case calls dist.all_reduce on a tensor that requires grad: torch warns
# (its autograd fallback) in the rank that does it, here this process.
@pytest.mark.filterwarnings("ignore:.*an autograd kernel was not registered:UserWarning")
@pytest.mark.parametrize("case", CASES)
def test_every_checker_case_gets_the_same_verdict_simulated_and_on_processes(case: str) -> None:
    fn, inputs, kwargs = CASES[case]
    torch.manual_seed(0)  # a model is made from torch's generator: the same in both checks
    simulated = check_against_single_process(fn, inputs, simulate=True, **kwargs)
    torch.manual_seed(0)
    processes = check_against_single_process(fn, inputs, **kwargs)
    _same_verdict(simulated, processes)


def test_a_call_made_from_two_places_is_refused_not_answered() -> None:
    """Processes: debug mode names the call made from different lines. Simulated: one program
    cannot make it from two lines at once; the per-rank runs differ, so it is refused."""
    with pytest.raises(CheckArgumentError, match="the ranks take different paths") as info:
        check_against_single_process(L.calls_from_two_places, _batch(), simulate=True)
    assert "drop simulate=True" in str(info.value)


@pytest.mark.parametrize(
    ("fn", "shards"),
    [
        (L.right, [4, 3]),
        (L.right_for_uneven_shards, [6, 1]),
        (L.right_for_uneven_shards, [5, 0, 2]),
    ],
    ids=["even-only code on [4, 3]", "[6, 1]", "[5, 0, 2]"],
)
def test_uneven_shards_get_the_same_verdict(fn: Callable[..., Any], shards: list[int]) -> None:
    """Each rank's own rows: a LocalTensor whose ranks' shapes differ, exchanged by the
    functional collectives with each rank's sizes (the mean of local means is wrong on [4, 3]:
    both checks say so)."""
    inputs, n = _batch(sum(shards)), len(shards)
    simulated = check_against_single_process(
        fn, inputs, world_size=n, shard_sizes=shards, simulate=True
    )
    processes = check_against_single_process(fn, inputs, world_size=n, shard_sizes=shards)
    _same_verdict(simulated, processes)


def _clip(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return dg.losses.clip_loss(a, b)


def _clip_ring(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return dg.losses.clip_loss(a, b, block_size=2)


@pytest.mark.parametrize(
    ("fn", "shards"),
    [(_clip, [5, 0, 3]), (_clip_ring, [3, 3, 3])],
    ids=["dense, uneven", "ring, even"],
)
def test_distgrad_losses_get_the_same_verdict(
    fn: Callable[..., torch.Tensor], shards: list[int]
) -> None:
    """The losses write a rank's rows as arithmetic on the rank (first_row, own_rows), so one
    simulated run holds every rank's; tests/losses runs every loss's exact tests this way."""
    inputs = {"a": _batch(sum(shards))["q"], "b": _batch(sum(shards))["k"]}
    kwargs: dict[str, Any] = {"world_size": len(shards), "shard_sizes": shards}
    simulated = check_against_single_process(fn, inputs, simulate=True, **kwargs)
    _same_verdict(simulated, check_against_single_process(fn, inputs, **kwargs))


def test_a_ring_loss_on_uneven_shards_is_refused_not_answered() -> None:
    """The ring kernel loops over the blocks of each rank's own rows: a Python path per rank,
    which one program cannot take for all; the per-rank runs disagree, and the error says
    where the rank was first needed as one value."""
    inputs = {"a": _batch(7)["q"], "b": _batch(7)["k"]}
    with pytest.raises(CheckArgumentError, match=r"first at _blockwise\.py:\d+") as info:
        check_against_single_process(
            _clip_ring, inputs, world_size=3, shard_sizes=[3, 0, 4], simulate=True
        )
    assert "drop simulate=True" in str(info.value)


@pytest.mark.parametrize(
    ("parallelize", "loss", "why"),
    [
        (m.fsdp, m.dp_loss, "FSDP2"),
        (m.ddp, m.dp_loss, "parallelize failed"),
    ],
    ids=["fsdp2", "ddp"],
)
def test_the_model_checker_refuses_what_does_not_simulate(
    parallelize: Any, loss: Any, why: str
) -> None:
    with pytest.raises(CheckArgumentError, match=why):
        check_parallel_model(
            m.make_encoder, parallelize, m.dp_batch(), loss, 2, data=("dp",), simulate=True
        )


def test_dg_parallel_layers_are_refused_not_answered() -> None:
    """ColumnParallelLinear.from_linear slices the weight by the rank as a Python int."""
    with pytest.raises(CheckArgumentError, match="drop simulate=True"):
        check_parallel_model(
            m.make_tp_net, m.tp_right, m.tp_batch(), m.tp_loss, 2, mesh_dim_names=("tp",),
            simulate=True,
        )  # fmt: skip


def _check_inside_a_job(rank: int, world_size: int) -> str:
    try:
        check_against_single_process(L.right, _batch(), simulate=True)
    except CheckArgumentError as exc:
        return str(exc)
    return "no error"


def test_a_process_group_already_in_the_process_is_refused() -> None:
    """Simulating needs the process to itself: a rank of a real job is told so."""
    messages = run_on_ranks(_check_inside_a_job, 2)
    assert all("one is initialised here" in text for text in messages), messages


def _fused_cross_entropy(q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    keys = dg.all_gather(k)
    labels = torch.arange(q.shape[0]) + L._offset(q.shape[0])
    return torch.nn.functional.cross_entropy(q @ keys.T, labels)


def test_torchs_fused_cross_entropy_on_uneven_shards_is_refused_not_answered() -> None:
    """torch's nll_loss has no rule for a row count that differs between simulated ranks
    (docs/checker.md: write it as log_softmax and a pick); refused, never answered."""
    with pytest.raises(CheckArgumentError, match="drop simulate=True"):
        check_against_single_process(
            _fused_cross_entropy, _batch(7), shard_sizes=[4, 3], simulate=True
        )
