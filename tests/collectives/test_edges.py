"""Mistakes at the edges of validation: non-tensors on one rank, skips that look alike, backward
orders, and scatter receivers that ask torch.autograd.grad for their part.

Each worker returns what every rank saw; the parent asserts that every rank saw the same named
error (the message differs only in "on rank r"), or the right gradient.
"""

from __future__ import annotations

import re
from typing import Any

import numpy as np
import pytest
import torch
import torch.distributed as dist

import distgrad as dg
from distgrad.collectives._signature import CHECKED_CALLS
from distgrad.errors import CollectiveArgumentError, RankFailedError
from distgrad.testing import run_on_ranks
from tests.collectives.reference import outcome

# x as each op takes it; the bad rank passes ``bad`` instead of its tensor.
_OPS: dict[str, Any] = {
    "all_reduce(op='sum')": lambda x, g: dg.all_reduce(x, group=g),
    "all_gather(dim=0)": lambda x, g: dg.all_gather(x, g),
    "reduce_scatter(op='sum', dim=0)": lambda x, g: dg.reduce_scatter(x, "sum", g),
    "all_to_all": lambda x, g: dg.all_to_all(x, g),
    "broadcast(src=0)": lambda x, g: dg.broadcast(x, 0, g),
    "reduce(dst=0": lambda x, g: dg.reduce(x, 0, group=g),
    "gather(dst=0, dim=0)": lambda x, g: dg.gather(x, 0, g),
    "scatter(src=1, dim=0)": lambda x, g: dg.scatter(x, 1, g),  # the bad rank is the source
    "permute": lambda x, g: dg.permute(x, [1, 0], g),
}
_BAD: dict[str, Any] = {
    "1.5": 1.5,
    "2": 2,
    "numpy.ndarray": np.ones(2, dtype=np.float32),
    "None": None,
    "list": [1.0, 2.0],
}


def _same_but_rank(messages: list[str]) -> bool:
    return len({re.sub(r"on rank \d", "on rank r", m) for m in messages}) == 1


def _non_tensor_on_rank_one(rank: int, world_size: int, debug: bool) -> dict[str, tuple[str, str]]:
    dg.set_debug(debug)
    seen = {}
    for op, call in _OPS.items():
        for name, bad in _BAD.items():
            if name == "None" and op.startswith("scatter"):
                continue  # a source passing None is its own case (test_bad_input)
            group = None if debug else dist.new_group([0, 1])  # a first call: checked
            x = torch.ones(2) if rank == 0 else bad
            seen[f"{op} {name}"] = outcome(call, x, group)
            assert dg.all_reduce(torch.ones(1)).item() == world_size
    return seen


@pytest.mark.parametrize("debug", [False, True], ids=["first calls", "debug mode"])
def test_a_non_tensor_on_one_rank_is_the_same_error_on_every_rank(debug: bool) -> None:
    """The bad rank still takes part in the exchange and says what it passed."""
    per_rank = run_on_ranks(_non_tensor_on_rank_one, 2, args=(debug,), timeout=60)
    failures = []
    for case in per_rank[0]:
        seen = [s[case] for s in per_rank]
        op, name = case.rsplit(" ", 1)
        shown = {"numpy.ndarray": "got numpy.ndarray", "list": "got builtins.list"}.get(
            name, f"got {name}"
        )
        for rank, (kind, message) in enumerate(seen):
            if kind != "CollectiveArgumentError" or f"on rank {rank}" not in message:
                failures.append(f"{case}: rank {rank}: {kind}: {message}")
            elif op not in message or f"rank 1: x must be a torch.Tensor, {shown}" not in message:
                failures.append(f"{case}: rank {rank}'s message: {message}")
        if not _same_but_rank([m for _, m in seen]):
            failures.append(f"{case}: the ranks' messages differ: {seen}")
    assert not failures, "\n".join(failures)


def _non_tensor_after_the_checked_calls(rank: int, world_size: int) -> None:
    for _ in range(CHECKED_CALLS):
        dg.all_reduce(torch.ones(2))
    dg.all_reduce(torch.ones(2) if rank == 0 else 1.5)  # type: ignore[arg-type]


def test_a_non_tensor_after_the_checked_calls_is_a_local_error_naming_op_rank_and_type() -> None:
    """Past the checked calls nothing is exchanged: the bad rank raises at once, its peer waits
    in the collective until the bad rank exits (docs/semantics.md)."""
    with pytest.raises(RankFailedError) as info:
        run_on_ranks(_non_tensor_after_the_checked_calls, 2, timeout=30)
    message = str(info.value)
    first = message.index("--- rank 1: CollectiveArgumentError")
    assert first < message.index("--- rank 0")
    assert "all_reduce(op='sum') on rank 1: x must be a torch.Tensor, got 1.5" in message


def _reduce_through_helper(t: torch.Tensor) -> torch.Tensor:
    return dg.all_reduce(t)  # the innermost frame is this line on every rank


def _step(t: torch.Tensor) -> torch.Tensor:
    return _reduce_through_helper(t)


def _skip_through_a_helper(rank: int, world_size: int, where: str) -> tuple[str, str]:
    dg.set_debug(True)
    a, b = torch.full((3,), 1.0), torch.full((3,), 10.0 * (rank + 1))
    try:
        if where == "helper":
            if rank == 0:
                _reduce_through_helper(a)  # rank 1 skips this call
            out = _reduce_through_helper(b)
        else:  # a different loop depth: the skipped call is in the outer loop
            out = torch.zeros(3)
            for step in range(2):
                if step == 0 and rank == 0:
                    _reduce_through_helper(a)
                for _ in range(1):
                    out = _step(b)
    except Exception as exc:
        return type(exc).__name__, f"{exc}"
    return "no error", str(out.tolist())


@pytest.mark.parametrize("where", ["helper", "loop depth"])
def test_debug_mode_catches_a_skipped_call_that_looks_alike(where: str) -> None:
    """Rank 1 skips all_reduce(a) and calls all_reduce(b) of the same shape through the same
    helper: without the whole stack, rank 0's a would pair with rank 1's b (silently 21)."""
    seen = run_on_ranks(_skip_through_a_helper, 2, args=(where,), timeout=30)
    for rank, (kind, message) in enumerate(seen):
        assert kind == "CollectiveMismatchError", f"rank {rank}: {kind}: {message}"
        assert f"all_reduce(op='sum') on rank {rank}: debug mode: ranks made this call" in message
        assert "test_edges.py" in message and "_skip_through_a_helper" in message
        assert "called through" in message and "_reduce_through_helper" in message
    assert _same_but_rank([m for _, m in seen])


def _opposite_orders(rank: int, world_size: int) -> tuple[str, str]:
    dg.set_debug(True)
    x1 = torch.ones(2, 3, dtype=torch.float64, requires_grad=True)
    x2 = torch.ones(5, 4, dtype=torch.float64, requires_grad=True)
    a, b = dg.all_gather(x1, sizes=[2, 2]), dg.all_gather(x2, sizes=[5, 5])
    order = [(a, x1), (b, x2)] if rank == 0 else [(b, x2), (a, x1)]
    try:
        for out, x in order:
            torch.autograd.grad(out.sum(), x)
    except Exception as exc:
        return type(exc).__name__, f"{exc}"
    return "no error", ""


def test_debug_mode_catches_backwards_in_opposite_orders_with_different_shapes() -> None:
    """Without debug mode gloo aborts rank 0 (SIGABRT, "op.preamble.length <= op.nbytes"),
    inside the checked calls and after them alike: backward collectives are not checked."""
    seen = run_on_ranks(_opposite_orders, 2, timeout=30)
    for rank, (kind, message) in enumerate(seen):
        assert kind == "CollectiveMismatchError", f"rank {rank}: {kind}: {message}"
        assert f"backward of all_gather on rank {rank}" in message and "different orders" in message
        assert (
            "rank 0: the backward of its distgrad call 1; rank 1: the backward of its "
            "distgrad call 2" in message
        )
    assert _same_but_rank([m for _, m in seen])


def _scatter_receiver_asks_for_its_part(rank: int, world_size: int, warm: int) -> list[Any]:
    for _ in range(warm):  # warm = CHECKED_CALLS: the scatter is past the checked calls
        dg.all_reduce(torch.ones(1))
    x = torch.arange(8.0).view(4, 2).requires_grad_(True)
    part = torch.zeros(2, 2, requires_grad=True)  # a receiver's x: shaped like its part
    w = torch.ones(2, requires_grad=True)
    v = torch.full((2, 2), float(rank + 1))
    y = dg.scatter(x if rank == 0 else part, 0, sizes=[2, 2])
    loss = (y * v).sum() + (w * 2).sum()
    # The receiver asks for its part (whose values reach no output) and for w.
    inputs = [x, w] if rank == 0 else [part, w]
    return list(torch.autograd.grad(loss, inputs))


@pytest.mark.parametrize("warm", [0, CHECKED_CALLS], ids=["checked call", "unchecked call"])
def test_a_scatter_receiver_can_ask_autograd_grad_for_its_part(warm: int) -> None:
    """The receiver's part gets zeros (its values are not used), the source gets every rank's
    cotangent in rank order, and no rank waits for another."""
    (x_grad, w0), (part_grad, w1) = run_on_ranks(
        _scatter_receiver_asks_for_its_part, 2, args=(warm,), timeout=30
    )
    torch.testing.assert_close(x_grad, torch.tensor([[1.0, 1.0]] * 2 + [[2.0, 2.0]] * 2))
    torch.testing.assert_close(part_grad, torch.zeros(2, 2))
    torch.testing.assert_close(w0, torch.full((2,), 2.0))
    torch.testing.assert_close(w1, torch.full((2,), 2.0))


def test_a_non_tensor_error_is_raised_without_a_group() -> None:
    """Without a process group (a group of one) the same check is a local error."""
    with pytest.raises(CollectiveArgumentError, match=r"x must be a torch.Tensor, got 1.5"):
        dg.all_reduce(1.5)  # type: ignore[arg-type]


def _replicated_backward(x: torch.Tensor, v: torch.Tensor) -> None:
    (dg.all_gather(x, objective="replicated") * v).sum().backward()


def _replicated_with_nan(rank: int, world_size: int) -> list[tuple[str, str]]:
    dg.set_debug(True)
    x = torch.ones(2, 3, dtype=torch.float64, requires_grad=True)
    same = torch.tensor([[float("nan"), 1.0, 2.0]] * (2 * world_size), dtype=torch.float64)
    differs = same.clone()
    differs[0, 1] = float("nan") if rank == 1 else 1.0  # NaN on rank 1 only
    seen = []
    for v in (same, differs):
        seen.append(outcome(_replicated_backward, x, v))
    return seen


def test_the_replicated_check_takes_nan_as_equal_to_nan() -> None:
    """Bit-identical gradients holding NaN pass; NaN against a number is caught on every rank."""
    per_rank = run_on_ranks(_replicated_with_nan, 2, timeout=30)
    for rank, (same, differs) in enumerate(per_rank):
        assert same == ("no error", ""), f"rank {rank}: {same}"
        assert differs[0] == "CollectiveMismatchError", f"rank {rank}: {differs}"
        assert "1 of 2 ranks back-propagate a gradient that differs from rank 0's" in differs[1]


_SIZE_CASES: dict[str, Any] = {
    "reduce_scatter": lambda r: dg.reduce_scatter(
        torch.ones(4), sizes=[1, 3] if r == 0 else [2, 2]
    ),
    "all_to_all": lambda r: dg.all_to_all(
        torch.ones(4), input_sizes=[1, 3], output_sizes=[1, 3] if r == 0 else [2, 2]
    ),
    "gather": lambda r: dg.gather(torch.ones(2 + 2 * r), 0, sizes=[2, 3] if r == 0 else [2, 4]),
    "scatter": lambda r: dg.scatter(
        torch.ones(4) if r == 0 else torch.ones(1 + r), 0, sizes=[1, 3] if r == 0 else [2, 2]
    ),
}
# Phrases every rank's message must hold: the sizes as lists, never a checksum.
_SIZE_PHRASES = {
    "reduce_scatter": ("ranks disagree on sizes", "rank 0: [1, 3]; rank 1: [2, 2]"),
    "all_to_all": ("rank 0 expects 3 entries from rank 1", "but rank 1 sends 1 (input_sizes[0])"),
    "gather": ("ranks disagree on sizes", "rank 0: [2, 3]; rank 1: [2, 4]"),
    "scatter": ("sizes", "[1, 3]", "[2, 2]"),
}


def _sizes_differ(rank: int, world_size: int) -> dict[str, str]:
    seen = {}
    for name, call in _SIZE_CASES.items():
        try:
            call(rank)
        except Exception as exc:
            seen[name] = f"{type(exc).__name__}: {exc}"
        else:
            seen[name] = "no error"
        assert dg.all_reduce(torch.ones(1)).item() == world_size
    return seen


def test_size_mismatches_name_the_sizes_on_every_rank() -> None:
    per_rank = run_on_ranks(_sizes_differ, 2, timeout=30)
    for name, phrases in _SIZE_PHRASES.items():
        for rank, seen in enumerate(per_rank):
            message = seen[name]
            assert message.startswith("Collective"), f"{name} rank {rank}: {message}"
            assert all(p in message for p in phrases), f"{name} rank {rank}: {message}"
