"""Train a small MLP split into pipeline stages for 3 steps, two ways, each checked against the
same model trained in one process.

1. through torch's own pipelining (``PipelineStage`` and ``Schedule1F1B``), which drives the
   stages' backward by hand;
2. through distgrad's point-to-point autograd (``distgrad.pipeline``): the stage boundary is a
   ``send``/``recv`` that autograd records, the microbatches run in the same 1F1B order, and
   one ``dg.pipeline.backward`` per microbatch carries the gradients back across the ranks.

Both use torch's loss convention (the mean over microbatches of each microbatch's loss) and
SGD. Each rank computes the one-process run itself (the whole model, the whole batch) and
compares its stage's parameters after every step, in float64.

Run on 2 (or 4) processes::

    torchrun --nproc-per-node 2 examples/pipeline.py
    python examples/pipeline.py            # starts 2 local ranks itself
"""

from __future__ import annotations

import os
import sys

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.pipelining import PipelineStage, Schedule1F1B

import distgrad.pipeline as dgp

LAYERS = 4  # Linear+Tanh blocks, split evenly over the stages
WIDTH = 8
BATCH = 16
MICROBATCHES = 4
STEPS = 3
LR = 0.1
TOLERANCE = 1e-10  # float64; the pipeline sums the same terms in another order


def make_model() -> nn.Sequential:
    torch.manual_seed(0)
    layers: list[nn.Module] = []
    for _ in range(LAYERS):
        layers += [nn.Linear(WIDTH, WIDTH, dtype=torch.float64), nn.Tanh()]
    return nn.Sequential(*layers)


def make_batch() -> tuple[Tensor, Tensor]:
    g = torch.Generator().manual_seed(1)
    x = torch.randn(BATCH, WIDTH, dtype=torch.float64, generator=g)
    return x, torch.randn(BATCH, WIDTH, dtype=torch.float64, generator=g)


def stage_of(model: nn.Sequential, stage: int, stages: int) -> nn.Sequential:
    per = len(model) // stages
    return model[stage * per : (stage + 1) * per]


def loss_fn(out: Tensor, target: Tensor) -> Tensor:
    return nn.functional.mse_loss(out, target)


def one_process(stage: int, stages: int) -> list[list[Tensor]]:
    """The reference: the whole model on the whole batch; each step's loss is the mean over
    microbatches of their losses. Returns ``stage``'s parameters after each step."""
    model = make_model()
    x, y = make_batch()
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    after = []
    for _ in range(STEPS):
        opt.zero_grad()
        pairs = zip(x.chunk(MICROBATCHES), y.chunk(MICROBATCHES), strict=True)
        loss = sum(loss_fn(model(xm), ym) for xm, ym in pairs) / MICROBATCHES
        loss.backward()  # type: ignore[union-attr]
        opt.step()
        after.append([p.detach().clone() for p in stage_of(model, stage, stages).parameters()])
    return after


def train_torch_schedule(rank: int, world: int) -> list[list[Tensor]]:
    """Torch's own pipelining: a PipelineStage per rank, the 1F1B schedule."""
    module = stage_of(make_model(), rank, world)
    x, y = make_batch()
    stage = PipelineStage(module, rank, world, torch.device("cpu"))
    schedule = Schedule1F1B(stage, n_microbatches=MICROBATCHES, loss_fn=loss_fn)
    opt = torch.optim.SGD(module.parameters(), lr=LR)
    after = []
    for _ in range(STEPS):
        opt.zero_grad()
        if rank == 0:
            schedule.step(x)
        elif rank == world - 1:
            schedule.step(target=y)
        else:
            schedule.step()
        opt.step()
        after.append([p.detach().clone() for p in module.parameters()])
    return after


def one_f_one_b(stage: int, stages: int) -> list[tuple[str, int]]:
    """The order a 1F1B schedule runs one stage's forwards (F) and backwards (B) in."""
    warmup = min(stages - stage - 1, MICROBATCHES)
    order = [("F", m) for m in range(warmup)]
    for m in range(MICROBATCHES):
        if warmup + m < MICROBATCHES:
            order.append(("F", warmup + m))
        order.append(("B", m))
    return order


def train_distgrad(rank: int, world: int) -> list[list[Tensor]]:
    """distgrad's point-to-point autograd: the boundary is a recorded send/recv."""
    module = stage_of(make_model(), rank, world)
    x, y = make_batch()
    xs, ys = x.chunk(MICROBATCHES), y.chunk(MICROBATCHES)
    opt = torch.optim.SGD(module.parameters(), lr=LR)
    after = []
    for _ in range(STEPS):
        opt.zero_grad()
        with dgp.context() as cid:
            losses: dict[int, Tensor] = {}
            for kind, m in one_f_one_b(rank, world):
                if kind == "F":
                    h = xs[m] if rank == 0 else dgp.recv(rank - 1, microbatch=m)
                    out = module(h)
                    if rank < world - 1:
                        dgp.isend(out, rank + 1, microbatch=m)
                    else:  # torch's convention: each microbatch's loss over their number
                        losses[m] = loss_fn(out, ys[m]) / MICROBATCHES
                else:
                    roots = [losses.pop(m)] if m in losses else []
                    dgp.backward(cid, roots, microbatch=m)
        opt.step()
        after.append([p.detach().clone() for p in module.parameters()])
    return after


def worst(got: list[list[Tensor]], want: list[list[Tensor]]) -> float:
    return max(
        (a - b).abs().max().item()
        for step_got, step_want in zip(got, want, strict=True)
        for a, b in zip(step_got, step_want, strict=True)
    )


def main(rank: int, world: int) -> float:
    torch.set_num_threads(1)
    reference = one_process(rank, world)
    found = {
        "torch Schedule1F1B": worst(train_torch_schedule(rank, world), reference),
        "distgrad.pipeline": worst(train_distgrad(rank, world), reference),
    }
    for name, diff in found.items():
        verdict = "AGREE" if diff < TOLERANCE else "DIFFER"
        print(
            f"rank {rank} stage {rank}: {name:20s} {verdict} with one process over "
            f"{STEPS} steps (largest difference {diff:.1e})",
            flush=True,
        )
    if max(found.values()) >= TOLERANCE:
        raise SystemExit(f"rank {rank}: a pipeline's parameters differ from one process's")
    return max(found.values())


if __name__ == "__main__":
    if "RANK" in os.environ:  # under torchrun
        dist.init_process_group("gloo")
        try:
            main(dist.get_rank(), dist.get_world_size())
        finally:
            rank = dist.get_rank()
            dist.destroy_process_group()
        print(f"rank {rank}: done, process group destroyed", flush=True)
    else:
        from distgrad.testing import run_on_ranks

        world = int(sys.argv[1]) if len(sys.argv) > 1 else 2
        run_on_ranks(main, world, timeout=120)
