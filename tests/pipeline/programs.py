"""Pipeline programs written with distgrad.pipeline, for ``dg.testing.check_pipeline(schedule=...)``
(tests/pipeline/test_checked.py). Module level, so that they pickle to the ranks.

One program runs any number of stages per rank, in any layout: every microbatch goes through
the stages in order (a stage's input is received when the previous stage is on another rank,
passed on when it is on this one), then the microbatches' backwards run in order, one
``dg.pipeline.backward`` each. The planted mistakes: the loss never divided by the number of
microbatches, and a boundary whose received activation is detached.

Under DDP on a data-parallel dim, DDP's reducer must average the gradients once, after the
last microbatch: ``distgrad_program_ddp`` runs every microbatch but the last forward and
backward in ``no_sync()`` (gradient accumulation, as DDP documents it), then the last one with
its synchronisation on. The plain program forwards every microbatch before any backward, which
DDP's reducer does not follow (it averages nothing): the checker says so.
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from typing import Any

import torch.distributed as dist
from torch import Tensor, nn

import distgrad.pipeline as dgp


def _program(
    stages: Sequence[nn.Module],
    indices: Sequence[int],
    micro: Any,
    loss_fn: Any,
    group: Any,
    *,
    divide: bool = True,
    detach: bool = False,
    ddp: bool = False,
) -> list[Tensor] | None:
    held = dict(zip(indices, stages, strict=True))
    ranks, n = micro.stage_ranks, len(micro)
    last = len(ranks) - 1
    me = dist.get_rank(group)
    losses: list[Tensor] = []
    with dgp.context() as cid:
        roots: dict[int, Tensor] = {}
        # Under DDP: every microbatch but the last, forward and backward, without DDP's sync.
        rounds = [list(range(n - 1)), [n - 1]] if ddp else [list(range(n))]
        for microbatches in rounds:
            sync = not ddp or microbatches == [n - 1]
            with contextlib.ExitStack() as quiet:
                if not sync:
                    for stage in stages:
                        quiet.enter_context(stage.no_sync())  # type: ignore[operator]
                _forward(
                    held, micro, microbatches, me, group, loss_fn, roots, losses, divide, detach
                )
                for m in microbatches:
                    dgp.backward(cid, [roots[m]] if m in roots else [], microbatch=m)
    return losses if me == ranks[last] else None


def _forward(
    held: dict[int, nn.Module],
    micro: Any,
    microbatches: list[int],
    me: int,
    group: Any,
    loss_fn: Any,
    roots: dict[int, Tensor],
    losses: list[Tensor],
    divide: bool,
    detach: bool,
) -> None:
    ranks, n = micro.stage_ranks, len(micro)
    last = len(ranks) - 1
    for m in microbatches:
        h: Tensor | None = None
        for s in range(len(ranks)):
            if ranks[s] != me:
                continue
            if s == 0:
                h = micro.inputs[m][0]
            elif ranks[s - 1] != me:  # else h is the previous stage's output, here
                h = dgp.recv(ranks[s - 1], group, microbatch=m)
                h = h.detach() if detach else h
            assert h is not None
            out = held[s](h)
            if s == last:
                loss = loss_fn(out, micro.targets[m])
                losses.append(loss.detach())
                roots[m] = loss / n if divide else loss
            elif ranks[s + 1] != me:
                dgp.isend(out, ranks[s + 1], group, microbatch=m)
            h = out


def distgrad_program(*args: Any) -> list[Tensor] | None:
    return _program(*args)


def distgrad_program_ddp(*args: Any) -> list[Tensor] | None:
    """For DDP on a data-parallel dim: its sync only in the last microbatch's backward."""
    return _program(*args, ddp=True)


def distgrad_program_undivided(*args: Any) -> list[Tensor] | None:
    """The mistake: the loss is never divided by the number of microbatches."""
    return _program(*args, divide=False)


def distgrad_program_detached(*args: Any) -> list[Tensor] | None:
    """The mistake: every received activation is used detached."""
    return _program(*args, detach=True)
