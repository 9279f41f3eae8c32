"""What the parts call: every op's name, and the calls of a training step (every op with its
sizes given, every loss), which ``sync`` and ``compile`` run."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

import distgrad as dg

OPS = (
    "all_gather",
    "reduce_scatter",
    "all_reduce",
    "all_to_all",
    "broadcast",
    "reduce",
    "gather",
    "scatter",
    "permute",
)

Call = Callable[[Tensor], Tensor]


def step_calls(
    rank: int, n: int, where: torch.device, dtype: torch.dtype
) -> list[tuple[str, Call]]:
    """Every op and loss as a scalar function of this rank's ``x`` ([4, 8], on ``where``, of
    ``dtype``), each with every size given, so that past the checked calls none exchanges
    metadata."""
    ring = [(r + 1) % n for r in range(n)]
    gen = torch.Generator().manual_seed(7 + rank)
    weights = torch.randn(4 * n, 8, generator=gen, dtype=dtype).to(where)  # random cotangents

    def weighted(out: Tensor, x: Tensor) -> Tensor:
        return (out * weights[: out.shape[0], : out.shape[1]]).sum()

    L = dg.losses
    sizes = [4] * n
    ops: list[tuple[str, Call]] = [
        ("all_gather", lambda x: weighted(dg.all_gather(x, sizes=sizes), x)),
        ("reduce_scatter", lambda x: weighted(dg.reduce_scatter(x.repeat(n, 1)), x)),
        ("all_reduce sum", lambda x: weighted(dg.all_reduce(x), x)),
        ("all_reduce max", lambda x: weighted(dg.all_reduce(x, "max"), x)),
        ("all_reduce prod", lambda x: weighted(dg.all_reduce(x, "prod"), x)),
        ("all_to_all", lambda x: weighted(dg.all_to_all(x.repeat(n, 1)), x)),
        ("broadcast", lambda x: weighted(dg.broadcast(x, n - 1), x)),
        ("reduce", lambda x: weighted(dg.reduce(x, 0), x)),
        ("gather", lambda x: weighted(dg.gather(x, 0, sizes=sizes), x)),
        (
            "scatter",
            lambda x: weighted(dg.scatter(x.repeat(n, 1) if rank == 0 else x, 0, sizes=sizes), x),
        ),
        ("permute", lambda x: weighted(dg.permute(x, ring, recv_shape=(4, 8)), x)),
    ]
    clip = L.CLIPLoss(10.0).to(where, dtype)
    siglip = L.SigLIPLoss(block_size=3).to(where, dtype)

    def pair(x: Tensor) -> tuple[Tensor, Tensor]:
        return x, x.flip(0) + weights[:4]

    losses: list[tuple[str, Call]] = [
        ("info_nce", lambda x: L.info_nce(*pair(x), sizes=sizes)),
        ("info_nce ring", lambda x: L.info_nce(*pair(x), sizes=sizes, block_size=3)),
        ("nt_xent", lambda x: L.nt_xent(*pair(x), temperature=0.3, sizes=sizes)),
        ("nt_xent ring", lambda x: L.nt_xent(*pair(x), sizes=sizes, block_size=3)),
        ("clip_loss", lambda x: L.clip_loss(*pair(x), 10.0, sizes=sizes)),
        ("clip_loss ring", lambda x: L.clip_loss(*pair(x), sizes=sizes, block_size=2)),
        ("siglip_loss", lambda x: L.siglip_loss(*pair(x), sizes=sizes)),
        ("barlow_twins", lambda x: L.barlow_twins(*pair(x), sizes=sizes)),
        ("CLIPLoss", lambda x: clip(*pair(x), sizes=sizes)),
        ("SigLIPLoss ring", lambda x: siglip(*pair(x), sizes=sizes)),
    ]
    return ops + losses


def leaf(rank: int, where: torch.device, dtype: torch.dtype, seed: int) -> Tensor:
    gen = torch.Generator().manual_seed(seed * 100 + rank)
    return torch.randn(4, 8, generator=gen, dtype=dtype).to(where).requires_grad_()
