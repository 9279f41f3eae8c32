"""What the gather-based losses share: global offsets, and the value/gradient contract.

Contract (docs/losses.md): every rank gets the **global** mean loss as the value, and a
gradient equal to world_size times the gradient of its own share of that mean. The shares add
up to the global loss, so the ranks' gradients sum to world_size times the single-process
gradient, and DistributedDataParallel's averaging yields exactly the single-process gradient,
with no scaling by the user. (Summing gradients by hand instead: divide the loss by world_size.)
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import Tensor

from distgrad import _comm
from distgrad._group import ProcessGroup, resolve
from distgrad.collectives.all_gather import all_gather

__all__ = ["global_mean", "row_offset"]


def row_offset(rows: int, group: ProcessGroup | None) -> tuple[int, int]:
    """(this rank's first row in the gathered batch, the global row count)."""
    sizes = all_gather(torch.tensor([rows], dtype=torch.int64, device=_device(group)), group)
    rank = resolve(group).rank
    return int(sizes[:rank].sum()), int(sizes.sum())


def _device(group: ProcessGroup | None) -> torch.device:
    return _comm.metadata_device(resolve(group))


def global_mean(local_sum: Tensor, count: int, group: ProcessGroup | None) -> Tensor:
    """The global mean of per-row losses as the value; world_size times the local share's
    gradient as the gradient (see the module docstring)."""
    g = resolve(group)
    share = local_sum * (g.size / count)
    total = _comm.all_reduce(local_sum.detach().reshape(1), "sum", g).reshape(())
    return share + (total / count - share).detach()


def world_size(group: ProcessGroup | None) -> int:
    return resolve(group).size if dist.is_available() else 1
