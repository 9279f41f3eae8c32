"""One changed import: a training step written the peer's way (``snippets.py``), run under
DistributedDataParallel on 2 real ranks with the drop-in's import line, gives the
single-process step.

Semantics asserted (float64, tolerance FLOAT64): the loss on every rank is the single-process
loss of the whole batch, and every parameter's gradient after DDP's averaging is its
single-process gradient, computed in this process by the peer's own class on the whole
batch (sentence-transformers: its ``compute_loss_from_embeddings`` on the model's
embeddings). The same step with the peer's import line shows what the peer gives: open_clip's
default ``ClipLoss()`` halves the encoders' gradients on 2 ranks and keeps the logit scale's;
lightly's ``NTXentLoss(gather_distributed=True)`` is exact. The cached variant (GradCache,
mini-batches of 2 of each rank's 3 rows) gives the same step as the uncached loss.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.nn.parallel import DistributedDataParallel

from distgrad.testing import run_on_ranks
from tests._support import FLOAT64, seeded
from tests.integrations import peers
from tests.integrations.snippets import Encoder, TwoTower, step_function

pytestmark = pytest.mark.skipif(
    not all(peers.installed(p) for p in ("open_clip", "lightly", "sentence_transformers")),
    reason="needs the peers installed (tests/integrations/peers.py)",
)

WORLD, ROWS = 2, 3
LIBRARIES = ["open_clip", "lightly", "sentence_transformers", "sentence_transformers_cached"]


def _batch(library: str) -> list[Tensor]:
    gen = seeded(5)
    rows = WORLD * ROWS
    if library == "open_clip":
        shapes = [(rows, 5), (rows, 6)]
    elif library == "lightly":
        shapes = [(rows, 5), (rows, 5)]
    else:
        shapes = [(rows, 5)] * 3
    return [torch.randn(s, dtype=torch.float64, generator=gen) for s in shapes]


def _model(library: str) -> nn.Module:
    return TwoTower() if library == "open_clip" else Encoder()


def _grads(model: nn.Module) -> dict[str, Tensor]:
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def _rank(rank: int, world_size: int, runs: list[tuple[str, str]]) -> list[Any]:
    out = []
    for library, who in runs:
        model = DistributedDataParallel(_model(library))
        mine = [t[rank * ROWS : (rank + 1) * ROWS] for t in _batch(library)]
        loss = step_function(library, who)(model, *mine, dist.get_rank(), world_size)
        out.append(
            (float(loss.detach()), {n.removeprefix("module."): g for n, g in _grads(model).items()})
        )
    return out


def _truth(library: str) -> tuple[float, dict[str, Tensor]]:
    """The peer's own class, one process, the whole batch, one backward."""
    model, batch = _model(library), _batch(library)
    if library == "open_clip":
        loss_fn: Any = peers.open_clip_loss().ClipLoss()
        loss = loss_fn(*model(*batch))
    elif library == "lightly":
        loss = peers.lightly_loss().NTXentLoss(temperature=0.3)(model(batch[0]), model(batch[1]))
    else:
        loss_fn = peers.st_loss().MultipleNegativesRankingLoss(None, scale=7.0)
        embeddings = [model({"input_ids": t})["sentence_embedding"] for t in batch]
        loss = loss_fn.compute_loss_from_embeddings(embeddings, torch.empty(0))
    loss.backward()
    return float(loss.detach()), _grads(model)


def test_one_changed_import_gives_the_single_process_step() -> None:
    runs = [(library, "dropin") for library in LIBRARIES]
    runs += [("open_clip", "peer"), ("lightly", "peer")]
    results = run_on_ranks(_rank, WORLD, args=(runs,), timeout=90)
    for k, (library, who) in enumerate(runs):
        value, grads = _truth(library)
        for rank, r in enumerate(results):
            got_value, got = r[k]
            assert got.keys() == grads.keys()
            if who == "dropin" or library == "lightly":
                if who == "dropin":  # lightly's value on a rank is its own rows' mean
                    torch.testing.assert_close(got_value, value, **FLOAT64)
                for name, g in got.items():
                    torch.testing.assert_close(g, grads[name], **FLOAT64, msg=f"{library} {name}")
            else:  # open_clip's default ClipLoss(): the encoders at 1/W, the scale exact
                for name, g in got.items():
                    factor = 1.0 if name == "logit_scale" else 1 / WORLD
                    torch.testing.assert_close(
                        g, factor * grads[name], **FLOAT64, msg=f"{library} {name} on {rank}"
                    )
