"""distgrad's point-to-point traffic never pairs with the user's own sends and receives.

On gloo, all_gather, all_to_all, reduce_scatter, permute and the ring losses move their data as
point-to-point messages. A user message still in flight between the same two ranks (a pipeline
stage's activations, say) must neither be taken by distgrad's receive nor take distgrad's
message: each side gets exactly what was sent to it.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

import distgrad as dg
from distgrad.testing import run_on_ranks


def _user_message_in_flight(rank: int, world_size: int) -> tuple[bool, bool, bool]:
    # The user's message has the same size as distgrad's would, so a mix-up would not fail
    # loudly: it would silently swap the data.
    x = torch.full((2,), float(rank + 1), requires_grad=True)
    user = torch.full((2,), 7.0)
    pending = dist.isend(user, dst=1) if rank == 0 else None
    gathered = dg.all_gather(x)
    shifted = dg.permute(x, [1, 0])
    gathered.backward(torch.ones_like(gathered))
    if rank == 1:
        received = torch.zeros(2)
        dist.recv(received, src=0)
        user_ok = torch.equal(received, user)
    else:
        assert pending is not None
        pending.wait()
        user_ok = True
    expected = torch.tensor([1.0, 1.0, 2.0, 2.0])
    assert x.grad is not None
    return (
        torch.equal(gathered.detach(), expected),
        torch.equal(shifted.detach(), torch.full((2,), float(2 - rank))),
        user_ok and torch.equal(x.grad, torch.full((2,), 2.0)),
    )


def test_a_user_message_in_flight_does_not_meet_distgrads_messages() -> None:
    for rank, checks in enumerate(run_on_ranks(_user_message_in_flight, 2, timeout=30)):
        assert all(checks), f"rank {rank}: (all_gather, permute, user message) = {checks}"
