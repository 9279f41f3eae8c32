"""Random programs across ranks: dg.pipeline's backward equals one process on any graph.

A program is one global list of ops that every rank reads and runs its own part of: local
math on a rank's tensors, and transfers of a tensor from one rank to another (a send on one, a
receive on the other). Tensors are sent to several ranks (diamonds), sent back to a rank they
came from (cycles: rank 0 -> 1 -> 0), used after they were sent, and some received tensors
reach no loss. Some ranks have a loss, some do not. The same program runs in one process
(a transfer is the tensor itself), where the objective is the sum of every rank's loss.

Asserted: every rank's parameters' gradients equal the single-process ones (a parameter that
reaches no loss gets zeros, or no gradient, where one process gives none: FAST mode sends a
zero gradient for every transfer, docs/pipeline.md), over many programs, 3 ranks.
"""

from __future__ import annotations

import random
from typing import Any

import pytest
import torch
from torch import Tensor

import distgrad.pipeline as dgp
from distgrad.testing import run_on_ranks
from tests._support import FLOAT64, seeded

UNARY = (torch.sin, torch.tanh, lambda x: x * 1.5)
BINARY = (torch.mul, torch.add, lambda x, y: x - 0.5 * y)
SHAPE = (3,)
PARAMS = 2  # leaves each rank starts with

Op = tuple[Any, ...]


def make_program(rng: random.Random, world: int) -> tuple[list[Op], list[list[int]]]:
    """The ops, and which of its tensors each rank's loss uses (empty: no loss)."""
    counts = [PARAMS] * world  # tensors each rank holds so far
    ops: list[Op] = []
    for _ in range(rng.randint(4, 12)):
        r = rng.randrange(world)
        roll = rng.random()
        if roll < 0.45:
            dst = rng.choice([d for d in range(world) if d != r])
            ops.append(("transfer", r, dst, rng.randrange(counts[r])))
            counts[dst] += 1
        elif roll < 0.7:
            ops.append(("unary", r, rng.randrange(len(UNARY)), rng.randrange(counts[r])))
            counts[r] += 1
        else:
            i, j = rng.randrange(counts[r]), rng.randrange(counts[r])
            ops.append(("binary", r, rng.randrange(len(BINARY)), i, j))
            counts[r] += 1
    losses = [
        rng.sample(range(counts[r]), k=min(counts[r], rng.randint(0, 2))) for r in range(world)
    ]
    return ops, losses


def _params(rank: int, seed: int) -> list[Tensor]:
    g = seeded(1000 * seed + rank)
    return [torch.randn(SHAPE, dtype=torch.float64, generator=g).requires_grad_() for _ in range(2)]


def _weights(rank: int, seed: int, n: int) -> list[Tensor]:
    g = seeded(5000 * seed + rank)
    return [torch.randn(SHAPE, dtype=torch.float64, generator=g) for _ in range(n)]


def run_local(ops: list[Op], losses: list[list[int]], world: int, seed: int) -> list[list[Tensor]]:
    """The program in one process; returns each rank's parameters, their .grad set."""
    params = [_params(r, seed) for r in range(world)]
    held: list[list[Tensor]] = [list(p) for p in params]
    for op in ops:
        _apply(op, held, None)
    total = torch.zeros((), dtype=torch.float64)
    for r, chosen in enumerate(losses):
        for w, i in zip(_weights(r, seed, len(chosen)), chosen, strict=True):
            total = total + (held[r][i] * w).sum()
    if total.requires_grad:
        total.backward()
    return params


def _apply(op: Op, held: list[list[Tensor]], rank: int | None) -> None:
    """Run ``op``: every rank's part in one process (``rank`` None), or ``rank``'s part."""
    kind, r = op[0], op[1]
    if kind == "transfer":
        src, dst, i = op[1], op[2], op[3]
        if rank is None:
            held[dst].append(held[src][i])
        elif rank == src:
            dgp.isend(held[src][i], dst)
        elif rank == dst:
            # Shapes given: each program has other transfers, nothing to learn from the last.
            held[dst].append(dgp.recv(src, shape=SHAPE, dtype=torch.float64))
        return
    if rank is not None and rank != r:
        return
    if kind == "unary":
        held[r].append(UNARY[op[2]](held[r][op[3]]))
    else:
        held[r].append(BINARY[op[2]](held[r][op[3]], held[r][op[4]]))


def _run_programs(rank: int, world: int, seeds: list[int]) -> int:
    for seed in seeds:
        ops, losses = make_program(random.Random(seed), world)
        reference = run_local(ops, losses, world, seed)[rank]
        params = _params(rank, seed)
        held: list[list[Tensor]] = [list(params) if r == rank else [] for r in range(world)]
        with dgp.context() as cid:
            for op in ops:
                before = len(held[rank])
                _apply(op, held, rank)
                if len(held[rank]) == before and _adds_to(op, rank):
                    raise AssertionError("an op of this rank added no tensor")
                for r in range(world):  # placeholders keep the one-process run's indices
                    if r != rank and _adds_to(op, r):
                        held[r].append(torch.empty(0))
            roots = [
                (held[rank][i] * w).sum()
                for w, i in zip(_weights(rank, seed, len(losses[rank])), losses[rank], strict=True)
            ]
            dgp.backward(cid, [r for r in roots if r.requires_grad])
        for got, ref in zip(params, reference, strict=True):
            expected = ref.grad if ref.grad is not None else torch.zeros(SHAPE, dtype=torch.float64)
            actual = got.grad if got.grad is not None else torch.zeros(SHAPE, dtype=torch.float64)
            torch.testing.assert_close(actual, expected, **FLOAT64, msg=f"program {seed}: {ops}")
    return len(seeds)


def _adds_to(op: Op, r: int) -> bool:
    return op[2] == r if op[0] == "transfer" else op[1] == r


@pytest.mark.parametrize(
    "seeds", [range(0, 25), pytest.param(range(25, 225), marks=pytest.mark.slow)]
)
def test_random_programs_with_diamonds_cycles_and_unused_outputs_equal_one_process(
    seeds: range,
) -> None:
    """25 random 3-rank programs in the default tier (200 more in the slow tier)."""
    assert run_on_ranks(_run_programs, 3, args=(list(seeds),), timeout=300) == [len(seeds)] * 3
