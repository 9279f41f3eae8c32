"""Contrastive losses over the global batch: NT-Xent, InfoNCE, CLIP and SigLIP.

Shapes: ``B`` the global batch, ``B_l`` this rank's rows, ``D`` the embedding dim. Every loss
gathers the candidates it needs with :func:`distgrad.all_gather` (uneven ``B_l`` allowed) and
computes the rows of the global loss that belong to this rank's anchors, so each rank holds a
``[B_l, B]`` block of logits (``[2 B_l, 2 B]`` for NT-Xent).

Value and gradient: every rank returns the global mean loss; its gradient is world_size times
that of its share, so that DistributedDataParallel's averaging gives exactly the single-process
gradient (``_global.global_mean``).

``block_size``: None (default) takes the dense path above. An int takes the memory-efficient
path (``_ring``): the keys go round the ring of ranks instead of being gathered, and no rank
ever holds more than ``[anchors, block_size]`` logits, forward or backward (the backward
recomputes them). Same value and gradients; the dense path is faster for small batches.
Communication of the ring path: forward W-1 point-to-point shifts of [max B_l, D] per
gathered modality, backward W-1 shifts of [max B_l, 2D] (keys with their gradient
accumulators) and one of [max B_l, D]; compute 4/3 of the dense path's matmuls, except
``clip_loss``, whose two directions share one pass (2/3 of the dense path's matmuls).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor

from distgrad._group import Group, ProcessGroup
from distgrad.collectives.all_gather import apply_all_gather
from distgrad.losses._compat import renamed
from distgrad.losses._global import batch_sizes, global_mean
from distgrad.losses._ring import ring_clip, ring_reduce

__all__ = ["clip_loss", "info_nce", "nt_xent", "siglip_loss"]

Scalar = float | Tensor


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


def _block_problem(block_size: int | None) -> str | None:
    if block_size is None or (isinstance(block_size, int) and block_size >= 1):
        return None
    return f"block_size must be None (dense) or a positive int, got {block_size!r}"


def _unit(x: Tensor, normalize: bool) -> Tensor:
    """``x``'s rows L2-normalised, or ``x`` itself for features the model already normalised."""
    return F.normalize(x, dim=1) if normalize else x


def _scalar(value: Scalar, like: Tensor) -> Tensor:
    """``value`` as a 0-dim tensor of ``like``'s dtype (keeping its autograd history)."""
    return torch.as_tensor(value, dtype=like.dtype, device=like.device).reshape(())


def info_nce(
    query: Tensor,
    key: Tensor,
    *,
    temperature: Scalar = 0.1,
    normalize: bool = True,
    group: ProcessGroup | None = None,
    block_size: int | None = None,
) -> Tensor:
    """InfoNCE: each query's positive is the key of the same global row; negatives are all other
    keys of the global batch.

    ``L = -(1/B) sum_i log softmax_j(<q_i, k_j> / temperature)[i]`` over cosine similarities
    (both L2-normalised here; ``normalize=False`` takes the embeddings as given, for features
    the model already normalised). ``temperature`` may be a tensor that requires grad.

    Communication: forward 1 all_gather of the keys [B_l, D] (plus two metadata handshakes and
    a scalar all_reduce for the value); backward 1 reduce-scatter of [B, D]. Memory: [B_l, B].
    """
    problem = (
        _pair_problem(query, key, "query and key")
        or _positive_problem("temperature", temperature)
        or _block_problem(block_size)
    )
    g, sizes = batch_sizes("info_nce", key, group, problem)
    q, k = _unit(query, normalize), _unit(key, normalize)
    if block_size is not None:
        return _ring_info_nce(q, k, 1 / _scalar(temperature, q), g, sizes, block_size)
    keys = apply_all_gather(k, g, sizes, 0)  # [B, D]
    offset, total = sum(sizes[: g.rank]), sum(sizes)
    logits = q @ keys.T / temperature  # [B_l, B]; positives at column offset + i
    labels = torch.arange(len(q), device=q.device) + offset
    return global_mean(F.cross_entropy(logits, labels, reduction="sum"), total, g)


def clip_loss(
    image: Tensor,
    text: Tensor,
    logit_scale: Scalar = 1 / 0.07,
    *,
    normalize: bool = True,
    group: ProcessGroup | None = None,
    block_size: int | None = None,
) -> Tensor:
    """CLIP's symmetric InfoNCE: images against all texts and texts against all images.

    ``L = (1/2B) sum_i [CE(s <x_i, Y>, i) + CE(s <y_i, X>, i)]`` with cosine similarities and
    ``s = logit_scale`` (pass ``log_scale.exp()`` for CLIP's learnable log-scale). The
    arguments sit where open_clip's ``ClipLoss()(image_features, text_features, logit_scale)``
    has them; ``normalize=False`` takes features the model already L2-normalised as given.

    Communication: forward 2 all_gathers of [B_l, D]; backward 2 reduce-scatters of [B, D].
    Memory: two [B_l, B] logit blocks.
    """
    problem = (
        _pair_problem(image, text, "image and text")
        or _positive_problem("logit_scale", logit_scale)
        or _block_problem(block_size)
    )
    g, sizes = batch_sizes("clip_loss", text, group, problem)
    x, y = _unit(image, normalize), _unit(text, normalize)
    if block_size is not None:
        return _ring_clip(x, y, _scalar(logit_scale, x), g, sizes, block_size)
    all_x, all_y = apply_all_gather(x, g, sizes, 0), apply_all_gather(y, g, sizes, 0)
    offset, total = sum(sizes[: g.rank]), sum(sizes)
    labels = torch.arange(len(x), device=x.device) + offset
    per_image = F.cross_entropy(logit_scale * x @ all_y.T, labels, reduction="sum")
    per_text = F.cross_entropy(logit_scale * y @ all_x.T, labels, reduction="sum")
    return global_mean((per_image + per_text) / 2, total, g)


def nt_xent(
    view1: Tensor,
    view2: Tensor,
    *,
    temperature: Scalar = 0.5,
    normalize: bool = True,
    group: ProcessGroup | None = None,
    block_size: int | None = None,
) -> Tensor:
    """SimCLR's NT-Xent: 2B anchors (both views); each anchor's positive is the other view of
    its sample; its negatives are the other 2B - 2 embeddings of the global batch.

    ``L = -(1/2B) sum_a log [exp(<z_a, z_p(a)>/t) / sum_{c != a} exp(<z_a, z_c>/t)]`` over
    cosine similarities (``normalize=False``: the embeddings as given).

    Communication: forward 2 all_gathers of [B_l, D]; backward 2 reduce-scatters of [B, D].
    Memory: [2 B_l, 2 B].
    """
    problem = (
        _pair_problem(view1, view2, "view1 and view2")
        or _positive_problem("temperature", temperature)
        or _block_problem(block_size)
    )
    g, sizes = batch_sizes("nt_xent", view2, group, problem)
    z1, z2 = _unit(view1, normalize), _unit(view2, normalize)
    if block_size is not None:
        return _ring_nt_xent(z1, z2, 1 / _scalar(temperature, z1), g, sizes, block_size)
    first, second = apply_all_gather(z1, g, sizes, 0), apply_all_gather(z2, g, sizes, 0)
    offset, total = sum(sizes[: g.rank]), sum(sizes)  # first, second: [B, D] each
    candidates = torch.cat([first, second])  # [2B, D]: all first views, then all second views
    anchors = torch.cat([z1, z2])  # [2 B_l, D]
    logits = anchors @ candidates.T / temperature  # [2 B_l, 2B]
    rows = torch.arange(len(z1), device=z1.device) + offset
    own = torch.cat([rows, rows + total])
    positive = torch.cat([rows + total, rows])
    logits = logits.masked_fill(F.one_hot(own, 2 * total).bool(), float("-inf"))
    return global_mean(F.cross_entropy(logits, positive, reduction="sum"), 2 * total, g)


@renamed(scale="logit_scale", bias="logit_bias")
def siglip_loss(
    image: Tensor,
    text: Tensor,
    logit_scale: Scalar = 10.0,
    logit_bias: Scalar = -10.0,
    *,
    normalize: bool = True,
    group: ProcessGroup | None = None,
    block_size: int | None = None,
) -> Tensor:
    """SigLIP: a binary decision for every (image, text) pair of the global batch.

    ``L = -(1/B) sum_i sum_j log sigmoid(z_ij (logit_scale <x_i, y_j> + logit_bias))`` with
    ``z_ij = 1`` for matching pairs and -1 otherwise, cosine similarities (``normalize=False``:
    the features as given). ``logit_scale`` and ``logit_bias`` may be tensors that require grad
    (pass ``t.exp()`` for a learnable log-scale); they sit where open_clip's
    ``SigLipLoss()(image_features, text_features, logit_scale, logit_bias)`` has them. The
    keywords ``scale=`` and ``bias=`` of earlier releases still work and warn (FutureWarning).

    Communication: forward 1 all_gather of the texts [B_l, D]; backward 1 reduce-scatter.
    Memory: [B_l, B].
    """
    problem = (
        _pair_problem(image, text, "image and text")
        or _positive_problem("logit_scale", logit_scale)
        or _block_problem(block_size)
    )
    g, sizes = batch_sizes("siglip_loss", text, group, problem)
    x, y = _unit(image, normalize), _unit(text, normalize)
    if block_size is not None:
        scale, bias = _scalar(logit_scale, x), _scalar(logit_bias, x)
        return _ring_siglip(x, y, scale, bias, g, sizes, block_size)
    all_y = apply_all_gather(y, g, sizes, 0)
    offset, total = sum(sizes[: g.rank]), sum(sizes)
    logits = logit_scale * x @ all_y.T + logit_bias  # [B_l, B]
    signs = -torch.ones_like(logits)
    rows = torch.arange(len(x), device=x.device)
    signs[rows, rows + offset] = 1.0
    return global_mean(-F.logsigmoid(signs * logits).sum(), total, g)


# The memory-efficient paths: the same losses through distgrad.losses._ring, which never holds
# more than [anchors, block_size] logits. Each returns the same value and gradients as the
# dense path (tests/losses/test_blockwise.py).


def _ring_info_nce(
    q: Tensor, k: Tensor, scale: Tensor, g: Group, rows: tuple[int, ...], block: int
) -> Tensor:
    """``(1/B) sum_i [logsumexp_j s <q_i, k_j> - s <q_i, k_i>]`` with the keys on a ring."""
    lse = ring_reduce(q, k, scale, scale.new_zeros(()), rows, g, kind="lse", block=block)
    positive = scale * (q * k).sum(1)  # [B_l]: the positive of row i is the local key i
    return global_mean((lse - positive).sum(), sum(rows), g)


def _ring_clip(
    x: Tensor, y: Tensor, scale: Tensor, g: Group, rows: tuple[int, ...], block: int
) -> Tensor:
    """Both directions from one ring pass: image i's logsumexp over all texts, text j's over
    all images (the columns of the same logits blocks)."""
    per_image, per_text = ring_clip(x, y, scale, rows, g, block=block)
    positive = scale * (x * y).sum(1)  # [B_l]: pair i's logit, in both directions
    local = ((per_image - positive).sum() + (per_text - positive).sum()) / 2
    return global_mean(local, sum(rows), g)


def _ring_nt_xent(
    z1: Tensor, z2: Tensor, scale: Tensor, g: Group, rows: tuple[int, ...], block: int
) -> Tensor:
    """Anchors and keys are both ``[z1; z2]``; the ring leaves out each anchor's own column."""
    both = torch.cat([z1, z2])  # [2 B_l, D]
    both_rows = tuple(2 * r for r in rows)
    zero = scale.new_zeros(())
    lse = ring_reduce(
        both, both, scale, zero, both_rows, g, kind="lse", block=block, mask_self=True
    )
    positive = scale * (both * torch.cat([z2, z1])).sum(1)
    return global_mean((lse - positive).sum(), sum(both_rows), g)


def _ring_siglip(
    x: Tensor, y: Tensor, scale: Tensor, bias: Tensor, g: Group, rows: tuple[int, ...], block: int
) -> Tensor:
    """Every pair counted as a negative, ``softplus(l_ij)``, then each positive corrected:
    ``-log sigmoid(l) = softplus(-l) = softplus(l) - l``."""
    negatives = ring_reduce(x, y, scale, bias, rows, g, kind="softplus", block=block)
    positive = scale * (x * y).sum(1) + bias  # [B_l]: l_ii
    return global_mean((negatives - positive).sum(), sum(rows), g)
