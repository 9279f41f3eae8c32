"""open_clip's default ``ClipLoss()`` (``local_loss=False, gather_with_grad=False``): the
features get 1/W of their gradient under DDP.

Thread: github.com/mlfoundations/open_clip, src/open_clip/loss.py ``gather_features`` (and
docs/losses.md, "Conventions"). Every rank gathers both modalities with the raw
``dist.all_gather`` (no gradient), puts its own features back in its slot so that they carry
a gradient, and computes the whole global loss. Each rank's features then get the gradient of
the global loss through their own slot only, where DDP's averaging needs W times that.

The checker: "the gradient of image, text is scaled by 1/N" (1/2 on 2 ranks).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor

import distgrad as dg


def _gather_no_grad(x: Tensor) -> Tensor:
    if not dist.is_initialized():
        return x
    parts = [torch.empty_like(x) for _ in range(dist.get_world_size())]
    dist.all_gather(parts, x)
    parts[dist.get_rank()] = x  # the own slot carries the gradient, the others none
    return torch.cat(parts)


def loss(image: Tensor, text: Tensor) -> Tensor:
    all_image, all_text = _gather_no_grad(image), _gather_no_grad(text)
    logits = 10.0 * all_image @ all_text.T  # the global logits, on every rank
    labels = torch.arange(logits.shape[0])
    return (F.cross_entropy(logits, labels) + F.cross_entropy(logits.T, labels)) / 2


def make_inputs() -> dict[str, Tensor]:
    gen = torch.Generator().manual_seed(0)
    image, text = (torch.randn(8, 4, dtype=torch.float64, generator=gen) for _ in range(2))
    return {"image": F.normalize(image, dim=1), "text": F.normalize(text, dim=1)}


def check(world_size: int = 2) -> dg.testing.GradReport:
    return dg.testing.check_against_single_process(loss, make_inputs(), world_size=world_size)


if __name__ == "__main__":
    print(check())
