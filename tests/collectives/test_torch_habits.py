"""What torch users write works, or says what to write instead.

``dist.ReduceOp`` values are accepted wherever an op name is (every torch user writes
``dist.all_reduce(x, op=dist.ReduceOp.SUM)``), with the same results; a non-group passed as
``group`` (an int from a ported ``all_gather_single(x, 0, group)``, a list of ranks) is a
distgrad error naming the parameter and what to pass.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

import distgrad as dg
from distgrad.errors import CollectiveArgumentError
from distgrad.testing import run_on_ranks

TORCH_OPS = {
    "sum": dist.ReduceOp.SUM,
    "avg": dist.ReduceOp.AVG,
    "prod": dist.ReduceOp.PRODUCT,
    "max": dist.ReduceOp.MAX,
    "min": dist.ReduceOp.MIN,
}


def _reduce_ops_by_name_and_by_torch_value(rank: int, world_size: int) -> list[str]:
    x = torch.tensor([1.0, -2.0, 3.0]) * (rank + 1)
    differ = []
    for name, op in TORCH_OPS.items():
        pairs = [
            (dg.all_reduce(x, op), dg.all_reduce(x, name)),
            (
                dg.reduce_scatter(x.repeat(world_size), op),
                dg.reduce_scatter(x.repeat(world_size), name),
            ),
            (dg.reduce(x, 0, op), dg.reduce(x, 0, name)),
        ]
        differ += [name for by_torch, by_name in pairs if not torch.equal(by_torch, by_name)]
    return differ


def test_torch_reduce_ops_are_accepted_and_mean_the_same_as_names() -> None:
    assert run_on_ranks(_reduce_ops_by_name_and_by_torch_value, 2) == [[], []]


def test_an_unsupported_torch_reduce_op_is_refused_by_name() -> None:
    with pytest.raises(CollectiveArgumentError, match=r"op must be one of .* got '<.*BAND>'"):
        dg.all_reduce(torch.ones(2), dist.ReduceOp.BAND)


@pytest.mark.parametrize(
    ("group", "hint"),
    [
        (0, "group is all_gather's second positional argument .* pass dim=0"),
        ([0, 1], r"torch.distributed.new_group\(\[0, 1\]\)"),
        ("world", "got str 'world'"),
    ],
)
def test_a_non_group_as_group_names_the_parameter_and_what_to_pass(
    group: object, hint: str
) -> None:
    with pytest.raises(
        CollectiveArgumentError,
        match=r"all_gather: group must be a torch\.distributed ProcessGroup or None",
    ) as info:
        dg.all_gather(torch.ones(2), group)  # type: ignore[arg-type]
    assert info.match(hint)
