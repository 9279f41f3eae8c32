"""Training steps written the peers' way, as their users write them, with the import line left
open: the tests fill it with the peer's import or the drop-in's, and nothing else changes.

The peers' packages cannot be imported here (their ``__init__`` pulls torchvision or
transformers, ``tests/integrations/peers.py``), so the peer's line imports its loss file loaded
by path under a module name of its own (``peer_open_clip_loss`` for ``open_clip.loss``, ...).
"""

from __future__ import annotations

import math
import sys
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from tests.integrations import peers

__all__ = ["IMPORTS", "STEPS", "TwoTower", "Encoder", "step_function"]

# What a user writes (the peer's line as it reads in their code, in the comment).
IMPORTS = {
    "open_clip": {
        "peer": "from peer_open_clip_loss import ClipLoss  # from open_clip.loss import ClipLoss",
        "dropin": "from distgrad.integrations.open_clip import ClipLoss",
    },
    "lightly": {
        "peer": "from peer_lightly_loss import NTXentLoss  # from lightly.loss import NTXentLoss",
        "dropin": "from distgrad.integrations.lightly import NTXentLoss",
    },
    # sentence-transformers' forward embeds through its merged_forward module, which needs
    # transformers: only the drop-in's step runs (its truth: the peer's
    # compute_loss_from_embeddings on the model's embeddings, in one process).
    "sentence_transformers": {
        "dropin": "from distgrad.integrations.sentence_transformers import "
        "MultipleNegativesRankingLoss",
    },
    "sentence_transformers_cached": {
        "dropin": "from distgrad.integrations.sentence_transformers import "
        "CachedMultipleNegativesRankingLoss",
    },
}

STEPS = {
    # open_clip's training loop (open_clip_train/train.py), reduced to one step
    "open_clip": """
def train_step(model, images, texts, rank, world_size):
    loss_fn = ClipLoss(rank=rank, world_size=world_size)
    image_features, text_features, logit_scale = model(images, texts)
    total_loss = loss_fn(image_features, text_features, logit_scale, output_dict=True)
    loss = sum(total_loss.values())
    loss.backward()
    return loss
""",
    # lightly's SimCLR example, one step
    "lightly": """
def train_step(model, x0, x1, rank, world_size):
    criterion = NTXentLoss(temperature=0.3, gather_distributed=True)
    z0, z1 = model(x0), model(x1)
    loss = criterion(z0, z1)
    loss.backward()
    return loss
""",
    # what SentenceTransformerTrainer.compute_loss does with a loss: loss(features, labels)
    "sentence_transformers": """
def train_step(model, anchors, positives, negatives, rank, world_size):
    loss_fn = MultipleNegativesRankingLoss(model, scale=7.0, gather_across_devices=True)
    features = [{"input_ids": anchors}, {"input_ids": positives}, {"input_ids": negatives}]
    loss = loss_fn(features, None)
    loss.backward()
    return loss
""",
    "sentence_transformers_cached": """
def train_step(model, anchors, positives, negatives, rank, world_size):
    loss_fn = CachedMultipleNegativesRankingLoss(
        model, scale=7.0, mini_batch_size=2, gather_across_devices=True
    )
    features = [{"input_ids": anchors}, {"input_ids": positives}, {"input_ids": negatives}]
    loss = loss_fn(features, None)
    loss.backward()
    return loss
""",
}


def step_function(library: str, who: str) -> Any:
    """``train_step`` of ``library``'s snippet, with ``who``'s import line."""
    sys.modules.setdefault("peer_open_clip_loss", peers.open_clip_loss())
    sys.modules.setdefault("peer_lightly_loss", peers.lightly_loss())
    sys.modules.setdefault("st_multiple_negatives_ranking", peers.st_loss())
    namespace: dict[str, Any] = {}
    exec(IMPORTS[library][who] + "\n" + STEPS[library], namespace)
    return namespace["train_step"]


class TwoTower(nn.Module):
    """open_clip's model in miniature: normalised image and text features, and the exponential
    of a learnable log logit scale."""

    def __init__(self) -> None:
        super().__init__()
        gen = torch.Generator().manual_seed(3)
        self.image = nn.Linear(5, 4, dtype=torch.float64)
        self.text = nn.Linear(6, 4, dtype=torch.float64)
        for p in self.parameters():
            p.data = torch.randn(p.shape, dtype=torch.float64, generator=gen)
        self.logit_scale = nn.Parameter(torch.tensor(math.log(4.0), dtype=torch.float64))

    def forward(self, images: Tensor, texts: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        return (
            F.normalize(self.image(images), dim=-1),
            F.normalize(self.text(texts), dim=-1),
            self.logit_scale.exp(),
        )


class Encoder(nn.Module):
    """A sentence encoder in miniature: ``model(features)["sentence_embedding"]``, as a
    SentenceTransformer returns it (its inputs float rows standing in for token ids); also
    lightly's backbone and head (called on a tensor). ``dropout``: before the layer, to show
    that a cached loss replays each mini-batch's masks."""

    def __init__(self, dropout: float = 0.0) -> None:
        super().__init__()
        gen = torch.Generator().manual_seed(4)
        self.dropout = nn.Dropout(dropout)
        self.layer = nn.Linear(5, 4, dtype=torch.float64)
        for p in self.parameters():
            p.data = torch.randn(p.shape, dtype=torch.float64, generator=gen)

    def forward(self, features: Any) -> Any:
        if isinstance(features, Tensor):
            return self.layer(self.dropout(torch.tanh(features)))
        return {"sentence_embedding": self.layer(self.dropout(torch.tanh(features["input_ids"])))}
