"""The lean path (``Signature.bind``) reuses a call shape's checks, and only its own.

Semantics asserted on 2 gloo ranks, past the checked calls: a repeated call shape gives the
same values as before; a call whose arguments differ (a bad ``dim``, another ``sizes``, another
shape) is checked as a new call, so a local mistake still raises at once on the rank that made
it; debug mode checks every call across ranks again even for a call shape seen before; and a
destroyed group's call shapes are forgotten (a new default group is used, not the old one).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.distributed as dist

import distgrad as dg
from distgrad.collectives._signature import CHECKED_CALLS
from distgrad.errors import CollectiveArgumentError, CollectiveMismatchError
from distgrad.testing import run_on_ranks


def _lean(rank: int, world_size: int) -> None:
    x = torch.arange(6.0).view(3, 2) + 10 * rank
    for _ in range(CHECKED_CALLS + 2):  # past the checked calls, the same call shape
        out = dg.all_gather(x, sizes=[3, 3])
    want = torch.cat([torch.arange(6.0).view(3, 2), torch.arange(6.0).view(3, 2) + 10])
    assert torch.equal(out, want)
    with pytest.raises(CollectiveArgumentError, match="dim"):
        dg.all_gather(x, dim=5, sizes=[3, 3])  # a new call shape: its local check runs
    with pytest.raises(CollectiveArgumentError, match="sizes"):
        dg.all_gather(x, sizes=[2, 2])  # each rank has 3 rows: caught here, nothing sent
    mine = x[: 1 + rank]  # uneven: 1 and 2 rows, a new call shape with its own sizes
    assert dg.all_gather(mine, sizes=[1, 2]).shape == (3, 2)
    dg.set_debug(True)  # every call is checked across ranks again, seen call shapes too
    try:
        with pytest.raises(CollectiveMismatchError):
            dg.all_reduce(x if rank == 0 else x[:2])  # a shape mismatch, named, no hang
    finally:
        dg.set_debug(False)


def test_the_lean_path_reuses_a_call_shape_checks_and_nothing_else() -> None:
    run_on_ranks(_lean, 2)


def _forgotten(rank: int, world_size: int) -> float:
    x = torch.ones(4)
    for _ in range(CHECKED_CALLS + 2):
        dg.all_reduce(x)
    store = dist.distributed_c10d._get_default_store()  # type: ignore[attr-defined]
    dist.destroy_process_group()
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world_size)
    return float(dg.all_reduce(x * (rank + 1))[0])  # the same call shape, on the new group


def test_a_destroyed_group_call_shapes_are_forgotten() -> None:
    assert run_on_ranks(_forgotten, 2) == [3.0, 3.0]


def _alone(rank: int, world_size: int) -> None:
    x = torch.arange(6.0).view(3, 2)
    for _ in range(3):  # a group of one: the checks of a seen call shape are reused at once
        assert torch.equal(dg.all_to_all(x, input_sizes=[3], output_sizes=[3]), x)
    with pytest.raises(CollectiveArgumentError, match="input_sizes"):
        dg.all_to_all(x, input_sizes=[2], output_sizes=[3])  # a new call shape: checked


def test_a_group_of_one_reuses_a_call_shape_checks_too() -> None:
    run_on_ranks(_alone, 1)


def _before_and_after_init(rank: int, world_size: int, rendezvous: str) -> list[float]:
    x = torch.full((4,), float(rank + 1))
    alone = float(dg.all_reduce(x)[0])  # no process group yet: this process alone
    dist.init_process_group("gloo", init_method=rendezvous, rank=rank, world_size=world_size)
    try:
        together = float(dg.all_reduce(x)[0])  # the same call shape, now on the default group
    finally:
        dist.destroy_process_group()
    return [alone, together]


def test_a_call_shape_seen_alone_is_not_reused_once_a_group_exists(tmp_path: Path) -> None:
    """Semantics: before ``init_process_group`` a call is this process's alone (its own value);
    after it, the same call shape sums over the default group: 1 + 2."""
    rendezvous = f"file://{tmp_path / 'store'}"
    results = run_on_ranks(_before_and_after_init, 2, args=(rendezvous,), init="none")
    assert results == [[1.0, 3.0], [2.0, 3.0]]
