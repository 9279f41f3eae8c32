"""Contrastive losses over the global batch: NT-Xent, InfoNCE, CLIP and SigLIP.

Shapes: ``B`` the global batch, ``B_l`` this rank's rows, ``D`` the embedding dim. Every loss
gathers the candidates it needs with :func:`distgrad.all_gather` (uneven ``B_l`` allowed) and
computes the rows of the global loss that belong to this rank's anchors, so each rank holds a
``[B_l, B]`` block of logits (``[2 B_l, 2 B]`` for NT-Xent).

Value and gradient: every rank returns the global mean loss; its gradient is world_size times
that of its share, so that DistributedDataParallel's averaging gives exactly the single-process
gradient (``_global.global_mean``).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor

from distgrad._group import ProcessGroup, resolve
from distgrad._meta import exchange
from distgrad.collectives.all_gather import all_gather
from distgrad.losses._global import global_mean, row_offset

__all__ = ["clip_loss", "info_nce", "nt_xent", "siglip_loss"]

Scalar = float | Tensor


def _check(desc: str, group: ProcessGroup | None, problem: str | None) -> None:
    """Raise ``problem`` on every rank (a rank alone would leave its peers waiting)."""
    exchange("loss", desc, resolve(group), None, problem=problem)


def _pair_problem(a: Tensor, b: Tensor, names: str) -> str | None:
    if a.dim() != 2 or b.dim() != 2:
        shapes = f"{tuple(a.shape)} and {tuple(b.shape)}"
        return f"{names} must be [batch, dim] matrices, got shapes {shapes}"
    if a.shape != b.shape:
        shapes = f"{tuple(a.shape)} and {tuple(b.shape)}"
        return f"{names} must have the same shape (rows are pairs), got {shapes}"
    return None


def _positive_problem(name: str, value: Scalar) -> str | None:
    number = float(value.detach()) if isinstance(value, Tensor) else float(value)
    if not math.isfinite(number) or number <= 0:
        return f"{name} must be finite and positive, got {number}"
    return None


def info_nce(
    query: Tensor,
    key: Tensor,
    *,
    temperature: Scalar = 0.1,
    group: ProcessGroup | None = None,
) -> Tensor:
    """InfoNCE: each query's positive is the key of the same global row; negatives are all other
    keys of the global batch.

    ``L = -(1/B) sum_i log softmax_j(<q_i, k_j> / temperature)[i]`` over cosine similarities
    (both normalised). ``temperature`` may be a tensor that requires grad.

    Communication: forward 1 all_gather of the keys [B_l, D] (plus two metadata handshakes and
    a scalar all_reduce for the value); backward 1 reduce-scatter of [B, D]. Memory: [B_l, B].
    """
    problem = _pair_problem(query, key, "query and key") or _positive_problem(
        "temperature", temperature
    )
    _check("info_nce", group, problem)
    q, k = F.normalize(query, dim=1), F.normalize(key, dim=1)
    keys = all_gather(k, group)  # [B, D]
    offset, total = row_offset(len(q), group)
    logits = q @ keys.T / temperature  # [B_l, B]; positives at column offset + i
    labels = torch.arange(len(q), device=q.device) + offset
    return global_mean(F.cross_entropy(logits, labels, reduction="sum"), total, group)


def clip_loss(
    image: Tensor,
    text: Tensor,
    *,
    logit_scale: Scalar = 1 / 0.07,
    group: ProcessGroup | None = None,
) -> Tensor:
    """CLIP's symmetric InfoNCE: images against all texts and texts against all images.

    ``L = (1/2B) sum_i [CE(s <x_i, Y>, i) + CE(s <y_i, X>, i)]`` with cosine similarities and
    ``s = logit_scale`` (pass ``scale.exp()`` for CLIP's learnable log-scale).

    Communication: forward 2 all_gathers of [B_l, D]; backward 2 reduce-scatters of [B, D].
    Memory: two [B_l, B] logit blocks.
    """
    problem = _pair_problem(image, text, "image and text") or _positive_problem(
        "logit_scale", logit_scale
    )
    _check("clip_loss", group, problem)
    x, y = F.normalize(image, dim=1), F.normalize(text, dim=1)
    all_x, all_y = all_gather(x, group), all_gather(y, group)
    offset, total = row_offset(len(x), group)
    labels = torch.arange(len(x), device=x.device) + offset
    per_image = F.cross_entropy(logit_scale * x @ all_y.T, labels, reduction="sum")
    per_text = F.cross_entropy(logit_scale * y @ all_x.T, labels, reduction="sum")
    return global_mean((per_image + per_text) / 2, total, group)


def nt_xent(
    view1: Tensor,
    view2: Tensor,
    *,
    temperature: Scalar = 0.5,
    group: ProcessGroup | None = None,
) -> Tensor:
    """SimCLR's NT-Xent: 2B anchors (both views); each anchor's positive is the other view of
    its sample; its negatives are the other 2B - 2 embeddings of the global batch.

    ``L = -(1/2B) sum_a log [exp(<z_a, z_p(a)>/t) / sum_{c != a} exp(<z_a, z_c>/t)]`` over
    cosine similarities.

    Communication: forward 2 all_gathers of [B_l, D]; backward 2 reduce-scatters of [B, D].
    Memory: [2 B_l, 2 B].
    """
    problem = _pair_problem(view1, view2, "view1 and view2") or _positive_problem(
        "temperature", temperature
    )
    _check("nt_xent", group, problem)
    z1, z2 = F.normalize(view1, dim=1), F.normalize(view2, dim=1)
    first, second = all_gather(z1, group), all_gather(z2, group)  # [B, D] each
    offset, total = row_offset(len(z1), group)
    candidates = torch.cat([first, second])  # [2B, D]: all first views, then all second views
    anchors = torch.cat([z1, z2])  # [2 B_l, D]
    logits = anchors @ candidates.T / temperature  # [2 B_l, 2B]
    rows = torch.arange(len(z1), device=z1.device) + offset
    own = torch.cat([rows, rows + total])
    positive = torch.cat([rows + total, rows])
    logits = logits.masked_fill(F.one_hot(own, 2 * total).bool(), float("-inf"))
    return global_mean(F.cross_entropy(logits, positive, reduction="sum"), 2 * total, group)


def siglip_loss(
    image: Tensor,
    text: Tensor,
    *,
    scale: Scalar = 10.0,
    bias: Scalar = -10.0,
    group: ProcessGroup | None = None,
) -> Tensor:
    """SigLIP: a binary decision for every (image, text) pair of the global batch.

    ``L = -(1/B) sum_i sum_j log sigmoid(z_ij (scale <x_i, y_j> + bias))`` with ``z_ij = 1``
    for matching pairs and -1 otherwise, cosine similarities. ``scale`` and ``bias`` may be
    tensors that require grad (pass ``t.exp()`` for a learnable log-scale).

    Communication: forward 1 all_gather of the texts [B_l, D]; backward 1 reduce-scatter.
    Memory: [B_l, B].
    """
    problem = _pair_problem(image, text, "image and text") or _positive_problem("scale", scale)
    _check("siglip_loss", group, problem)
    x, y = F.normalize(image, dim=1), F.normalize(text, dim=1)
    all_y = all_gather(y, group)
    offset, total = row_offset(len(x), group)
    logits = scale * x @ all_y.T + bias  # [B_l, B]
    signs = -torch.ones_like(logits)
    rows = torch.arange(len(x), device=x.device)
    signs[rows, rows + offset] = 1.0
    return global_mean(-F.logsigmoid(signs * logits).sum(), total, group)
