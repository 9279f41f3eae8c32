"""A backend error on this rank alone is said to be local, not blamed on a peer.

Semantics asserted: every rank summing a uint32 tensor (a dtype gloo's sum refuses; a gap
docs/semantics.md documents) gets an error saying that its own backend refused the operation,
that no peer is gone and no connection closed, with gloo's own text after it; and the group
works for the next call (its result checked against the sum over ranks).
"""

from __future__ import annotations

import torch

import distgrad as dg
from distgrad.testing import run_on_ranks


def _uint32_sum_then_a_good_call(rank: int, world_size: int) -> tuple[list[str], list[float]]:
    messages = []
    for _ in range(2):  # inside the checked calls and past the first
        try:
            dg.all_reduce(torch.ones(3, dtype=torch.uint32))
        except RuntimeError as exc:
            messages.append(str(exc))
    return messages, dg.all_reduce(torch.full((3,), float(rank + 1))).tolist()


def test_a_local_backend_error_says_it_is_local_and_leaves_the_group_usable() -> None:
    for rank, (messages, after) in enumerate(run_on_ranks(_uint32_sum_then_a_good_call, 2)):
        assert len(messages) == 2, messages
        for message in messages:
            first = message.splitlines()[0]
            assert first.startswith(f"distgrad: rank {rank} was in the forward of all_reduce"), (
                first
            )
            assert "its gloo backend refused the operation on this rank: a local error" in first
            assert "no peer's process is gone and no connection closed" in first, first
            assert "crashed" not in first and "cannot be used any more" not in first, first
            assert "[from gloo]" in message, message
        assert after == [3.0, 3.0, 3.0]  # 1 + 2: the group still works
