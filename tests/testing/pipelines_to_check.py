"""Models and pipelines for the pipeline checker (tests/testing/test_pipeline_check.py): a
float64 MLP cut into stages, a model with tied input and output embeddings, and pipelines
right and deliberately wrong. Module level, so that they pickle to the ranks.

The MLP: ``8`` linear+tanh blocks of width ``D``, so that any number of stages up to 8 splits
it into equal runs of blocks (``split``); the loss is MSE per microbatch (a mean over its rows).

The tied model: an embedding matrix ``E`` used at the input (``x @ E``) and, transposed, at the
output (``h @ E.T``), held by the first and the last stage. The planted mistakes: the tied
gradient never summed between the two stages; the loss divided by the number of microbatches
by the schedule's loss and again by torch's ``scale_grads``, or not at all
(``scale_grads=False``); an activation detached at a stage boundary; a zero-bubble schedule
whose stage 1 never runs its weight-gradient step; and a hand-written program (``isend``/
``irecv`` and a manual backward, as torch's stage does) right, without its division by the
number of microbatches, divided by the number of stages too, and with a detached boundary.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor, nn
from torch.distributed.pipelining import schedules as torch_schedules

DT = torch.float64
D, BLOCKS, ROWS = 4, 8, 16


def make_mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        *(nn.Sequential(nn.Linear(D, D, dtype=DT), nn.Tanh()) for _ in range(BLOCKS))
    )


def batch() -> tuple[Tensor, Tensor]:
    gen = torch.Generator().manual_seed(1)
    return (torch.randn(ROWS, D, dtype=DT, generator=gen),
            torch.randn(ROWS, D, dtype=DT, generator=gen))  # fmt: skip


def mse(output: Tensor, target: Tensor) -> Tensor:
    return F.mse_loss(output, target)


def mse_over_microbatches(output: Tensor, target: Tensor) -> Tensor:
    """The mistake: a schedule's loss that divides by the number of microbatches (4), which
    torch's scale_grads divides by again."""
    return F.mse_loss(output, target) / 4


def split(model: nn.Module, n_stages: int) -> list[nn.Module]:
    """Equal runs of the MLP's blocks: stage modules holding the model's own blocks."""
    assert isinstance(model, nn.Sequential) and BLOCKS % n_stages == 0
    per = BLOCKS // n_stages
    return [nn.Sequential(*model[i * per : (i + 1) * per]) for i in range(n_stages)]


class _Detached(nn.Module):
    """A stage that detaches its input: the boundary into it is cut."""

    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self.inner = inner

    def forward(self, x: Tensor) -> Tensor:
        return self.inner(x.detach())


def split_detached_at_1(model: nn.Module, n_stages: int) -> list[nn.Module]:
    """The mistake: stage 1 detaches the activation it receives from stage 0."""
    stages = split(model, n_stages)
    stages[1] = _Detached(stages[1])
    return stages


class TiedNet(nn.Module):
    """Input embedding ``E`` ([V, D]) and the output projection ``E.T``, tied; 4 blocks."""

    def __init__(self) -> None:
        super().__init__()
        gen = torch.Generator().manual_seed(2)
        self.embed = nn.Parameter(torch.randn(6, D, dtype=DT, generator=gen))
        self.blocks = nn.Sequential(*(nn.Linear(D, D, dtype=DT) for _ in range(4)))

    def forward(self, x: Tensor) -> Tensor:
        return torch.tanh(self.blocks(x @ self.embed)) @ self.embed.T


class _EmbedIn(nn.Module):
    def __init__(self, net: TiedNet, blocks: nn.Module) -> None:
        super().__init__()
        self.embed, self.blocks = net.embed, blocks

    def forward(self, x: Tensor) -> Tensor:
        return self.blocks(x @ self.embed)


class _EmbedOut(nn.Module):
    def __init__(self, net: TiedNet, blocks: nn.Module) -> None:
        super().__init__()
        self.embed, self.blocks = net.embed, blocks

    def forward(self, h: Tensor) -> Tensor:
        return torch.tanh(self.blocks(h)) @ self.embed.T


def make_tied() -> nn.Module:
    torch.manual_seed(4)
    return TiedNet()


def tied_batch() -> tuple[Tensor, Tensor]:
    gen = torch.Generator().manual_seed(3)
    return (torch.randn(ROWS, 6, dtype=DT, generator=gen),
            torch.randn(ROWS, 6, dtype=DT, generator=gen))  # fmt: skip


def split_tied(model: nn.Module, n_stages: int) -> list[nn.Module]:
    """The first stage embeds, the last projects back with the same matrix."""
    assert isinstance(model, TiedNet) and 4 % n_stages == 0 and n_stages > 1
    per = 4 // n_stages
    runs = [nn.Sequential(*model.blocks[i * per : (i + 1) * per]) for i in range(n_stages)]
    return [_EmbedIn(model, runs[0]), *runs[1:-1], _EmbedOut(model, runs[-1])]


def sum_tied_grads(stages: Sequence[nn.Module], indices: Sequence[int], mesh: Any) -> None:
    """The right version: all-reduce the tied embedding's gradient between the first and the
    last stage's ranks (every rank makes the group, as new_group requires)."""
    pp = mesh.get_group("pp")
    size = dist.get_world_size(pp)
    first, last = 0, size - 1  # GPipe/1F1B: stage s on pipeline rank s
    pair = dist.new_group([dist.get_global_rank(pp, first), dist.get_global_rank(pp, last)])
    for stage in stages:
        if isinstance(stage, (_EmbedIn, _EmbedOut)):
            grad = stage.embed.grad
            assert grad is not None
            dist.all_reduce(grad, group=pair)


class _SkipsWeightStep(torch_schedules.ScheduleInterleavedZeroBubble):
    """The mistake: stage 1's weight-gradient step never runs (a zero-bubble schedule that
    drops it)."""

    def __init__(self, stages: list[Any], n_microbatches: int, **kwargs: Any) -> None:
        super().__init__(stages, n_microbatches, **kwargs)
        for stage in stages:
            if stage.stage_index == 1:
                stage.backward_weight_one_chunk = lambda *a, **k: None


SkipsWeightStep = _SkipsWeightStep
GPipeUnscaled = functools.partial(torch_schedules.ScheduleGPipe, scale_grads=False)


# A hand-written pipeline program: one stage per rank, GPipe order (every forward, then every
# backward), activations and gradients moved with isend/irecv, the backward by hand.
def _program(
    stages: Sequence[nn.Module],
    indices: Sequence[int],
    micro: Any,
    loss_fn: Any,
    group: Any,
    *,
    divide: bool = True,
    detach: bool = False,
    per_stage: bool = False,
) -> list[Tensor] | None:
    (stage,), (s,) = stages, indices
    n_stages, n = len(micro.stage_ranks), len(micro)
    prev = dist.get_global_rank(group, micro.stage_ranks[s - 1]) if s > 0 else None
    nxt = dist.get_global_rank(group, micro.stage_ranks[s + 1]) if s < n_stages - 1 else None
    saved, losses = [], []
    for i in range(n):
        if prev is None:
            x = micro.inputs[i][0]
        else:
            x = torch.empty(ROWS // n, D, dtype=DT)
            dist.irecv(x, prev, group=group).wait()
            x.requires_grad_(not detach)
        y = stage(x)
        if nxt is None:
            loss = loss_fn(y, micro.targets[i])
            losses.append(loss.detach())
            y = loss / n if divide else loss
            y = y / n_stages if per_stage else y
        else:
            dist.isend(y.detach().contiguous(), nxt, group=group).wait()
        saved.append((x, y))
    for x, y in saved:
        if nxt is None:
            grad = None
        else:
            grad = torch.empty_like(y)
            dist.irecv(grad, nxt, group=group).wait()
        torch.autograd.backward(y, grad)
        if prev is not None:
            g = x.grad if x.grad is not None else torch.zeros_like(x)
            dist.isend(g.contiguous(), prev, group=group).wait()
    return losses if nxt is None else None


def hand_program(*args: Any) -> list[Tensor] | None:
    return _program(*args)


def hand_program_undivided(*args: Any) -> list[Tensor] | None:
    """The mistake: the loss is never divided by the number of microbatches."""
    return _program(*args, divide=False)


def hand_program_over_stages(*args: Any) -> list[Tensor] | None:
    """The mistake: the loss divided by the number of stages too, as if pp were data
    parallel."""
    return _program(*args, per_stage=True)


def hand_program_detached(*args: Any) -> list[Tensor] | None:
    """The mistake: the received activation is used detached (no gradient recorded)."""
    return _program(*args, detach=True)


def program_never_sends(
    stages: Sequence[nn.Module], indices: Sequence[int], micro: Any, loss_fn: Any, group: Any
) -> list[Tensor] | None:
    """The mistake: stage 0 never sends its activation, so stage 1 waits for it."""
    (stage,), (s,) = stages, indices
    if s == 0:
        for inputs in micro.inputs:
            stage(inputs[0])
        return None
    x = torch.empty(ROWS // len(micro), D, dtype=DT)
    dist.irecv(x, dist.get_global_rank(group, micro.stage_ranks[0]), group=group).wait()
    return None
