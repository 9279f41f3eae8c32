"""Each case run on real ranks, drop-in and peer side by side, and its single-process truth.

Shared by the tests and by ``python -m tests.integrations.compare`` (the figures of
docs/integrations.md: the largest difference of each pair, and the peers' ratios).
"""

from __future__ import annotations

import sys
from typing import Any

import torch
from torch import Tensor

from distgrad.testing import run_on_ranks
from tests._support import seeded
from tests.integrations.cases import CASES, ROWS, Case, batch, call, dropin_class, peer_class

__all__ = ["Result", "on_ranks", "truth"]

# (value, [gradient of each row tensor's shard, then of each scalar]) per (who, cotangent)
Result = dict[tuple[str, str], tuple[float, list[Tensor]]]


def weights(world_size: int) -> Tensor:
    """Each rank's random scalar cotangent (in [0.5, 1.5): none near 0)."""
    return torch.rand(world_size, dtype=torch.float64, generator=seeded(100 + world_size)) + 0.5


def _loss(out: Tensor | dict[str, Tensor]) -> Tensor:
    return out["contrastive_loss"] if isinstance(out, dict) else out


def _one(
    cls: Any,
    case: Case,
    rows: list[Tensor],
    scalars: list[Tensor],
    rank: int,
    world: int,
    weight: float,
) -> tuple[float, list[Tensor]]:
    leaves = [t.clone().requires_grad_() for t in rows + scalars]
    loss = _loss(call(cls, case, leaves[: len(rows)], leaves[len(rows) :], rank, world))
    (loss * weight).backward()
    grads = [t.grad if t.grad is not None else torch.zeros_like(t) for t in leaves]
    return float(loss.item()), grads


def _rank(rank: int, world_size: int, names: list[str]) -> dict[str, Result]:
    """On one rank: every named case, the drop-in and the peer, each back-propagating its
    loss times this rank's random cotangent ("c") and times 1 ("one")."""
    c = float(weights(world_size)[rank])
    out: dict[str, Result] = {}
    for case in (k for k in CASES if k.name in names):
        rows, scalars = batch(case, world_size)
        mine = [t[rank * ROWS : (rank + 1) * ROWS] for t in rows]
        result: Result = {}
        for who, cls in (("dropin", dropin_class(case)), ("peer", peer_class(case))):
            for tag, weight in (("c", c), ("one", 1.0)):
                result[who, tag] = _one(cls, case, mine, scalars, rank, world_size, weight)
        out[case.name] = result
    return out


def on_ranks(world_size: int, names: list[str]) -> list[dict[str, Result]]:
    """Every named case on ``world_size`` real ranks (one launch)."""
    return run_on_ranks(_rank, world_size, args=(names,), timeout=90)


def truth(case: Case, world_size: int) -> tuple[float, list[Tensor]]:
    """The single-process truth: the peer's own class in this process (no process group),
    on the whole global batch, its loss back-propagated once."""
    rows, scalars = batch(case, world_size)
    leaves = [t.clone().requires_grad_() for t in rows + scalars]
    loss = _loss(
        call(peer_class(case), case, leaves[: len(rows)], leaves[len(rows) :], 0, 1, alone=True)
    )
    loss.backward()
    return float(loss.item()), [
        t.grad if t.grad is not None else torch.zeros_like(t) for t in leaves
    ]


def _figures(world_size: int) -> None:
    results = on_ranks(world_size, [c.name for c in CASES])
    for case in CASES:
        value, grads = truth(case, world_size)
        n_rows = len(batch(case, world_size)[0])
        dropin_v = max(abs(r[case.name]["dropin", "one"][0] - value) for r in results)
        worst = 0.0
        for rank, r in enumerate(results):
            g = r[case.name]["dropin", "one"][1]
            for i in range(n_rows):
                want = world_size * grads[i][rank * ROWS : (rank + 1) * ROWS]
                worst = max(worst, float((g[i] - want).abs().max()))
        peer_rows = [
            float(
                torch.cat([r[case.name]["peer", "one"][1][i] for r in results]).norm()
                / (world_size * grads[i]).norm()
            )
            for i in range(n_rows)
        ]
        versus = max(
            float((a - b).abs().max())
            for r in results
            for a, b in zip(
                r[case.name]["dropin", "c"][1], r[case.name]["peer", "c"][1], strict=True
            )
        )
        print(
            f"W={world_size} {case.name:38s} drop-in vs truth: value {dropin_v:.1e} "
            f"grad {worst:.1e}; drop-in vs peer grad {versus:.1e}; peer rows/needed "
            + " ".join(f"{x:.3f}" for x in peer_rows)
        )


if __name__ == "__main__":
    for w in [int(a) for a in sys.argv[1:]] or [1, 2, 3, 4]:
        _figures(w)
