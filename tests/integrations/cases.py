"""The drop-in losses' cases: each peer configuration, the drop-in built with the same
arguments, the data, and how to call them. Shared by the tests against the peers."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from distgrad.integrations import lightly, open_clip, sentence_transformers
from tests._support import seeded
from tests.integrations import peers

__all__ = ["CASES", "Case", "batch", "call", "peer_class"]

ROWS, DIM = 3, 4  # rows per rank, embedding dim


@dataclass(frozen=True)
class Case:
    """One peer configuration. ``exact``: the peer's gradients under DDP's averaging are the
    single-process ones (then the drop-in must equal it); ``local_value``: the peer's value on
    a rank is the mean over that rank's rows (the mean over ranks is the global value)."""

    name: str
    family: str  # clip, siglip, ntxent, barlow, mnrl
    peer: str  # the peer's class name
    kwargs: dict[str, Any] = field(default_factory=dict)
    exact: bool = True
    local_value: bool = False
    columns: int = 2  # mnrl: anchors, positives, hard negatives


CASES = [
    Case(
        "clip local+grad",
        "clip",
        "ClipLoss",
        {"local_loss": True, "gather_with_grad": True},
        local_value=True,
    ),
    Case("clip gather_with_grad", "clip", "ClipLoss", {"gather_with_grad": True}),
    Case("clip default", "clip", "ClipLoss", {}, exact=False),
    Case(
        "clip local_loss", "clip", "ClipLoss", {"local_loss": True}, exact=False, local_value=True
    ),
    Case("siglip gather", "siglip", "SigLipLoss", {"dist_impl": "gather"}, local_value=True),
    Case("siglip bidir", "siglip", "SigLipLoss", {}, local_value=True),
    Case(
        "ntxent gather",
        "ntxent",
        "NTXentLoss",
        {"gather_distributed": True, "temperature": 0.3},
        local_value=True,
    ),
    Case(
        "ntxent local", "ntxent", "NTXentLoss", {"temperature": 0.3}, exact=False, local_value=True
    ),
    Case(
        "barlow gather",
        "barlow",
        "BarlowTwinsLoss",
        {"gather_distributed": True, "lambda_param": 0.02},
        exact=False,
    ),
    Case(
        "mnrl gather",
        "mnrl",
        "MultipleNegativesRankingLoss",
        {"gather_across_devices": True, "scale": 7.0},
        local_value=True,
    ),
    Case(
        "mnrl gather m=2 both joint",
        "mnrl",
        "MultipleNegativesRankingLoss",
        {
            "gather_across_devices": True,
            "scale": 7.0,
            "directions": ("query_to_doc", "doc_to_query"),
        },
        local_value=True,
        columns=4,
    ),
    Case(
        "mnrl gather m=1 both per_direction",
        "mnrl",
        "MultipleNegativesRankingLoss",
        {
            "gather_across_devices": True,
            "scale": 7.0,
            "partition_mode": "per_direction",
            "directions": ("query_to_doc", "doc_to_query"),
        },
        local_value=True,
        columns=3,
    ),
    Case(
        "mnrl local m=1",
        "mnrl",
        "MultipleNegativesRankingLoss",
        {"scale": 7.0},
        exact=False,
        local_value=True,
        columns=3,
    ),
]


def batch(case: Case, world_size: int) -> tuple[list[Tensor], list[Tensor]]:
    """The global batch of ``case``: its row tensors ``[ROWS * world_size, DIM]`` (unit rows
    for open_clip, whose models normalise) and its scalars (logit scale, bias)."""
    gen = seeded(11)
    rows = ROWS * world_size
    count = {"clip": 2, "siglip": 2, "ntxent": 2, "barlow": 2}.get(case.family, case.columns)
    base = torch.randn(rows, DIM, dtype=torch.float64, generator=gen)
    tensors = [
        base + 0.5 * torch.randn(rows, DIM, dtype=torch.float64, generator=gen)
        for _ in range(count)
    ]
    if case.family in ("clip", "siglip"):
        tensors = [F.normalize(t, dim=1) for t in tensors]
    scalars = {
        "clip": [torch.tensor(4.0, dtype=torch.float64)],
        "siglip": [torch.tensor(3.0, dtype=torch.float64), torch.tensor(-1.5, dtype=torch.float64)],
    }.get(case.family, [])
    return tensors, scalars


def peer_class(case: Case) -> type[nn.Module]:
    module = {
        "clip": peers.open_clip_loss,
        "siglip": peers.open_clip_loss,
        "ntxent": peers.lightly_loss,
        "barlow": peers.lightly_loss,
        "mnrl": peers.st_loss,
    }[case.family]()
    found: type[nn.Module] = getattr(module, case.peer)
    return found


def dropin_class(case: Case) -> type[nn.Module]:
    module = {
        "clip": open_clip,
        "siglip": open_clip,
        "ntxent": lightly,
        "barlow": lightly,
        "mnrl": sentence_transformers,
    }[case.family]
    found: type[nn.Module] = getattr(module, case.peer)
    return found


def call(
    cls: type[nn.Module],
    case: Case,
    rows: list[Tensor],
    scalars: list[Tensor],
    rank: int,
    world_size: int,
    alone: bool = False,
) -> Tensor:
    """``cls`` built with the case's arguments (open_clip's also with ``rank`` and
    ``world_size``), called the peer's way on ``rows`` and ``scalars``. ``alone``: in a
    process with no group, where sentence-transformers cannot gather."""
    kwargs = dict(case.kwargs)
    if alone and case.family == "mnrl":
        kwargs["gather_across_devices"] = False
    if case.family in ("clip", "siglip"):
        kwargs.update(rank=rank, world_size=world_size)
    if case.family == "mnrl":
        loss_fn: Any = cls(None, **kwargs)
        out: Tensor = loss_fn.compute_loss_from_embeddings(rows, torch.empty(0))
        return out
    loss_fn = cls(**kwargs)
    return loss_fn(*rows, *scalars)  # type: ignore[no-any-return]
