"""stable-pretraining PR #409: a distributed CLIP loss whose gather returned the local
features, top-1 0.36 against 0.42.

Thread: github.com/galilai-group/stable-pretraining/pull/409. Its ``all_gather`` helper
called ``torch.distributed.nn.functional.all_gather`` but dropped the result (a missing
``return``), so every rank fell through to the single-process ``(tensor,)``, and the targets
were ``arange(B)`` for the local batch: each rank trained a CLIP loss over its own rows only,
the other ranks' rows never negatives. It trains, and worse (0.36 top-1 against 0.42 after
the fix, on CC3M).

The checker: "the forward pass already differs: the ranks' losses [...] fit no convention".
"""

from __future__ import annotations

import warnings

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor

import distgrad as dg


def _all_gather(x: Tensor) -> tuple[Tensor, ...]:
    if dist.is_initialized():
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)
            import torch.distributed.nn.functional

            torch.distributed.nn.functional.all_gather(x)  # the bug: no return
    return (x,)


def loss(image: Tensor, text: Tensor) -> Tensor:
    all_image, all_text = torch.cat(_all_gather(image)), torch.cat(_all_gather(text))
    logits = 10.0 * all_image @ all_text.T
    labels = torch.arange(image.shape[0])  # arange(B): the local batch
    return (F.cross_entropy(logits, labels) + F.cross_entropy(logits.T, labels)) / 2


def make_inputs() -> dict[str, Tensor]:
    gen = torch.Generator().manual_seed(5)
    image, text = (torch.randn(8, 4, dtype=torch.float64, generator=gen) for _ in range(2))
    return {"image": F.normalize(image, dim=1), "text": F.normalize(text, dim=1)}


def check(world_size: int = 2) -> dg.testing.GradReport:
    return dg.testing.check_against_single_process(loss, make_inputs(), world_size=world_size)


if __name__ == "__main__":
    print(check())
