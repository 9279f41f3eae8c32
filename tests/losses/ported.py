"""Other code's conventions, re-written here for one rank, to measure them against distgrad.

Nothing here is copied: each function follows a paper's formula or the structure of a
published training script as described in its docstring, written with torch and distgrad
(open_clip, SimCLR and Barlow Twins are not dependencies). Each ``(model, x, y)`` function is
one rank's loss for ``dg.testing.check_against_single_process``; ``model`` is the encoder.
Even shards throughout, as those scripts assume.

Where a script gathers *with* gradient (open_clip's ``gather_with_grad=True`` through
``torch.distributed.nn.all_gather`` or funcol, SigLIP's neighbour exchange, SimCLR's
cross-replica concat), the port uses ``dg.all_gather``: all of them return to each rank the
sum of every rank's gradient for its rows. Where a script gathers *without* gradient, the port
uses a raw ``torch.distributed.all_gather`` of detached tensors.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor, nn

import distgrad as dg

SCALE = 10.0  # CLIP/SigLIP logit scale used by every port (s = exp(t) in the papers)
BIAS = -3.0  # SigLIP's logit bias
TEMPERATURE = 0.5  # NT-Xent
LAMBDA = 0.0051  # Barlow Twins' off-diagonal weight (the official script's default)


class Encoder(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.linear = nn.Linear(5, 4).double()

    def forward(self, x: Tensor) -> Tensor:
        out: Tensor = self.linear(x)
        return out


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def _world() -> int:
    return dist.get_world_size() if dist.is_initialized() else 1


def _raw_gather(x: Tensor) -> list[Tensor]:
    """torch.distributed.all_gather into a list: no gradient reaches any rank's rows."""
    if _world() == 1:
        return [x.detach()]
    parts = [torch.empty_like(x) for _ in range(_world())]
    dist.all_gather(parts, x.detach().contiguous())
    return parts


# ------------------------------------------------------------------ the papers' formulas


def clip_formula(image: Tensor, text: Tensor, logit_scale: Tensor | float) -> Tensor:
    """CLIP (Radford et al. 2021, Figure 3), features as given:
    ``logits = scale * I @ T^T``; ``(CE(logits, arange) + CE(logits^T, arange)) / 2``."""
    logits = logit_scale * image @ text.T
    labels = torch.arange(len(image))
    return (F.cross_entropy(logits, labels) + F.cross_entropy(logits.T, labels)) / 2


def siglip_formula(
    image: Tensor, text: Tensor, logit_scale: Tensor | float, logit_bias: Tensor | float
) -> Tensor:
    """SigLIP (Zhai et al. 2023, Algorithm 1), features as given:
    ``logits = scale * I @ T^T + bias``; ``labels = 2 eye(n) - 1``;
    ``-sum(log_sigmoid(labels * logits)) / n``."""
    n = len(image)
    logits = logit_scale * image @ text.T + logit_bias
    labels = 2 * torch.eye(n, dtype=logits.dtype) - 1
    return -F.logsigmoid(labels * logits).sum() / n


# ------------------------------------------------------------------ open_clip's ClipLoss


class EncoderAndScale(Encoder):
    """The encoder and CLIP's learnable log logit scale (open_clip's ``model.logit_scale``,
    whose exponential the training script passes to the loss)."""

    def __init__(self) -> None:
        super().__init__()
        self.logit_scale = nn.Parameter(torch.tensor(math.log(SCALE), dtype=torch.float64))


def _open_clip(
    image: Tensor,
    text: Tensor,
    local_loss: bool,
    with_grad: bool,
    scale: Tensor | float = SCALE,
) -> Tensor:
    """open_clip's ClipLoss on one rank: features normalised by the model, then
    ``gather_features`` and the loss as open_clip's ``local_loss``/``gather_with_grad`` say."""
    x, y = F.normalize(image, dim=1), F.normalize(text, dim=1)
    if _world() == 1:  # open_clip gathers nothing on one process
        all_x, all_y = x, y
    elif with_grad:
        all_x, all_y = dg.all_gather(x), dg.all_gather(y)
    else:
        xs, ys = _raw_gather(x), _raw_gather(y)
        if not local_loss:  # "ensure grads for local rank": the local slot is put back
            xs[_rank()], ys[_rank()] = x, y
        all_x, all_y = torch.cat(xs), torch.cat(ys)
    if local_loss:
        per_image = scale * x @ all_y.T  # [B_l, B]
        per_text = scale * y @ all_x.T
        labels = torch.arange(len(x)) + len(x) * _rank()
    else:
        per_image = scale * all_x @ all_y.T  # [B, B] on every rank
        per_text = per_image.T
        labels = torch.arange(len(all_x))
    return (F.cross_entropy(per_image, labels) + F.cross_entropy(per_text, labels)) / 2


def open_clip_default(model: nn.Module, image: Tensor, text: Tensor) -> Tensor:
    """``ClipLoss()``: local_loss=False, gather_with_grad=False (open_clip's defaults)."""
    return _open_clip(model(image), model(text), local_loss=False, with_grad=False)


def open_clip_default_learnable_scale(model: nn.Module, image: Tensor, text: Tensor) -> Tensor:
    """``ClipLoss()`` with the model's learnable logit scale (``EncoderAndScale``)."""
    scale = model.logit_scale.exp()  # type: ignore[operator]
    return _open_clip(model(image), model(text), local_loss=False, with_grad=False, scale=scale)


def open_clip_local_loss(model: nn.Module, image: Tensor, text: Tensor) -> Tensor:
    """``ClipLoss(local_loss=True)`` without gather_with_grad."""
    return _open_clip(model(image), model(text), local_loss=True, with_grad=False)


def open_clip_local_loss_gather_with_grad(model: nn.Module, image: Tensor, text: Tensor) -> Tensor:
    """``ClipLoss(local_loss=True, gather_with_grad=True)``, the flags open_clip recommends."""
    return _open_clip(model(image), model(text), local_loss=True, with_grad=True)


def open_clip_siglip(model: nn.Module, image: Tensor, text: Tensor) -> Tensor:
    """open_clip's SigLipLoss on one rank: its own pairs, then every other rank's texts as
    negatives only (the neighbour exchange), each term summed and divided by the local
    batch."""
    x, y = F.normalize(model(image), dim=1), F.normalize(model(text), dim=1)
    parts = torch.split(dg.all_gather(y), len(y))  # even shards
    loss = -F.logsigmoid(_signs(len(x), True) * (SCALE * x @ y.T + BIAS)).sum() / len(x)
    for rank, other in enumerate(parts):
        if rank != _rank():
            logits = SCALE * x @ other.T + BIAS
            loss = loss + -F.logsigmoid(_signs(len(x), False) * logits).sum() / len(x)
    return loss


def _signs(n: int, positives: bool) -> Tensor:
    eye = torch.eye(n, dtype=torch.float64)
    return 2 * eye - 1 if positives else -torch.ones_like(eye)


def distgrad_clip(model: nn.Module, image: Tensor, text: Tensor) -> Tensor:
    return dg.losses.clip_loss(model(image), model(text), SCALE)


def distgrad_siglip(model: nn.Module, image: Tensor, text: Tensor) -> Tensor:
    return dg.losses.siglip_loss(model(image), model(text), SCALE, BIAS)


# ------------------------------------------------------------------ SimCLR


def simclr_official(model: nn.Module, view1: Tensor, view2: Tensor) -> Tensor:
    """The SimCLR TF2 script's loss on one replica (``add_contrastive_loss`` with
    ``tpu_cross_replica_concat``): anchors are this replica's rows of both views, candidates
    both views of the global batch, the loss ``mean(loss_a + loss_b)`` over the local rows,
    divided by the replica count (``loss / num_replicas_in_sync``; the replicas' gradients
    are then summed)."""
    h1, h2 = F.normalize(model(view1), dim=1), F.normalize(model(view2), dim=1)
    big1, big2 = dg.all_gather(h1), dg.all_gather(h2)
    labels = torch.arange(len(h1)) + _rank() * len(h1)
    masks = F.one_hot(labels, len(big1)).bool()
    aa = (h1 @ big1.T / TEMPERATURE).masked_fill(masks, float("-inf"))
    bb = (h2 @ big2.T / TEMPERATURE).masked_fill(masks, float("-inf"))
    ab, ba = h1 @ big2.T / TEMPERATURE, h2 @ big1.T / TEMPERATURE
    loss_a = F.cross_entropy(torch.cat([ab, aa], 1), labels, reduction="none")
    loss_b = F.cross_entropy(torch.cat([ba, bb], 1), labels, reduction="none")
    return (loss_a + loss_b).mean() / _world()


class _GatherLayer(torch.autograd.Function):
    """The GatherLayer of many PyTorch SimCLR ports: backward keeps its own slice only."""

    @staticmethod
    def forward(ctx: torch.autograd.function.FunctionCtx, x: Tensor) -> Tensor:
        return torch.cat(_raw_gather(x))

    @staticmethod
    def backward(ctx: torch.autograd.function.FunctionCtx, grad: Tensor) -> Tensor:
        rows = len(grad) // _world()
        return grad[_rank() * rows : (_rank() + 1) * rows]


def simclr_gatherlayer_port(model: nn.Module, view1: Tensor, view2: Tensor) -> Tensor:
    """A PyTorch port's NT-Xent: gather both views with that GatherLayer, then the loss of the
    whole global batch on every rank."""
    z1 = _GatherLayer.apply(F.normalize(model(view1), dim=1))
    z2 = _GatherLayer.apply(F.normalize(model(view2), dim=1))
    return nt_xent_formula(z1, z2)


def nt_xent_formula(z1: Tensor, z2: Tensor) -> Tensor:
    """SimCLR's NT-Xent (Chen et al. 2020, Algorithm 1) over the 2N rows given, features as
    given: each row's positive is the other view of its sample; mean over the 2N anchors."""
    z = torch.cat([z1, z2])  # [2N, D]
    n = len(z1)
    logits = (z @ z.T / TEMPERATURE).masked_fill(torch.eye(2 * n, dtype=torch.bool), float("-inf"))
    positives = torch.cat([torch.arange(n) + n, torch.arange(n)])
    return F.cross_entropy(logits, positives)


def distgrad_nt_xent(model: nn.Module, view1: Tensor, view2: Tensor) -> Tensor:
    return dg.losses.nt_xent(model(view1), model(view2), temperature=TEMPERATURE)


# ------------------------------------------------------------------ Barlow Twins


def barlow_twins_official(model: nn.Module, view1: Tensor, view2: Tensor) -> Tensor:
    """The official Barlow Twins script's loss on one rank: ``bn`` (BatchNorm1d without affine,
    made a SyncBatchNorm) of each view, ``c = bn(z1)^T bn(z2) / batch_size`` (the global
    batch), a raw in-place ``torch.distributed.all_reduce(c)``, then the on- and off-diagonal
    terms. SyncBatchNorm refuses CPU tensors, so the port standardises with dg.all_reduce,
    whose backward, like SyncBatchNorm's, sums every rank's gradient of the statistics."""
    z1, z2 = model(view1), model(view2)
    count = dg.all_reduce(torch.tensor(float(len(z1)), dtype=z1.dtype))

    def bn(z: Tensor) -> Tensor:
        mean = dg.all_reduce(z.sum(0)) / count
        var = dg.all_reduce(((z - mean) ** 2).sum(0)) / count
        return (z - mean) / torch.sqrt(var + 1e-5)

    c = bn(z1).T @ bn(z2)
    c.div_(count.item())
    if dist.is_initialized():
        dist.all_reduce(c)  # autograd does not see this
    on_diag = (torch.diagonal(c) - 1).pow(2).sum()
    off_diag = c.pow(2).sum() - torch.diagonal(c).pow(2).sum()
    return on_diag + LAMBDA * off_diag


def distgrad_barlow_twins(model: nn.Module, view1: Tensor, view2: Tensor) -> Tensor:
    return dg.losses.barlow_twins(model(view1), model(view2), lambda_offdiag=LAMBDA)
