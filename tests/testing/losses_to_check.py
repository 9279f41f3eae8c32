"""Losses written for one rank, right and wrong, for the checker's tests (module level, so they
pickle). Inputs: queries q and keys k, [B_local, D], float64.

Each is checked on processes and simulated (``simulate=True``: every rank in one Python
program), so a rank's own value enters as data (``_offset`` a tensor, ``_on_rank`` a per-rank
factor), not as a Python branch; ``calls_from_two_places`` branches on purpose.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor, nn

import distgrad as dg
from distgrad._demo.naive import LocalOnlyGather, MisroutedGather, overwrite_local_slot


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def _offset(rows: int) -> Tensor:
    """This rank's first global row, a 0-dim tensor."""
    sizes = dg.all_gather(torch.full((1,), rows))  # (full: ``rows`` may be a per-rank int)
    return sizes[: _rank()].sum()


def _on_rank(rank: int, value: float, otherwise: float) -> Tensor:
    """``value`` on rank ``rank`` and ``otherwise`` elsewhere (and in one process), a 0-dim
    float64 tensor."""
    world = dist.get_world_size() if dist.is_initialized() else 1
    every = torch.full((max(world, rank + 1),), otherwise, dtype=torch.float64)
    every[rank] = value if world > 1 else otherwise
    return every.select(0, _rank())  # not every[rank]: indexing needs one Python int


def _info_nce(q: Tensor, keys: Tensor) -> Tensor:
    """Mean over this rank's queries; the positive of query i is global key offset + i."""
    logits = q @ keys.T
    labels = torch.arange(q.shape[0]) + _offset(q.shape[0])
    return _cross_entropy(logits, labels).mean()


def _cross_entropy(logits: Tensor, labels: Tensor) -> Tensor:
    """Each row's ``F.cross_entropy(..., reduction="none")`` as log_softmax and a pick: torch's
    fused nll_loss cannot take a row count that differs between simulated ranks."""
    return -F.log_softmax(logits, 1).gather(1, labels.unsqueeze(1)).squeeze(1)


def right(q: Tensor, k: Tensor) -> Tensor:
    """Right for even shards: the local means add up to N times the global mean."""
    return _info_nce(q, dg.all_gather(k))


def right_for_uneven_shards(q: Tensor, k: Tensor) -> Tensor:
    """Right for any shards: N / B_global times the sum over local rows."""
    keys = dg.all_gather(k)
    world = dist.get_world_size() if dist.is_initialized() else 1
    logits = q @ keys.T
    labels = torch.arange(q.shape[0]) + _offset(q.shape[0])
    return _cross_entropy(logits, labels).sum() * world / keys.shape[0]


def with_temperature(q: Tensor, k: Tensor, temperature: Tensor) -> Tensor:
    """A 0-dim input: every rank gets all of it."""
    return right(q / temperature, k)


def local_only(q: Tensor, k: Tensor) -> Tensor:
    return _info_nce(q, LocalOnlyGather.apply(k))


def overwrite(q: Tensor, k: Tensor) -> Tensor:
    return _info_nce(q, overwrite_local_slot(k))


def _global_loss(keys: Tensor) -> Tensor:
    """Every rank computes the same loss of the whole gathered batch."""
    return (keys.sum(0) ** 2).sum() + (keys**3).sum()


def global_right(q: Tensor, k: Tensor) -> Tensor:
    return _global_loss(dg.all_gather(k)) + (q * 0).sum()


def global_local_only(q: Tensor, k: Tensor) -> Tensor:
    return _global_loss(LocalOnlyGather.apply(k)) + (q * 0).sum()


def global_misrouted(q: Tensor, k: Tensor) -> Tensor:
    return _global_loss(MisroutedGather.apply(k)) + (q * 0).sum()


def share(q: Tensor, k: Tensor) -> Tensor:
    """Each rank returns its share of the global mean: the shares add up to the loss."""
    keys = dg.all_gather(k)
    total_rows = len(keys)
    logits = q @ keys.T
    labels = torch.arange(len(q)) + _offset(len(q))
    return F.cross_entropy(logits, labels, reduction="sum") / total_rows


def raw_all_reduce(q: Tensor, k: Tensor) -> Tensor:
    """Centres keys on the global mean computed with a raw (non-differentiable) all_reduce."""
    total = k.sum(0)
    rows = torch.tensor(float(len(k)), dtype=k.dtype)
    if dist.is_initialized():
        total = total.clone()
        dist.all_reduce(total)  # autograd does not see this
        dist.all_reduce(rows)
    centred = k - total / rows
    return (centred**2).sum(1).log().mean() + (q * 0).sum()


def wrong_offsets(q: Tensor, k: Tensor) -> Tensor:
    """Forgets the rank offset of the positives: the forward already differs."""
    logits = q @ dg.all_gather(k).T
    return F.cross_entropy(logits, torch.arange(len(q)))


def scaled_on_rank_1(q: Tensor, k: Tensor) -> Tensor:
    """Rank 1's key gradient doubled."""
    k = k * 1.0
    factor = _on_rank(1, 2.0, 1.0)
    k.register_hook(lambda g: factor * g)
    return right(q, k)


def cut_on_rank_1(q: Tensor, k: Tensor) -> Tensor:
    """Rank 1's keys take part in the gather, but no gradient flows back to them."""
    keep = _on_rank(1, 0.0, 1.0)
    k = k * keep + (k * (1 - keep)).detach()
    return right(q, k)


def scaled_by_rank(q: Tensor, k: Tensor) -> Tensor:
    """Every rank's key gradient is off, by a different factor on each rank (distributed only)."""
    k = k * 1.0
    factor = torch.tensor(2.0, dtype=torch.float64) + _rank() if dist.is_initialized() else 1.0
    k.register_hook(lambda g: factor * g)
    return right(q, k)


def nan_on_rank_1(q: Tensor, k: Tensor) -> Tensor:
    return right(q, k * _on_rank(1, float("nan"), 1.0))


class Projector(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(4, 3).double()

    def forward(self, x: Tensor) -> Tensor:
        return self.linear(x)


def with_model(model: nn.Module, q: Tensor, k: Tensor) -> Tensor:
    return right(model(q), model(k))


def with_model_local_only(model: nn.Module, q: Tensor, k: Tensor) -> Tensor:
    return local_only(model(q), model(k))


def k_local_only(q: Tensor, k: Tensor) -> Tensor:
    """A bug in the k path only: k's gradient is 1/N of the truth, q's is right."""
    return _global_loss(LocalOnlyGather.apply(k)) + _global_loss(dg.all_gather(q))


def widths(q: Tensor, k: Tensor) -> Tensor:
    """Right; q and k may differ in width, and each enters the loss in its own way."""
    return (dg.all_gather(q) ** 2).sum() + 3 * dg.all_gather(k).sum()


def _gather_elsewhere(k: Tensor) -> Tensor:
    return dg.all_gather(k)


def calls_from_two_places(q: Tensor, k: Tensor) -> Tensor:
    """Right, but rank 0 makes the gather from another line than its peers."""
    keys = _gather_elsewhere(k) if _rank() == 0 else dg.all_gather(k)
    return _global_loss(keys) + (q * 0).sum()


def unguarded_world_size(q: Tensor, k: Tensor) -> Tensor:
    """Calls dist.get_world_size() with no process group in the single-process run."""
    return _global_loss(dg.all_gather(k)) * dist.get_world_size() + (q * 0).sum()
