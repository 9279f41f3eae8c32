"""Every op on a sub-group that leaves out global rank 0, with src/dst/perm as group ranks.

World of 3; the group is global ranks {1, 2}, so group rank 0 is global rank 1. Global rank 0
calls nothing on the sub-group. The semantics asserted are those of test_gradients.py (sum over
the group's ranks of <out_r, v_r>, random cotangents, float64 single-process reference), with
the reference built for a world of the group's size. In the same processes, the world group is
used before and after, to show that the two groups do not interfere.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

import distgrad as dg
from distgrad.testing import run_on_ranks
from tests._support import FLOAT64, seeded
from tests.collectives.reference import cases, check_case, edge_cases, replicated_cases


def _on_sub_group(rank: int, world_size: int) -> list[str]:
    members = [1, 2]
    group = dist.new_group(members)
    assert dg.all_reduce(torch.ones(1)).item() == world_size  # the world group first
    failures = []
    if rank in members:
        group_rank = members.index(rank)
        for case in cases(2) + edge_cases(2) + replicated_cases(2):
            try:
                check_case(group_rank, 2, case, torch.float64, group=group)
            except AssertionError as exc:
                failures.append(f"global rank {rank}: {case}: {exc}")
    assert dg.all_reduce(torch.ones(1)).item() == world_size  # and still fine after
    return failures


def test_every_op_on_a_sub_group_without_rank_0_uses_group_ranks() -> None:
    failures = [f for per_rank in run_on_ranks(_on_sub_group, 3) for f in per_rank]
    assert not failures, "\n".join(failures)


def _broadcast_src_is_a_group_rank(rank: int, world_size: int) -> float | None:
    group = dist.new_group([1, 2])
    if rank == 0:
        return None
    x = torch.full((1,), float(rank), requires_grad=True)
    out = dg.broadcast(x, src=0, group=group)  # group rank 0 is global rank 1
    out.backward(torch.full((1,), 10.0 * rank))
    assert x.grad is not None or rank == 2
    return out.item() if rank == 2 else float(x.grad.item())  # type: ignore[union-attr]


def test_src_zero_on_a_sub_group_means_its_first_member() -> None:
    """rank 2 receives global rank 1's value; rank 1's gradient is 10 * 1 + 10 * 2."""
    _, grad_on_source, received = run_on_ranks(_broadcast_src_is_a_group_rank, 3)
    assert received == 1.0
    assert grad_on_source == 30.0


def _world_and_sub_group_in_one_graph(rank: int, world_size: int) -> list[str]:
    members = [1, 2]
    group = dist.new_group(members)
    gen = seeded(7)
    xs = [torch.randn(2, 3, dtype=torch.float64, generator=gen) for _ in range(world_size)]
    ws = [torch.randn(world_size, 3, dtype=torch.float64, generator=gen) for _ in range(3)]

    def ys_of(a: torch.Tensor) -> list[torch.Tensor]:
        # rank 0 keeps a; ranks 1 and 2 all_reduce (r + 1) * a over the sub-group: 5 * a.
        summed = sum((r + 1) * a for r in members)
        return [a if r not in members else summed for r in range(world_size)]

    # Single process: a = cat(xs); y_r as above; z = cat_r(y_r.sum(0)); objective sum_r <z, w_r>.
    leaves = [x.clone().requires_grad_() for x in xs]
    ys = ys_of(torch.cat(leaves))
    z = torch.stack([y.sum(0) for y in ys])
    sum((z * w).sum() for w in ws).backward()

    x = xs[rank].clone().requires_grad_()
    a = dg.all_gather(x)  # world
    y = dg.all_reduce((rank + 1) * a, group=group) if rank in members else a  # sub-group
    out = dg.all_gather(y.sum(0, keepdim=True))  # world again, after the sub-group
    (out * ws[rank]).sum().backward()
    failures = []
    if not torch.allclose(out, z.detach(), **FLOAT64):
        failures.append(f"rank {rank}: forward {out} vs {z}")
    grad = leaves[rank].grad
    assert grad is not None and x.grad is not None
    if not torch.allclose(x.grad, grad, **FLOAT64):
        failures.append(f"rank {rank}: gradient {x.grad} vs {grad}")
    return failures


def test_world_and_sub_group_collectives_in_one_graph_match_single_process() -> None:
    """all_gather on the world, all_reduce on {1, 2}, all_gather on the world again, then one
    backward through all three: each rank's gradient equals single-process autograd of
    sum_r <z, w_r> (float64, rtol 1e-10)."""
    failures = [
        f for per_rank in run_on_ranks(_world_and_sub_group_in_one_graph, 3) for f in per_rank
    ]
    assert not failures, "\n".join(failures)
