"""ColumnParallelLinear and RowParallelLinear built from an existing MLP's nn.Linear layers
give the MLP's output and gradients.

Semantics asserted (random cotangents, float64, atol 1e-10, rtol 0): each rank's weight
shard's gradient is its slice of the single-process gradient. Sequence parallel (rows
sharded, sum contract): each rank's output rows, input gradient and row bias gradient summed
over ranks equal one process's. Megatron's replicated contract (input and output whole on
every rank, the loss counted once): every rank's output and input gradient equal one
process's, and the row bias gets the whole gradient on every rank (Megatron's rule: not summed
over the group). 7 hidden features on 3 ranks: an uneven split.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F

from distgrad import parallel as P
from distgrad.testing import run_on_ranks
from tests._support import FLOAT64_ABSOLUTE, seeded
from tests.parallel import patterns as pt

DT = torch.float64


def _full_run(model: pt.MLP, x: torch.Tensor, cot: torch.Tensor) -> tuple[torch.Tensor, ...]:
    x = x.clone().requires_grad_()
    y = model.fc2(F.gelu(model.fc1(x)))
    (y * cot).sum().backward()
    return y.detach(), x.grad  # type: ignore[return-value]


def _modules_match_the_mlp(rank: int, n: int, rows: list[int]) -> None:
    gen = seeded(3)
    x = torch.randn(sum(rows), pt.D_MODEL, dtype=DT, generator=gen)
    cot = torch.randn(sum(rows), pt.D_MODEL, dtype=DT, generator=gen)
    full = pt.MLP()
    want, want_dx = _full_run(full, x, cot)
    cols = pt.my_slice(pt.HIDDEN)
    mine = slice(sum(rows[:rank]), sum(rows[: rank + 1]))
    for sequence_parallel, objective in ((True, "sum"), (False, "replicated")):
        first = P.ColumnParallelLinear.from_linear(
            full.fc1, sequence_parallel=sequence_parallel, objective=objective
        )
        second = P.RowParallelLinear.from_linear(
            full.fc2, sequence_parallel=sequence_parallel, objective=objective
        )
        inp = (x[mine] if sequence_parallel else x).clone().requires_grad_()
        y = second(F.gelu(first(inp, rows)), rows)
        expected = want[mine] if sequence_parallel else want
        torch.testing.assert_close(y, expected, **FLOAT64_ABSOLUTE)
        (y * (cot[mine] if sequence_parallel else cot)).sum().backward()
        torch.testing.assert_close(
            inp.grad, want_dx[mine] if sequence_parallel else want_dx, **FLOAT64_ABSOLUTE
        )
        torch.testing.assert_close(
            first.weight.grad, full.fc1.weight.grad[cols], **FLOAT64_ABSOLUTE
        )
        torch.testing.assert_close(first.bias.grad, full.fc1.bias.grad[cols], **FLOAT64_ABSOLUTE)
        torch.testing.assert_close(
            second.weight.grad, full.fc2.weight.grad[:, cols], **FLOAT64_ABSOLUTE
        )
        bias = second.bias.grad.clone()
        if objective == "sum":  # a replicated parameter: summed over ranks
            dist.all_reduce(bias)
        torch.testing.assert_close(bias, full.fc2.bias.grad, **FLOAT64_ABSOLUTE)


def test_parallel_linear_modules_from_an_mlp_give_its_output_and_gradients() -> None:
    run_on_ranks(_modules_match_the_mlp, 3, args=([4, 1, 3],))
