"""A logit scale whose gradient is all-reduced in the loss's backward and then averaged again
by DDP: W times too large.

The pattern Inf-CL's code shows (github.com/DAMO-NLP-SG/Inf-CLIP): a custom backward sums the
logit scale's gradient over ranks itself, and DistributedDataParallel, which owns the scale as
a model parameter, averages it once more. The features are right; the scale steps W times too
far.

This reproduction: distgrad's exact ``clip_loss``, with the scale passed through a Function
whose backward all-reduces its gradient. The checker, with the model's parameters averaged
as DDP averages them: "the gradient of logit_scale is scaled by 2 (image.weight and
text.weight agree)".
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor, nn

import distgrad as dg


class TwoTower(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.image, self.text = (nn.Linear(5, 4, bias=False, dtype=torch.float64) for _ in range(2))
        self.logit_scale = nn.Parameter(torch.tensor(math.log(10.0), dtype=torch.float64))


class _SummedGradient(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, s: Tensor) -> Tensor:
        return s.clone()

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> Tensor:
        grad = grad.clone()
        if dist.is_initialized():
            dist.all_reduce(grad)  # the bug: DDP will average this sum again
        return grad


def loss(model: TwoTower, images: Tensor, texts: Tensor) -> Tensor:
    x, y = F.normalize(model.image(images), dim=1), F.normalize(model.text(texts), dim=1)
    scale = _SummedGradient.apply(model.logit_scale.exp())
    return dg.losses.clip_loss(x, y, scale, normalize=False)


def make_model() -> nn.Module:
    torch.manual_seed(6)
    return TwoTower()


def make_inputs() -> dict[str, Tensor]:
    gen = torch.Generator().manual_seed(6)
    return {
        "images": torch.randn(8, 5, dtype=torch.float64, generator=gen),
        "texts": torch.randn(8, 5, dtype=torch.float64, generator=gen),
    }


def check(world_size: int = 2) -> dg.testing.GradReport:
    return dg.testing.check_against_single_process(
        loss, make_inputs(), world_size=world_size, model=make_model
    )


if __name__ == "__main__":
    print(check())
