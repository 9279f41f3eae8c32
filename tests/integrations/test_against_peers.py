"""The drop-in losses against their peers' own classes and the single-process truth.

Semantics asserted, for every case of ``cases.CASES`` on W = 1 to 4 real ranks (float64, even
shards of 3 rows, tolerance FLOAT64: only the order of the sums differs):

* **the truth**: the peer's own class in one process on the whole global batch. Each rank
  back-propagates the drop-in's loss (times 1): its value on every rank is the truth's, each
  rank's rows get W times their single-process gradient, and the scalars' (logit scale, bias)
  gradients averaged over ranks are the single-process ones: DistributedDataParallel's
  averaging gives exactly the single-process step, whatever the peer's flags say;
* **the peer, where it is exact**: where its value on a rank is the mean over that rank's rows
  (open_clip ``local_loss=True, gather_with_grad=True``, ``SigLipLoss``, lightly
  ``gather_distributed=True``, sentence-transformers ``gather_across_devices=True``), each
  rank back-propagates both losses times its own random cotangent, so a gradient routed to
  the wrong rank shows: the rows' gradients are equal rank by rank, the scalars' summed over
  ranks, and the mean over ranks of the peer's values is the drop-in's value. Where the peer
  puts the global loss on every rank (``gather_with_grad=True`` alone), the same with
  cotangent 1;
* **the peer, where it is not exact**: its gradients, under DDP's averaging, against the
  truth: open_clip's default ``ClipLoss()`` gives the features exactly 1/W of their gradient
  (the logit scale its exact one); ``local_loss=True`` alone, lightly without
  ``gather_distributed``, sentence-transformers without ``gather_across_devices`` and lightly's
  Barlow Twins (each rank's own batch statistics) are off by more than 1% and by no single
  factor. On one rank every peer equals the truth.
"""

from __future__ import annotations

import pytest
import torch
from torch import Tensor

from tests._support import FLOAT64
from tests.integrations import peers
from tests.integrations.cases import CASES, ROWS, Case, batch
from tests.integrations.compare import Result, on_ranks, truth

pytestmark = pytest.mark.skipif(
    not all(peers.installed(p) for p in ("open_clip", "lightly", "sentence_transformers")),
    reason=f"needs {peers.OPEN_CLIP}, {peers.LIGHTLY} and sentence-transformers==6.2.0 "
    "(pip install --no-deps ...)",
)

# 3 and 4 ranks in the slow tier (about 1 s each): the default tier keeps 1 and 2
WORLD_SIZES = [
    1,
    2,
    pytest.param(3, marks=pytest.mark.slow),
    pytest.param(4, marks=pytest.mark.slow),
]


def _close(a: Tensor | float, b: Tensor | float, what: str) -> None:
    torch.testing.assert_close(torch.as_tensor(a), torch.as_tensor(b), **FLOAT64, msg=what)


def _far(a: Tensor, b: Tensor) -> bool:
    """Off by more than 1% of the larger norm."""
    return float((a - b).norm()) > 0.01 * max(float(a.norm()), float(b.norm()))


def _stacked(results: list[dict[str, Result]], case: Case, key: tuple[str, str], i: int) -> Tensor:
    return torch.cat([r[case.name][key][1][i] for r in results])


def _check(case: Case, world: int, results: list[dict[str, Result]]) -> None:
    value, grads = truth(case, world)
    rows = len(batch(case, world)[0])
    scalars = range(rows, len(grads))
    # the drop-in: the truth's value on every rank, W x its rows, its scalars on average
    for rank, r in enumerate(results):
        got_value, got = r[case.name]["dropin", "one"]
        _close(got_value, value, f"{case.name}: the drop-in's value on rank {rank}")
        for i in range(rows):
            want = world * grads[i][rank * ROWS : (rank + 1) * ROWS]
            _close(got[i], want, f"{case.name}: rank {rank}'s rows of input {i}")
    for i in scalars:
        mean = torch.stack([r[case.name]["dropin", "one"][1][i] for r in results]).mean(0)
        _close(mean, grads[i], f"{case.name}: scalar {i} averaged over ranks")
    if world == 1 or case.exact:
        key = ("c" if case.local_value else "one") if world > 1 else "one"
        for rank, r in enumerate(results):
            for i in range(rows):
                _close(
                    r[case.name]["dropin", key][1][i],
                    r[case.name]["peer", key][1][i],
                    f"{case.name}: rank {rank}'s rows of input {i}, drop-in against peer",
                )
        for i in scalars:
            ours = sum(r[case.name]["dropin", key][1][i] for r in results)
            theirs = sum(r[case.name]["peer", key][1][i] for r in results)
            _close(ours, theirs, f"{case.name}: scalar {i} summed over ranks, against peer")
        peer_values = [r[case.name]["peer", key][0] for r in results]
        if case.local_value:
            _close(sum(peer_values) / world, value, f"{case.name}: the peer's mean value")
        else:
            for v in peer_values:
                _close(v, value, f"{case.name}: the peer's value")
        return
    # the peer is not exact: what DDP's averaging would need, W x the truth's rows
    needed = [world * g for g in grads[:rows]]
    theirs = [_stacked(results, case, ("peer", "one"), i) for i in range(rows)]
    if case.name == "clip default":  # the features get 1/W, the logit scale its own
        for i in range(rows):
            _close(theirs[i], needed[i] / world, f"{case.name}: 1/W of input {i}'s gradient")
        mean = torch.stack([r[case.name]["peer", "one"][1][rows] for r in results]).mean(0)
        _close(mean, grads[rows], f"{case.name}: the logit scale, exact")
        return
    for i in range(rows):
        assert _far(theirs[i], needed[i]), f"{case.name}: input {i} unexpectedly exact"
        ratio = theirs[i].flatten() / needed[i].flatten()
        assert float(ratio.max() - ratio.min()) > 0.01, f"{case.name}: input {i} off by a factor"


@pytest.mark.parametrize("world", WORLD_SIZES)
def test_every_drop_in_is_the_truth_and_equals_its_peer_where_the_peer_is_exact(
    world: int,
) -> None:
    results = on_ranks(world, [c.name for c in CASES])
    for case in CASES:
        _check(case, world, results)
