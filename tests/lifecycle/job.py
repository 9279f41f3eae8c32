"""One torchrun worker of the lifecycle stress: every op and loss past the checked calls, then
one of the endings a real job has.

    torchrun --standalone --nproc-per-node N tests/lifecycle/job.py ENDING

ENDING is one of :data:`ENDINGS`. The worker prints ``worked`` once its calls are done, so the
driver can tell a job that failed in its work from one that failed on the way out.
"""

from __future__ import annotations

import faulthandler
import os
import signal
import sys
import time
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.nn.functional as F

import distgrad as dg

ENDINGS = {
    "destroy": "destroy_process_group(), then return",
    "no_destroy": "return without destroying the group",
    "sys_exit": "sys.exit(0) in the middle of the script, group not destroyed",
    "raise": "rank 1 raises; the others wait in a collective and must get distgrad's error",
    "keyboard_interrupt": "every rank gets SIGINT (a KeyboardInterrupt) during its calls",
    "sigterm": "rank 1 dies of SIGKILL; torchrun sends SIGTERM to the others",
}

CALLS = 10  # past distgrad's checked calls (8)


def _every_op(rank: int, world: int) -> None:
    """Forward and backward of every collective and every loss, with random cotangents."""
    gen = torch.Generator().manual_seed(rank)

    def leaf(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen, requires_grad=True)

    def backward(out: torch.Tensor) -> None:
        (out * torch.randn(out.shape, generator=gen)).sum().backward()

    for _ in range(CALLS):
        backward(dg.all_gather(leaf(4, 8)))
        backward(dg.reduce_scatter(leaf(4 * world, 8)))
        for op in ("sum", "avg", "prod", "max", "min"):
            backward(dg.all_reduce(leaf(4, 8), op))
        backward(dg.all_to_all(leaf(2 * world, 8)))
        backward(dg.broadcast(leaf(4, 8), 0))
        backward(dg.reduce(leaf(4, 8), 0))
        backward(dg.gather(leaf(4, 8), 0))
        backward(dg.scatter(leaf(4 * world, 8) if rank == 0 else None, 0))
        backward(dg.permute(leaf(4, 8), [(r + 1) % world for r in range(world)]))
        # a 1 MB per rank exchange: the point-to-point path waited by a helper thread
        backward(dg.all_gather(leaf(512, 512)))
        # async_op=True: waited at first use, forward and backward (both sizes' paths)
        backward(dg.all_gather(leaf(4, 8), async_op=True))
        backward(dg.all_gather(leaf(512, 512), async_op=True))
        a, b = leaf(6, 8), leaf(6, 8)
        total = (
            dg.losses.nt_xent(a, b)
            + dg.losses.info_nce(a, b)
            + dg.losses.clip_loss(a, b)
            + dg.losses.siglip_loss(a, b)
            + dg.losses.barlow_twins(a, b)
            + dg.losses.clip_loss(a, b, block_size=3)
        )
        total.backward()
    # Never read: its exchange is in flight or done, unwaited, when the job ends.
    _UNREAD.append(dg.all_reduce(leaf(512, 512), async_op=True))


_UNREAD: list[torch.Tensor] = []  # lives until the interpreter's exit


def _ddp_with_clip_loss() -> torch.nn.Module:
    """A few DDP steps with a distgrad loss; returns the DDP module, which the caller keeps
    past ``destroy_process_group`` (its reducer then holds the group's last reference, the
    case that hung at exit: docs/lifecycle.md)."""
    from torch.nn.parallel import DistributedDataParallel

    torch.manual_seed(0)
    encoder = DistributedDataParallel(torch.nn.Linear(8, 4))
    criterion = dg.losses.CLIPLoss()
    optimizer = torch.optim.SGD([*encoder.parameters(), *criterion.parameters()], lr=0.1)
    for _ in range(CALLS):
        optimizer.zero_grad()
        x = torch.randn(6, 8)
        criterion(encoder(x), encoder(F.dropout(x, 0.1))).backward()
        optimizer.step()
    return encoder


def main(ending: str) -> None:
    faulthandler.enable(all_threads=True)  # a crash prints every thread's stack
    faulthandler.dump_traceback_later(90, exit=True)  # a hang prints its stack and exits
    torch.set_num_threads(1)
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    dist.init_process_group("gloo", timeout=timedelta(seconds=20))
    if ending == "keyboard_interrupt":
        signal.setitimer(signal.ITIMER_REAL, 0.3)  # a SIGALRM in the middle of the calls...
        signal.signal(signal.SIGALRM, lambda *_: signal.raise_signal(signal.SIGINT))  # ...^C
    _every_op(rank, world)
    if ending in ("raise", "sigterm"):
        if rank == 1 and ending == "raise":
            raise RuntimeError("injected failure on rank 1")
        if rank == 1:
            os.kill(os.getpid(), signal.SIGKILL)
        # rank 1 is gone: these calls must end in distgrad's error naming it (or torchrun's
        # SIGTERM comes first), never in an abort or a hang
        time.sleep(0.2)
        dg.all_reduce(torch.ones(3))
        dg.all_gather(torch.ones(512, 512))
        time.sleep(30)
    encoder = _ddp_with_clip_loss()  # freed when main returns, after any destroy below
    # One write of the whole line: with an unbuffered stdout, print() writes "worked", " " and
    # the rank separately, and torchrun's per-rank line prefixes then split it (seen in CI:
    # "[default2]:worked[default1]:worked 1" and "[default2]: 2", counted as 3 of 4 ranks).
    sys.stdout.write(f"worked {rank}\n")
    sys.stdout.flush()
    if ending == "keyboard_interrupt":
        time.sleep(30)  # the ^C arrives by now if the calls were quicker
    if ending == "sys_exit":
        sys.exit(0)
    if ending == "destroy":
        dist.destroy_process_group()
    # Kept armed through the interpreter's exit: a rank that hangs there prints its stacks.
    faulthandler.dump_traceback_later(30, exit=True)
    del encoder  # with "destroy", this frees the group itself (the reducer held it last)


if __name__ == "__main__":
    main(sys.argv[1])
