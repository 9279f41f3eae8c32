"""open_clip #616: ``torch.distributed.nn.all_gather`` and the x W confusion.

Thread: github.com/mlfoundations/open_clip/issues/616 ("gather-with-grad without
local-loss?"). With ``gather_with_grad=True`` and no ``local_loss``, every rank computes the
whole global loss through ``torch.distributed.nn.all_gather``, whose backward sums every
rank's gradient into the owner's rows: each rank's features get W times their single-process
gradient. That looked like a bug; it is what DDP's averaging needs. Whether it is one depends
on how the gradients are combined: summed over ranks it is W times too large.

This reproduction runs the checker as a user who sums the gradients would
(``gradients="summed"``): "every gradient is scaled by 2 (image and text)"; its ``contract:``
line (``report.contracts``) says the same code is exact under DDP's averaging.
"""

from __future__ import annotations

import warnings

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor

import distgrad as dg


def _gather_with_grad(x: Tensor) -> Tensor:
    if not dist.is_initialized():
        return x
    with warnings.catch_warnings():  # torch.distributed.nn is deprecated
        warnings.simplefilter("ignore", FutureWarning)
        import torch.distributed.nn

        return torch.cat(torch.distributed.nn.all_gather(x))


def loss(image: Tensor, text: Tensor) -> Tensor:
    all_image, all_text = _gather_with_grad(image), _gather_with_grad(text)
    logits = 10.0 * all_image @ all_text.T  # the whole global loss, on every rank
    labels = torch.arange(logits.shape[0])
    return (F.cross_entropy(logits, labels) + F.cross_entropy(logits.T, labels)) / 2


def make_inputs() -> dict[str, Tensor]:
    gen = torch.Generator().manual_seed(4)
    image, text = (torch.randn(8, 4, dtype=torch.float64, generator=gen) for _ in range(2))
    return {"image": F.normalize(image, dim=1), "text": F.normalize(text, dim=1)}


def check(world_size: int = 2) -> dg.testing.GradReport:
    return dg.testing.check_against_single_process(
        loss, make_inputs(), world_size=world_size, gradients="summed"
    )


if __name__ == "__main__":
    print(check())
