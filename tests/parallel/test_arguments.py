"""Arguments the patterns cannot use raise a CollectiveArgumentError (a DistgradError and a
ValueError) naming the function, the (group) rank, what it expected and what it got, before any
communication, in the words of the argument's declared field (the same words a collective or a
loss uses for the same argument); one process, no process group (milliseconds)."""

from __future__ import annotations

import pytest
import torch

from distgrad import parallel as P
from distgrad.errors import CollectiveArgumentError

DT = torch.float64


def test_route_refuses_a_k_it_cannot_choose() -> None:
    with pytest.raises(
        CollectiveArgumentError,
        match=r"route on rank 0: k must be between 1 and the 4 experts, got 5",
    ):
        P.route(torch.zeros(3, 4, dtype=DT), 5)


def test_route_refuses_logits_that_are_not_tokens_by_experts() -> None:
    with pytest.raises(
        ValueError, match=r"route on rank 0: logits must be \[tokens, experts\], got shape \(3,\)"
    ):
        P.route(torch.zeros(3, dtype=DT), 1)


def test_route_refuses_an_expert_split_that_does_not_add_up() -> None:
    with pytest.raises(
        ValueError, match=r"experts_per_rank must add up to 4, the number of experts, got \[3\]"
    ):
        P.route(torch.zeros(3, 4, dtype=DT), 1, experts_per_rank=[3])


def test_route_refuses_a_negative_capacity() -> None:
    with pytest.raises(
        CollectiveArgumentError, match=r"capacity must be None or at least 0, got -1"
    ):
        P.route(torch.zeros(3, 4, dtype=DT), 1, capacity=-1)


def test_route_with_capacity_zero_drops_everything_and_combine_gives_zeros() -> None:
    x = torch.randn(3, 2, dtype=DT)
    routing = P.route(torch.randn(3, 4, dtype=DT), 2, capacity=0)
    assert not routing.kept.any()
    rows = P.dispatch(x, routing)
    assert rows.shape == (0, 2)
    assert torch.equal(P.combine(rows, routing), torch.zeros(3, 2, dtype=DT))


def test_combine_refuses_outputs_with_other_rows_than_dispatch_returned() -> None:
    routing = P.route(torch.randn(3, 4, dtype=DT), 1)
    with pytest.raises(
        CollectiveArgumentError,
        match=r"combine on rank 0: y must have the 3 rows dispatch returned",
    ):
        P.combine(torch.zeros(2, 5, dtype=DT), routing)


def test_ring_attention_refuses_mismatched_blocks() -> None:
    q, k = torch.zeros(2, 5, 4, dtype=DT), torch.zeros(2, 6, 4, dtype=DT)
    with pytest.raises(
        CollectiveArgumentError, match=r"ring_attention on rank 0: q, k and v must share every dim"
    ):
        P.ring_attention(q, k, k)
    with pytest.raises(
        CollectiveArgumentError, match=r"q and k must have the same last dim, got 4 and 3"
    ):
        P.ring_attention(q, q[..., :3], q)


def test_ring_attention_refuses_sizes_that_do_not_name_this_rank_s_length() -> None:
    q = torch.zeros(2, 5, 4, dtype=DT)
    with pytest.raises(
        CollectiveArgumentError,
        match=r"sizes\[0\] must be 5, the entries of this rank's q along dim -2, got 4",
    ):
        P.ring_attention(q, q, q, sizes=[4])


def test_sync_batch_norm_refuses_one_value_per_channel_in_training() -> None:
    with pytest.raises(
        CollectiveArgumentError, match=r"expected more than 1 value per channel over all ranks"
    ):
        P.SyncBatchNorm(3)(torch.zeros(1, 3))


def test_sync_batch_norm_refuses_an_input_without_channels() -> None:
    with pytest.raises(
        CollectiveArgumentError,
        match=r"sync_batch_norm on rank 0: x must be \[batch, channels, \.\.\.\], got shape \(3,\)",
    ):
        P.SyncBatchNorm(3)(torch.zeros(3))


def test_parallel_linears_refuse_an_unknown_objective() -> None:
    x, w = torch.zeros(2, 3, dtype=DT), torch.zeros(4, 3, dtype=DT)
    for layer in (P.column_parallel_linear, P.row_parallel_linear):
        with pytest.raises(
            CollectiveArgumentError,
            match=r"objective must be one of \['replicated', 'sum'\], got 'avg'",
        ):
            layer(x, w, objective="avg")  # type: ignore[arg-type]


def test_convert_swaps_every_batch_norm_and_shares_its_state() -> None:
    model = torch.nn.Sequential(
        torch.nn.BatchNorm2d(3), torch.nn.Sequential(torch.nn.BatchNorm1d(4))
    )
    weight = model[0].weight
    converted = P.SyncBatchNorm.convert(model)
    assert isinstance(converted[0], P.SyncBatchNorm) and isinstance(
        converted[1][0], P.SyncBatchNorm
    )
    assert converted[0].weight is weight
    assert P.SyncBatchNorm.convert(converted)[0] is converted[0]


def test_split_to_sequence_refuses_rows_that_do_not_split_evenly_without_sizes() -> None:
    x = torch.zeros(5, 2, dtype=DT)
    assert P.split_to_sequence(x).shape == (5, 2)  # one rank: every row
    with pytest.raises(
        CollectiveArgumentError,
        match=r"split_to_sequence\(dim=0\) on rank 0: sizes must add up to 5, the entries of x",
    ):
        P.split_to_sequence(x, sizes=[4])
