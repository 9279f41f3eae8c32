"""Every loss, sharded over 1 to 4 ranks (even, uneven, an empty rank), against the same loss
in one process on the concatenated global batch.

Semantics asserted (docs/losses.md): each rank's loss value is the global loss; the input
gradients are world_size times the single-process ones and the DDP-averaged parameter
gradients (encoder and the learnable temperature/scale/bias) equal the single-process ones.
Checked with dg.testing.check_against_single_process in float64 (its default tolerance,
rtol 1e-7, for the different reduction order across ranks), on processes and simulated
(``simulate=True``: every rank in this process), simulated also at 6 and 8 ranks and, in the
slow tier, at 64.
"""

from __future__ import annotations

import pytest
import torch
from torch.nn.parallel import DistributedDataParallel

import distgrad as dg
from distgrad.errors import CollectiveArgumentError, CollectiveMismatchError
from distgrad.testing import check_against_single_process, run_on_ranks
from tests._support import FLOAT64_ROUNDING, seeded
from tests.losses import cases


def _views(rows: int) -> dict[str, torch.Tensor]:
    gen = seeded(1)
    base = torch.randn(rows, 5, dtype=torch.float64, generator=gen)
    return {
        "a": base + 0.1 * torch.randn(rows, 5, dtype=torch.float64, generator=gen),
        "b": base + 0.1 * torch.randn(rows, 5, dtype=torch.float64, generator=gen),
    }


SHARDINGS: list[tuple[int, list[int] | None]] = [
    (1, None),
    (2, [4, 3]),
    (3, [3, 2, 2]),
    (4, [1, 3, 2, 1]),
    (2, [7, 0]),
]
# Simulated, every rank costs a pass over its rows in this process, not a process start.
SIMULATED = [*SHARDINGS, (6, [2, 0, 1, 1, 2, 1]), (8, [1, 1, 0, 1, 1, 1, 1, 1])]


def _check_every_sharding(
    loss: object, shardings: list[tuple[int, list[int] | None]], simulate: bool
) -> None:
    for world_size, sizes in shardings:
        rows = 7 if sizes is None else sum(sizes)
        report = check_against_single_process(
            loss,
            _views(rows),
            world_size=world_size,
            shard_sizes=sizes,
            model=cases.Learnable,  # type: ignore[arg-type]
            simulate=simulate,
        )
        assert report.ok, f"{world_size} ranks, shards {sizes}:\n{report}"
        assert all(abs(x - report.reference_loss) < 1e-9 for x in report.losses)


@pytest.mark.parametrize("loss", cases.ALL, ids=lambda f: f.__name__)
def test_loss_and_gradients_equal_single_process_on_any_sharding(loss: object) -> None:
    _check_every_sharding(loss, SHARDINGS, simulate=False)


@pytest.mark.parametrize("loss", cases.ALL, ids=lambda f: f.__name__)
def test_loss_and_gradients_equal_single_process_simulated(loss: object) -> None:
    _check_every_sharding(loss, SIMULATED, simulate=True)


@pytest.mark.slow
@pytest.mark.parametrize("loss", cases.ALL, ids=lambda f: f.__name__)
def test_loss_and_gradients_equal_single_process_simulated_at_64_ranks(loss: object) -> None:
    _check_every_sharding(loss, [(64, [1, 2] * 32)], simulate=True)


def _ddp_step(rank: int, world_size: int) -> dict[str, torch.Tensor]:
    model = cases.Learnable()
    # log_scale and bias are not used by NT-Xent; DDP must be told, or their bucket never fires.
    ddp = DistributedDataParallel(model, find_unused_parameters=True)
    optimizer = torch.optim.SGD(ddp.parameters(), lr=0.5)
    views = _views(8)
    rows = slice(rank * 4, (rank + 1) * 4)
    z1, z2, temperature = ddp(views["a"][rows], views["b"][rows])
    loss = dg.losses.nt_xent(z1, z2, temperature=temperature)
    loss.backward()
    optimizer.step()
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def test_one_ddp_step_equals_one_single_process_step() -> None:
    """Identical parameters after one SGD step: DDP on 2 ranks vs one process, float64."""
    model = cases.Learnable()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    views = _views(8)
    z1, z2, temperature = model(views["a"], views["b"])
    dg.losses.nt_xent(z1, z2, temperature=temperature).backward()
    optimizer.step()
    for state in run_on_ranks(_ddp_step, 2):
        for name, value in model.state_dict().items():
            torch.testing.assert_close(state[name], value, **FLOAT64_ROUNDING)


def _bad_inputs(rank: int, world_size: int) -> list[str]:
    seen = []
    calls = [
        lambda: dg.losses.nt_xent(torch.ones(3, 4), torch.ones(3, 4), temperature=0.0),
        lambda: dg.losses.info_nce(torch.ones(3, 4), torch.ones(3, 4), temperature=float("nan")),
        lambda: dg.losses.clip_loss(torch.ones(3, 4), torch.ones(3 if rank == 0 else 2, 4)),
        lambda: dg.losses.siglip_loss(torch.ones(3, 4 + rank), torch.ones(3, 4 + rank)),
        lambda: dg.losses.barlow_twins(torch.ones(3, 4), torch.ones(3, 5)),
        # rank 1 says it has 4 rows but holds 3; rank 0 passes a list of the wrong length
        lambda: dg.losses.info_nce(torch.ones(3, 4), torch.ones(3, 4), sizes=[3, 4]),
        lambda: dg.losses.nt_xent(
            torch.ones(3, 4), torch.ones(3, 4), sizes=[3] if rank == 0 else [3, 3]
        ),
    ]
    for call in calls:
        try:
            call()
        except (CollectiveArgumentError, CollectiveMismatchError) as exc:
            seen.append(str(exc))
        else:
            seen.append("no error")
    return seen


def test_bad_input_raises_a_clear_error_on_every_rank() -> None:
    per_rank = run_on_ranks(_bad_inputs, 2, timeout=30)
    for seen in per_rank:
        assert "temperature must be finite and positive, got 0.0" in seen[0]
        assert "temperature must be finite and positive, got nan" in seen[1]
        assert "rank 1: image and text must have the same shape" in seen[2]
        assert "ranks disagree on the shape outside dim 0" in seen[3]
        assert "view1 and view2 must have the same shape" in seen[4]
        sizes = "rank 1: sizes[1] must be 3, the entries of this rank's key along dim 0, got 4"
        assert sizes in seen[5]  # the words of every op's sizes
        assert "rank 0: sizes must be 2 non-negative ints (one per rank), got [3]" in seen[6]
