"""A short DDP training with a distgrad loss, as one torchrun worker runs it.

    torchrun ... tests/torchrun/train.py OUT_DIR

Each worker reads RANK and WORLD_SIZE from torchrun's environment, trains its shard of a fixed
global batch for STEPS SGD steps (an encoder under DDP, ``dg.losses.CLIPLoss`` with its
learnable scale outside DDP), and writes its parameters to ``OUT_DIR/rank{RANK}.pt``. The test
imports the same pieces to train one process on the whole batch.
"""

from __future__ import annotations

import faulthandler
import os
import sys
from datetime import timedelta
from pathlib import Path

import torch
from torch import Tensor, nn

import distgrad as dg

ROWS, STEPS = 16, 3


def make_models() -> tuple[nn.Module, nn.Module]:
    torch.manual_seed(0)
    return nn.Linear(6, 4).double(), dg.losses.CLIPLoss(10.0).double()


def batch() -> tuple[Tensor, Tensor]:
    gen = torch.Generator().manual_seed(1)
    base = torch.randn(ROWS, 6, dtype=torch.float64, generator=gen)
    return base, base + 0.3 * torch.randn(ROWS, 6, dtype=torch.float64, generator=gen)


def train(encoder: nn.Module, criterion: nn.Module, images: Tensor, texts: Tensor) -> None:
    optimizer = torch.optim.SGD([*encoder.parameters(), *criterion.parameters()], lr=0.5)
    for _ in range(STEPS):
        optimizer.zero_grad()
        criterion(encoder(images), encoder(texts)).backward()
        optimizer.step()


def parameters(encoder: nn.Module, criterion: nn.Module) -> dict[str, Tensor]:
    named = [*encoder.named_parameters(), *criterion.named_parameters()]
    return {name: p.detach().clone() for name, p in named}


def main(out: Path) -> None:
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    (out / f"pid{rank}").write_text(str(os.getpid()))  # the test kills it if it must
    faulthandler.dump_traceback_later(60, exit=True)  # a hung worker prints its stack and exits
    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=timedelta(seconds=30))
    encoder, criterion = make_models()
    images, texts = batch()
    rows = slice(rank * ROWS // world, (rank + 1) * ROWS // world)
    ddp = DistributedDataParallel(encoder)
    train(ddp, criterion, images[rows], texts[rows])
    torch.save(parameters(encoder, criterion), out / f"rank{rank}.pt")
    dist.destroy_process_group()
    # Kept armed through the interpreter's exit: a worker that hangs there prints its stacks.
    faulthandler.dump_traceback_later(30, exit=True)


if __name__ == "__main__":
    main(Path(sys.argv[1]))
