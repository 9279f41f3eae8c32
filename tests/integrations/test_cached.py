"""``CachedMultipleNegativesRankingLoss`` against sentence-transformers' own cached class
(GradCache), on 1 to 3 real ranks, float64, tolerance FLOAT64.

Semantics asserted: both built with the same arguments (``gather_across_devices=True``,
mini-batches of 2 of each rank's 5 rows, so the last mini-batch is short), on the same
encoder with dropout (each loss starts from the same seed, so both draw the same masks in
their first pass and must replay them in the second), each rank back-propagating the loss
times its own random cotangent: the encoder's gradients are equal rank by rank, and the mean
over ranks of sentence-transformers' values (each the mean over its rank's anchors) is the
drop-in's value on every rank. With GradCache the loss's own backward runs inside the forward,
so a rank's cotangent scales its replay only: both classes give each rank
``c_r * d(sum_s L_s)/d(its parameters)``, and with cotangent 1 (tests/integrations/
test_one_import.py) DDP's averaging gives the single-process gradient.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from distgrad.integrations.sentence_transformers import CachedMultipleNegativesRankingLoss
from distgrad.testing import run_on_ranks
from tests._support import FLOAT64, seeded
from tests.integrations import peers
from tests.integrations.snippets import Encoder

pytestmark = pytest.mark.skipif(
    not peers.installed("sentence_transformers"),
    reason="needs sentence-transformers==6.2.0 (pip install --no-deps ...)",
)

ROWS, COLUMNS = 5, 3  # per rank: anchors, positives, one hard negative
CONFIGS: list[dict[str, Any]] = [
    {},
    {"directions": ("query_to_doc", "doc_to_query"), "partition_mode": "per_direction"},
]


def _rank(rank: int, world_size: int) -> list[list[tuple[float, torch.Tensor, torch.Tensor]]]:
    gen = seeded(21)
    batch = [
        torch.randn(world_size * ROWS, 5, dtype=torch.float64, generator=gen)
        for _ in range(COLUMNS)
    ]
    mine = [{"input_ids": t[rank * ROWS : (rank + 1) * ROWS]} for t in batch]
    c = float(torch.rand(world_size, generator=seeded(22), dtype=torch.float64)[rank]) + 0.5
    peer = peers.st_cached_loss().CachedMultipleNegativesRankingLoss
    out = []
    for config in CONFIGS:
        pair = []
        for cls in (peer, CachedMultipleNegativesRankingLoss):
            torch.manual_seed(1000 + rank)  # the dropout masks: one stream for both losses
            model = Encoder(dropout=0.3)
            loss = cls(model, scale=7.0, mini_batch_size=2, gather_across_devices=True, **config)(
                mine, None
            )
            (loss * c).backward()
            pair.append((float(loss.detach()), model.layer.weight.grad, model.layer.bias.grad))
        out.append(pair)
    return out


# 1 and 3 ranks in the slow tier; the default tier keeps 2
@pytest.mark.parametrize(
    "world", [pytest.param(1, marks=pytest.mark.slow), 2, pytest.param(3, marks=pytest.mark.slow)]
)
def test_the_cached_drop_in_equals_sentence_transformers_cached_loss(world: int) -> None:
    results = run_on_ranks(_rank, world, timeout=90)
    for k in range(len(CONFIGS)):
        theirs = [r[k][0] for r in results]
        ours = [r[k][1] for r in results]
        for rank, (t, o) in enumerate(zip(theirs, ours, strict=True)):
            for i in (1, 2):
                torch.testing.assert_close(o[i], t[i], **FLOAT64, msg=f"config {k} rank {rank}")
            torch.testing.assert_close(o[0], sum(v[0] for v in theirs) / world, **FLOAT64)
