"""Bad input becomes the same clear error on every rank, quickly, never a hang or an abort.

Each worker makes one bad call per case, catches the error and returns its type and message;
the parent asserts that *every* rank raised the expected type with a message naming the op, the
rank(s) and what differed, and that the whole group finished well inside its timeout. The group
stays usable after each error (the cases run one after another in the same processes), which
shows that no rank was left inside a collective.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.distributed as dist

import distgrad as dg
from distgrad._exchange.handshake import debug_enabled
from distgrad.errors import CollectiveArgumentError, CollectiveMismatchError, RankFailedError
from distgrad.testing import run_on_ranks
from tests._support import seeded
from tests.collectives.reference import outcome

Case = Callable[[int, int], Any]

# The group every case calls on: a fresh one per case in default mode, whose first calls are
# checked across ranks; the world group in debug mode, where every call is.
_GROUP: Any = None


def _dtype_differs(rank: int, n: int) -> Any:
    return dg.all_reduce(
        torch.ones(3, dtype=torch.float32 if rank == 0 else torch.float64), group=_GROUP
    )


def _device_type_differs(rank: int, n: int) -> Any:
    # CPU-only machines have a second device type: "meta" tensors carry shape and dtype but no
    # data, and the handshake rejects the mismatch before any data would move.
    return dg.all_gather(torch.ones(2, device="cpu" if rank == 0 else "meta"), group=_GROUP)


def _skipped_call(rank: int, n: int) -> Any:
    # Rank 1 skips the first call; its next call has the same op and shape, so only debug mode's
    # call sites tell them apart (otherwise rank 0's first call pairs with rank 1's second).
    was = debug_enabled()
    dg.set_debug(True)
    try:
        if rank == 0:
            dg.all_reduce(torch.ones(2), group=_GROUP)
        return dg.all_reduce(torch.ones(2), group=_GROUP)
    finally:
        dg.set_debug(was)


def _skipped_call_then_a_different_one(rank: int, n: int) -> Any:
    # Without debug mode a skip is caught at the first call that differs from the peers'.
    if rank == 0:
        dg.all_reduce(torch.ones(2), group=_GROUP)
    return dg.all_gather(torch.ones(2), group=_GROUP)


def _gathered_dims_differ(rank: int, n: int) -> Any:
    return dg.all_gather(torch.ones(2, 4 if rank == 0 else 5), group=_GROUP)


def _shape_differs(rank: int, n: int) -> Any:
    return dg.all_reduce(torch.ones(3 + rank), group=_GROUP)


def _ndim_differs(rank: int, n: int) -> Any:
    return dg.all_gather(torch.ones((2, 3) if rank == 0 else (2, 3, 1)), group=_GROUP)


def _unknown_op(rank: int, n: int) -> Any:
    return dg.all_reduce(torch.ones(3), op="mean" if rank == 1 else "sum", group=_GROUP)  # type: ignore[arg-type]


def _ops_differ(rank: int, n: int) -> Any:
    return dg.all_reduce(torch.ones(3), op="max" if rank == 1 else "sum", group=_GROUP)


def _unknown_objective(rank: int, n: int) -> Any:
    return dg.all_gather(torch.ones(3), objective="once", group=_GROUP)  # type: ignore[arg-type]


def _reduce_scatter_sizes_do_not_add_up(rank: int, n: int) -> Any:
    return dg.reduce_scatter(torch.ones(6, 2), sizes=[1, 2] if rank == 1 else [3, 3], group=_GROUP)


def _reduce_scatter_uneven_without_sizes(rank: int, n: int) -> Any:
    return dg.reduce_scatter(torch.ones(5, 2), group=_GROUP)


def _all_to_all_input_sizes_do_not_add_up(rank: int, n: int) -> Any:
    return dg.all_to_all(torch.ones(4), input_sizes=[2, 3] if rank == 0 else [2, 2], group=_GROUP)


def _all_to_all_output_sizes_disagree(rank: int, n: int) -> Any:
    return dg.all_to_all(torch.ones(4), output_sizes=[2, 1] if rank == 1 else [2, 2], group=_GROUP)


def _scatter_sizes_do_not_add_up(rank: int, n: int) -> Any:
    x = torch.ones(4, 2) if rank == 0 else None
    return dg.scatter(x, 0, sizes=[1, 1], group=_GROUP)


def _src_out_of_range(rank: int, n: int) -> Any:
    return dg.broadcast(torch.ones(2), src=n, group=_GROUP)


def _dst_out_of_range(rank: int, n: int) -> Any:
    return dg.gather(torch.ones(2), dst=-1, group=_GROUP)


def _dst_differs(rank: int, n: int) -> Any:
    return dg.reduce(torch.ones(2), dst=rank, group=_GROUP)


def _perm_not_a_permutation(rank: int, n: int) -> Any:
    return dg.permute(torch.ones(2), [0, 0] if rank == 0 else [1, 0], group=_GROUP)


def _perm_differs(rank: int, n: int) -> Any:
    return dg.permute(torch.ones(2), [0, 1] if rank == 0 else [1, 0], group=_GROUP)


def _different_collectives(rank: int, n: int) -> Any:
    x = torch.ones(2)
    return dg.all_reduce(x, group=_GROUP) if rank == 0 else dg.broadcast(x, 0, group=_GROUP)


def _grad_mode_differs(rank: int, n: int) -> Any:
    x = torch.ones(2, requires_grad=True)
    with torch.set_grad_enabled(rank == 0):
        return dg.all_reduce(x, group=_GROUP)


def _zero_dim_all_gather(rank: int, n: int) -> Any:
    return dg.all_gather(torch.tensor(1.0), group=_GROUP)


def _dim_out_of_range(rank: int, n: int) -> Any:
    return dg.gather(torch.ones(2, 2), 0, dim=2, group=_GROUP)


def _scatter_source_passes_none(rank: int, n: int) -> Any:
    return dg.scatter(None, 0, group=_GROUP)


# name -> (the bad call, the expected error type, phrases every rank's message must contain)
CASES: dict[str, tuple[Case, type[Exception], tuple[str, ...]]] = {
    "dtype": (
        _dtype_differs,
        CollectiveMismatchError,
        ("all_reduce", "dtype", "rank 0: torch.float32", "rank 1: torch.float64"),
    ),
    "device type": (
        _device_type_differs,
        CollectiveMismatchError,
        ("all_gather(dim=0)", "device type", "rank 0: cpu", "rank 1: meta"),
    ),
    "skipped call": (
        _skipped_call,
        CollectiveMismatchError,
        (
            "all_reduce(op='sum')",
            "debug mode: ranks made this call from different places",
            "rank 0: ",
            "rank 1: ",
            "test_bad_input.py",
            "in _skipped_call",
            "skipped a call",
        ),
    ),
    "skipped call, next differs": (
        _skipped_call_then_a_different_one,
        CollectiveMismatchError,
        ("which collective they called", "rank 0: all_reduce", "rank 1: all_gather"),
    ),
    "gathered dims": (
        _gathered_dims_differ,
        CollectiveMismatchError,
        (
            "all_gather(dim=0)",
            "shape outside dim 0",
            "rank 0: (2, 4)",
            "rank 1: (2, 5)",
            "all dims except dim 0 must match",
        ),
    ),
    "shape": (
        _shape_differs,
        CollectiveMismatchError,
        ("all_reduce", "shape", "rank 0: (3,)", "rank 1: (4,)"),
    ),
    "ndim": (_ndim_differs, CollectiveMismatchError, ("all_gather", "number of dims")),
    "unknown op": (
        _unknown_op,
        CollectiveArgumentError,
        ("all_reduce", "rank 1: op must be one of", "'mean'"),
    ),
    "ops differ": (
        _ops_differ,
        CollectiveMismatchError,
        ("ranks disagree on op", "rank 0: sum", "rank 1: max"),
    ),
    "objective": (
        _unknown_objective,
        CollectiveArgumentError,
        ("objective must be one of", "'once'"),
    ),
    "reduce_scatter sizes": (
        _reduce_scatter_sizes_do_not_add_up,
        CollectiveArgumentError,
        ("reduce_scatter", "rank 1: sizes must add up to 6", "got [1, 2]"),
    ),
    "reduce_scatter uneven": (
        _reduce_scatter_uneven_without_sizes,
        CollectiveArgumentError,
        ("does not divide evenly over 2 ranks", "sizes=[...]"),
    ),
    "all_to_all input_sizes": (
        _all_to_all_input_sizes_do_not_add_up,
        CollectiveArgumentError,
        ("all_to_all", "rank 0: input_sizes must add up to 4", "got [2, 3]"),
    ),
    "all_to_all output_sizes": (
        _all_to_all_output_sizes_disagree,
        CollectiveMismatchError,
        ("all_to_all", "rank 1 expects 1 entries from rank 1", "sends 2"),
    ),
    "scatter sizes": (
        _scatter_sizes_do_not_add_up,
        CollectiveArgumentError,
        ("scatter", "rank 0: sizes must add up to 4", "got [1, 1]"),
    ),
    "src range": (
        _src_out_of_range,
        CollectiveArgumentError,
        ("broadcast", "src must be a group rank in [0, 2), got 2"),
    ),
    "dst range": (
        _dst_out_of_range,
        CollectiveArgumentError,
        ("gather(dst=-1, dim=0)", "rank 0: dst must be a group rank in [0, 2), got -1", "rank 1: "),
    ),
    "dst differs": (
        _dst_differs,
        CollectiveMismatchError,
        ("reduce", "ranks disagree on dst", "rank 0: 0", "rank 1: 1"),
    ),
    "perm": (
        _perm_not_a_permutation,
        CollectiveArgumentError,
        ("permute", "rank 0: perm must be a permutation", "[0, 0]"),
    ),
    "perm differs": (_perm_differs, CollectiveMismatchError, ("permute", "ranks disagree on perm")),
    "collective": (
        _different_collectives,
        CollectiveMismatchError,
        ("which collective", "rank 0: all_reduce", "rank 1: broadcast"),
    ),
    "grad mode": (
        _grad_mode_differs,
        CollectiveMismatchError,
        ("grad mode", "rank 0: True", "rank 1: False"),
    ),
    "0-dim": (_zero_dim_all_gather, CollectiveArgumentError, ("all_gather", "at least 1 dim")),
    "dim range": (_dim_out_of_range, CollectiveArgumentError, ("gather", "dim must be in [-2, 2)")),
    "scatter None": (
        _scatter_source_passes_none,
        CollectiveArgumentError,
        ("scatter", "rank 0: x must be the tensor to scatter on the source rank"),
    ),
}


def _make_bad_calls(rank: int, world_size: int, debug: bool) -> dict[str, tuple[str, str]]:
    global _GROUP
    dg.set_debug(debug)
    seen = {}
    for name, (call, _, _) in CASES.items():
        _GROUP = None if debug else dist.new_group(list(range(world_size)))
        seen[name] = outcome(call, rank, world_size)
        # The group still works after the error: nobody was left inside a collective.
        assert dg.all_reduce(torch.ones(1)).item() == world_size
    return seen


@pytest.mark.parametrize("debug", [False, True], ids=["first calls", "debug mode"])
def test_bad_input_raises_the_same_clear_error_on_every_rank(debug: bool) -> None:
    """Each bad call is checked across ranks: as the first call on a fresh group (default
    mode), and after many calls on one group (debug mode, which checks every call)."""
    start = time.monotonic()
    per_rank = run_on_ranks(_make_bad_calls, 2, args=(debug,), timeout=30)
    elapsed = time.monotonic() - start
    failures = []
    for name, (_, expected_type, phrases) in CASES.items():
        for rank, seen in enumerate(per_rank):
            kind, message = seen[name]
            if kind != expected_type.__name__:
                failures.append(f"{name}: rank {rank} raised {kind}, not {expected_type.__name__}")
                continue
            missing = [p for p in phrases if p not in message]
            if missing:
                failures.append(f"{name}: rank {rank}'s message lacks {missing}: {message}")
            if f"on rank {rank}" not in message:
                failures.append(f"{name}: rank {rank}'s message does not name its rank: {message}")
    assert not failures, "\n".join(failures)
    assert elapsed < 10, f"the bad calls took {elapsed:.1f}s; errors must come at once"


def _integer_tensor_with_gradient_peers(rank: int, world_size: int) -> str:
    # An integer tensor cannot require grad; when a float peer does, the dtypes differ.
    x = torch.ones(2, requires_grad=True) if rank == 0 else torch.ones(2, dtype=torch.int64)
    with pytest.raises(CollectiveMismatchError, match="dtype") as info:
        dg.all_gather(x)
    return str(info.value)


def test_integer_tensor_beside_a_float_tensor_that_requires_grad_raises_on_every_rank() -> None:
    messages = run_on_ranks(_integer_tensor_with_gradient_peers, 2)
    assert all("torch.int64" in m and "torch.float32" in m for m in messages)


def _raise_on_rank_one(rank: int, world_size: int) -> None:
    if rank == 1:
        raise ValueError("rank one's own bug")
    dg.all_reduce(torch.ones(2))


def test_a_failing_rank_is_reported_first_and_its_peers_end_fast() -> None:
    start = time.monotonic()
    with pytest.raises(RankFailedError) as info:
        run_on_ranks(_raise_on_rank_one, 2, timeout=30)
    message = str(info.value)
    assert time.monotonic() - start < 5
    assert message.index("--- rank 1: ValueError: rank one's own bug") < message.index("--- rank 0")


def _skip_a_collective(rank: int, world_size: int) -> None:
    dg.all_reduce(torch.ones(2))
    if rank == 0:
        dg.all_reduce(torch.ones(2))  # rank 1 never makes this call and leaves


def test_a_rank_that_skips_a_collective_makes_its_peer_fail_with_where_it_waited() -> None:
    start = time.monotonic()
    with pytest.raises(RankFailedError) as info:
        run_on_ranks(_skip_a_collective, 2, timeout=30)
    assert time.monotonic() - start < 10
    assert "rank 0 was waiting for its peers at the start of all_reduce(op='sum')" in str(
        info.value
    )


def _handshake_meets_a_loss_size_exchange(rank: int, world_size: int) -> str:
    # Two different kinds of metadata message meet: rank 0's all_reduce handshake and rank 1's
    # row-count exchange of a loss (a 2-dim tensor and two size lists). Every metadata message
    # on a group has the same width, so gloo never sees two sizes (which aborts the process);
    # each rank reads the other's message and raises.
    with pytest.raises(CollectiveMismatchError) as info:
        if rank == 0:
            dg.all_reduce(torch.ones(2))
        else:
            dg.losses.nt_xent(torch.ones(4, 3), torch.ones(4, 3), block_size=2)
    return str(info.value)


def test_metadata_messages_of_different_kinds_meet_without_aborting() -> None:
    start = time.monotonic()
    messages = run_on_ranks(_handshake_meets_a_loss_size_exchange, 2, timeout=30)
    assert time.monotonic() - start < 10
    for rank, message in enumerate(messages):
        assert f"on rank {rank}: ranks disagree on which collective they called" in message
        assert "rank 0: all_reduce; rank 1: nt_xent" in message


def _sub_group_member_check(rank: int, world_size: int) -> str:
    group = dist.new_group([0, 1])
    if rank != 2:
        return "member"
    with pytest.raises(ValueError, match="not a member of the group"):
        dg.all_reduce(torch.ones(1), group=group)
    return "raised"


def test_calling_a_collective_outside_the_group_raises() -> None:
    assert run_on_ranks(_sub_group_member_check, 3)[2] == "raised"


# Debug mode (dg.set_debug(True)): checks that cost a collective per backward call.


def _replicated_with_different_cotangents(rank: int, world_size: int) -> tuple[str, str]:
    dg.set_debug(True)
    x = torch.randn(2, 3, dtype=torch.float64, requires_grad=True)
    v_same = torch.ones(world_size * 2, 3, dtype=torch.float64)
    # The same loss on every rank: debug mode lets it through.
    (dg.all_gather(x, objective="replicated") * v_same).sum().backward()
    v_differs = v_same + rank
    out = dg.all_gather(x, objective="replicated")
    try:
        (out * v_differs).sum().backward()
    except CollectiveMismatchError as exc:
        return "CollectiveMismatchError", str(exc)
    finally:
        dg.set_debug(False)
    return "no error", ""


def test_debug_mode_rejects_replicated_objective_with_different_losses_on_every_rank() -> None:
    """objective='replicated' promises one shared loss; debug mode checks it in backward."""
    start = time.monotonic()
    seen = run_on_ranks(_replicated_with_different_cotangents, 2, timeout=30)
    assert time.monotonic() - start < 10
    for rank, (kind, message) in enumerate(seen):
        assert kind == "CollectiveMismatchError", f"rank {rank}: {kind}"
        assert "backward of all_gather(objective='replicated')" in message
        assert f"on rank {rank}" in message and "differs from rank 0's" in message


def _backward_in_different_orders(rank: int, world_size: int, debug: bool) -> tuple[str, str]:
    dg.set_debug(debug)
    gen = seeded(rank)
    x1 = torch.randn(2, 3, dtype=torch.float64, generator=gen, requires_grad=True)
    x2 = torch.randn(2, 3, dtype=torch.float64, generator=gen, requires_grad=True)
    a, b = dg.all_gather(x1), dg.all_gather(x2)  # same op, same shape: calls k and k + 1
    loss_a, loss_b = (a * (rank + 1)).sum(), (b * (rank + 3)).sum()
    # Autograd orders one graph's backward deterministically, but two separate grad() calls run
    # in the order asked: rank 0 goes through a first, rank 1 through b first.
    order = [(loss_a, x1), (loss_b, x2)] if rank == 0 else [(loss_b, x2), (loss_a, x1)]
    try:
        grads = {id(x): torch.autograd.grad(loss, x)[0] for loss, x in order}
    except CollectiveMismatchError as exc:
        return "CollectiveMismatchError", str(exc)
    finally:
        dg.set_debug(False)
    # Without debug mode the backwards pair up wrongly: rank 0's a-gradient meets rank 1's b.
    expected_a = torch.full_like(x1, sum(r + 1 for r in range(world_size)))
    return ("right" if torch.equal(grads[id(x1)], expected_a) else "wrong"), ""


def test_debug_mode_detects_backward_collectives_reached_in_different_orders() -> None:
    """Two all_gathers of one shape, back-propagated in opposite orders on the two ranks.

    In debug mode every rank raises CollectiveMismatchError naming the forward call each rank's
    backward belongs to; without it, the exchange pairs the wrong collectives and rank 0's
    gradient for x1 is silently wrong (which is why debug mode exists).
    """
    start = time.monotonic()
    seen = run_on_ranks(_backward_in_different_orders, 2, args=(True,), timeout=30)
    assert time.monotonic() - start < 10
    for rank, (kind, message) in enumerate(seen):
        assert kind == "CollectiveMismatchError", f"rank {rank}: {kind}"
        assert "backward of all_gather" in message and f"on rank {rank}" in message
        assert "different orders" in message
        assert "rank 0: the backward of its distgrad call" in message
    unchecked = run_on_ranks(_backward_in_different_orders, 2, args=(False,), timeout=30)
    assert unchecked[0][0] == "wrong"


def _too_many_dims(rank: int, n: int) -> tuple[tuple[str, str], list[float]]:
    """A 13-dim tensor in a checked call (the handshake carries every shape whole, 12 dims at
    most), then a matching call that shows the group is still usable."""
    refused = outcome(dg.all_reduce, torch.ones([1] * 13))
    return refused, dg.all_reduce(torch.ones(2)).tolist()


def test_a_tensor_of_more_than_twelve_dims_is_refused_in_a_checked_call_on_every_rank() -> None:
    for rank, (refused, after) in enumerate(run_on_ranks(_too_many_dims, 2, timeout=60)):
        kind, message = refused
        assert kind == "CollectiveArgumentError", (rank, refused)
        assert "x must have at most 12 dims, got 13" in message, message
        assert after == [2.0, 2.0]
