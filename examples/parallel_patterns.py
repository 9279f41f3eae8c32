"""A small sequence model that uses every distgrad.parallel pattern, trained on one process and
on N processes, step by step side by side.

The rows of the batch are the positions of one sequence, split over the ranks in order (rank
0 the first rows). Each block: a synchronized batch norm; a sequence-parallel MLP (column-
then row-parallel, hidden features split over the ranks); a top-2 mixture of experts with a
capacity that drops tokens (experts spread over the ranks); causal ring attention over the
whole sequence; a linear head and a squared error. Each rank returns its share of the global
mean loss and the ranks sum their gradients (the sum contract: docs/patterns.md), then every
rank takes the same SGD step.

It prints the checker's verdict on the first step, then each step's loss on one process and
on the ranks, and how far the parameters are from the one-process run's.

Run: python examples/parallel_patterns.py [world_size]
"""

from __future__ import annotations

import sys

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor, nn

import distgrad as dg
from distgrad import parallel as P
from distgrad.testing import check_against_single_process, run_on_ranks

D, HIDDEN, EXPERTS, TOKENS = 8, 12, 4, 24
DT = torch.float64


class Model(nn.Module):
    """The whole model; every rank holds a copy and uses its shard of the split layers."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.norm = P.SyncBatchNorm(D, dtype=DT)
        self.fc1, self.fc2 = nn.Linear(D, HIDDEN, dtype=DT), nn.Linear(HIDDEN, D, dtype=DT)
        self.router = nn.Linear(D, EXPERTS, bias=False, dtype=DT)
        self.experts = nn.ModuleList(nn.Linear(D, D, dtype=DT) for _ in range(EXPERTS))
        self.qkv = nn.Linear(D, 3 * D, bias=False, dtype=DT)
        self.head = nn.Linear(D, 1, dtype=DT)


def _rank_size() -> tuple[int, int]:
    return (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)


def _my_features(total: int) -> slice:
    rank, size = _rank_size()
    base, extra = divmod(total, size)
    sizes = [base + (1 if r < extra else 0) for r in range(size)]
    return slice(sum(sizes[:rank]), sum(sizes[: rank + 1]))


def loss_fn(model: Model, x: Tensor, target: Tensor) -> Tensor:
    """This rank's share of the global mean squared error; x: [T_r, D], its sequence rows."""
    _, size = _rank_size()
    count = torch.tensor([[x.shape[0]]])
    rows = dg.all_gather(count, sizes=[1] * size).view(-1).tolist()  # every rank's T_r
    h = model.norm(x)
    cols = _my_features(HIDDEN)  # this rank's hidden features of the MLP
    mid = P.column_parallel_linear(
        h, model.fc1.weight[cols], model.fc1.bias[cols], sequence_parallel=True, sizes=rows
    )
    h = h + P.row_parallel_linear(
        F.gelu(mid), model.fc2.weight[:, cols], model.fc2.bias, sequence_parallel=True, sizes=rows
    )
    routing = P.route(model.router(h), 2, capacity=TOKENS // 2)
    parts = P.dispatch(h, routing).split(routing.expert_sizes)
    outs = [
        torch.tanh(model.experts[e](part))
        for e, part in zip(routing.local_experts, parts, strict=True)
    ]
    h = h + P.combine(torch.cat(outs) if outs else h.new_zeros(0, D), routing)
    q, k, v = model.qkv(h)[None].chunk(3, dim=-1)  # [1, T_r, D] each: one head
    h = h + P.ring_attention(q, k, v, causal=True, sizes=rows)[0]
    return ((model.head(h) - target) ** 2).sum() / TOKENS


def _data(step: int) -> tuple[Tensor, Tensor]:
    g = torch.Generator().manual_seed(100 + step)
    x = torch.randn(TOKENS, D, dtype=DT, generator=g)
    return x, torch.sin(x.sum(1, keepdim=True))


def _train(rank: int, world_size: int, steps: int) -> tuple[list[float], dict[str, Tensor]]:
    """SGD on this rank's rows; gradients summed over ranks. Returns the global losses."""
    model = Model()
    sizes = [len(r) for r in torch.arange(TOKENS).tensor_split(world_size)]
    losses = []
    for step in range(steps):
        x, target = (t.split(sizes)[rank] for t in _data(step))
        loss = loss_fn(model, x, target)
        model.zero_grad()
        loss.backward()
        total = loss.detach().clone()
        if world_size > 1:  # sum the shares and every parameter's gradient over the ranks
            dist.all_reduce(total)
            for p in model.parameters():
                if p.grad is None:  # an expert another rank holds
                    p.grad = torch.zeros_like(p)
                dist.all_reduce(p.grad)
        with torch.no_grad():
            for p in model.parameters():
                if p.grad is not None:
                    p -= 0.1 * p.grad
        losses.append(float(total))
    return losses, {k: v.detach().clone() for k, v in model.state_dict().items()}


def main(world_size: int = 3, steps: int = 5) -> tuple[bool, list[float], list[float], float]:
    """Print and return the checker's verdict, each step's loss on one process and on the
    ranks, and the largest parameter difference after the last step."""
    x, target = _data(0)
    report = check_against_single_process(
        loss_fn, {"x": x, "target": target}, world_size=world_size, model=Model, gradients="summed"
    )
    worst = max(c.max_abs_error for c in report.checks)
    verdict = "AGREE" if report.ok else "MISMATCH"
    print(f"checker, first batch, {world_size} ranks: {verdict} (largest deviation {worst:.1e})")
    if not report.ok:
        print(report)
    one, one_state = _train(0, 1, steps)
    many, many_state = run_on_ranks(_train, world_size, args=(steps,))[0]
    distance = max(float((one_state[k] - many_state[k]).abs().max()) for k in one_state)
    print(f"{'step':>4}  {'one process':>14}  {f'{world_size} ranks':>14}  {'|difference|':>12}")
    for step, (a, b) in enumerate(zip(one, many, strict=True)):
        print(f"{step:>4}  {a:>14.10f}  {b:>14.10f}  {abs(a - b):>12.1e}")
    print(f"largest parameter difference after {steps} steps: {distance:.1e}")
    return report.ok, one, many, distance


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 3)
