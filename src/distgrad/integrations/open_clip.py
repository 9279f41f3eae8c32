"""open_clip's ``ClipLoss`` and ``SigLipLoss``, exact over the global batch.

One changed import in open_clip's training code (``open_clip.loss`` -> this module): the
constructors take open_clip 3.3's arguments, the forwards its signature, ``output_dict`` too.
What each open_clip flag does here (docs/integrations.md has the figures):

* ``local_loss``, ``gather_with_grad`` (``ClipLoss``) and ``dist_impl`` (``SigLipLoss``) choose
  how open_clip gathers features and which rows each rank's loss holds. Whatever they say,
  this loss is :func:`distgrad.losses.clip_loss` / :func:`distgrad.losses.siglip_loss` over the
  global batch: every rank returns the global mean, and DistributedDataParallel's averaging
  gives the single-process gradient. So the flags are accepted and change nothing. (open_clip's
  default ``ClipLoss()`` gives the features 1/W of their gradient under DDP; ``local_loss=True``
  without ``gather_with_grad`` misses the cross-rank terms.)
* ``rank``, ``world_size``: read from the process group instead; values passed must match it
  (else :class:`~distgrad.errors.UnsupportedOptionError`).
* ``cache_labels``: accepted; no labels are built, so there is nothing to cache.
* ``use_horovod=True``: refused (distgrad runs on torch.distributed).

The features are taken as given (``normalize=False``): open_clip's models return them
L2-normalised, and open_clip's losses do not normalise.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal

from torch import Tensor, nn

from distgrad._mesh import GroupLike
from distgrad.integrations._options import check_rank_and_size, refuse
from distgrad.losses.contrastive import clip_loss, siglip_loss

__all__ = ["ClipLoss", "SigLipLoss"]

Output = Tensor | dict[str, Tensor]


class ClipLoss(nn.Module):
    """CLIP's symmetric InfoNCE over the global batch, with open_clip's ``ClipLoss`` signature.

    ``forward(image_features, text_features, logit_scale, logit_bias=None, output_dict=False)``
    returns ``(CE(s X Y^T) + CE(s Y X^T)) / 2`` over all B pairs of every rank (``s`` the
    ``logit_scale``, usually ``model.logit_scale.exp()``), the same value on every rank, or
    ``{"contrastive_loss": loss}`` with ``output_dict=True``. ``logit_bias`` is added to every
    logit by open_clip; a constant changes no softmax, so it changes neither value nor gradient
    here (a bias that requires grad gets a gradient of exactly 0).

    ``group``, ``sizes``: distgrad's (the group of ranks, every rank's row count; see
    :func:`distgrad.losses.clip_loss`). Communication: that of ``clip_loss``'s dense path.

    Args:
        local_loss: open_clip's choice of which logits a rank's loss holds; accepted, and
            changes nothing (the loss is always the global batch's).
        gather_with_grad: open_clip's choice of a differentiable gather; accepted, and changes
            nothing (distgrad's gather always carries the gradient back).
        cache_labels: accepted; no labels are built, so nothing is cached.
        rank: this process's rank, as open_clip takes it; read from the group instead, and
            checked against the default group when passed without ``group``.
        world_size: the number of ranks, as open_clip takes it; checked like ``rank``.
        use_horovod: refused when True (distgrad runs on torch.distributed).
        group: distgrad's: the process group (default: the default group) or a DeviceMesh
            dimension, whose ranks hold the global batch.
        sizes: distgrad's: every rank's row count, the same list on every rank; given, the
            loss sends nothing but the features and the value (default: the ranks exchange
            their row counts).

    Raises:
        UnsupportedOptionError: ``use_horovod=True``, or ``rank``/``world_size`` that are not
            this process's place in the default process group (without ``group``). The
            forward raises as ``distgrad.losses.clip_loss`` does.

    Example:
        >>> g = torch.Generator().manual_seed(0)
        >>> image, text = torch.nn.functional.normalize(torch.randn(2, 4, 8, generator=g), dim=-1)
        >>> loss_fn = dg.integrations.open_clip.ClipLoss(local_loss=True, gather_with_grad=True)
        >>> loss = loss_fn(image, text, 10.0)  # as open_clip: (features, features, scale)
        >>> torch.equal(loss, dg.losses.clip_loss(image, text, 10.0, normalize=False))
        True
        >>> list(loss_fn(image, text, 10.0, output_dict=True))
        ['contrastive_loss']
    """

    def __init__(
        self,
        local_loss: bool = False,
        gather_with_grad: bool = False,
        cache_labels: bool = False,
        rank: int = 0,
        world_size: int = 1,
        use_horovod: bool = False,
        *,
        group: GroupLike = None,
        sizes: Sequence[int] | None = None,
    ) -> None:
        super().__init__()
        if use_horovod:
            raise refuse("ClipLoss", "use_horovod", use_horovod, "use torch.distributed")
        if group is None:
            check_rank_and_size("ClipLoss", rank, world_size)
        self.local_loss, self.gather_with_grad = local_loss, gather_with_grad
        self.cache_labels, self.rank, self.world_size = cache_labels, rank, world_size
        self.use_horovod = use_horovod
        self.group, self.sizes = group, sizes

    def forward(
        self,
        image_features: Tensor,
        text_features: Tensor,
        logit_scale: Tensor | float,
        logit_bias: Tensor | float | None = None,
        output_dict: bool = False,
    ) -> Output:
        loss = clip_loss(
            image_features,
            text_features,
            logit_scale,
            normalize=False,
            group=self.group,
            sizes=self.sizes,
        )
        if isinstance(logit_bias, Tensor) and logit_bias.requires_grad:
            loss = loss + (logit_bias * 0).sum()  # its gradient, exactly 0, as in the math
        return {"contrastive_loss": loss} if output_dict else loss


class SigLipLoss(nn.Module):
    """SigLIP's pairwise sigmoid loss over the global batch, with open_clip's ``SigLipLoss``
    signature.

    ``forward(image_features, text_features, logit_scale, logit_bias, output_dict=False)``
    returns ``-(1/B) sum_ij log sigmoid(z_ij (s <x_i, y_j> + b))`` over every (image, text)
    pair of the global batch, the same on every rank (open_clip's value on a rank is its own
    images' part, ``1/B_l`` of their sum; the mean over ranks of those, with even shards, is
    this). ``logit_bias=None`` is a bias of 0, as in open_clip.

    ``dist_impl`` (``"bidir"``, ``"shift"``, ``"reduce"``, ``"gather"``, or None) chooses how
    open_clip moves the texts; it changes nothing here (distgrad's dense path gathers them
    once). ``group``, ``sizes``: see :func:`distgrad.losses.siglip_loss`.

    Args:
        cache_labels: accepted; no labels are built, so nothing is cached.
        rank: this process's rank, as open_clip takes it; read from the group instead, and
            checked against the default group when passed without ``group``.
        world_size: the number of ranks, as open_clip takes it; checked like ``rank``.
        dist_impl: how open_clip exchanges the texts (``"bidir"``, ``"shift"``, ``"reduce"``,
            ``"gather"``; ``None`` is ``"bidir"``); accepted, and changes nothing.
        group: distgrad's: the process group (default: the default group) or a DeviceMesh
            dimension, whose ranks hold the global batch.
        sizes: distgrad's: every rank's row count, the same list on every rank; given, the
            loss sends nothing but the features and the value (default: the ranks exchange
            their row counts).

    Raises:
        UnsupportedOptionError: a ``dist_impl`` open_clip does not have, or ``rank``/
            ``world_size`` that are not this process's place in the default process group
            (without ``group``). The forward raises as ``distgrad.losses.siglip_loss`` does.

    Example:
        >>> g = torch.Generator().manual_seed(0)
        >>> image, text = torch.nn.functional.normalize(torch.randn(2, 4, 8, generator=g), dim=-1)
        >>> loss_fn = dg.integrations.open_clip.SigLipLoss(dist_impl="shift")
        >>> loss = loss_fn(image, text, 10.0, -10.0)  # (features, features, scale, bias)
        >>> torch.equal(loss, dg.losses.siglip_loss(image, text, 10.0, -10.0, normalize=False))
        True
    """

    def __init__(
        self,
        cache_labels: bool = False,
        rank: int = 0,
        world_size: int = 1,
        dist_impl: Literal["bidir", "shift", "reduce", "gather"] | None = None,
        *,
        group: GroupLike = None,
        sizes: Sequence[int] | None = None,
    ) -> None:
        super().__init__()
        if dist_impl not in (None, "bidir", "shift", "reduce", "gather"):
            raise refuse(
                "SigLipLoss", "dist_impl", dist_impl, "pass 'bidir', 'shift', 'reduce' or 'gather'"
            )
        if group is None:
            check_rank_and_size("SigLipLoss", rank, world_size)
        self.cache_labels, self.rank, self.world_size = cache_labels, rank, world_size
        self.dist_impl = dist_impl or "bidir"
        self.group, self.sizes = group, sizes

    def forward(
        self,
        image_features: Tensor,
        text_features: Tensor,
        logit_scale: Tensor | float,
        logit_bias: Tensor | float | None,
        output_dict: bool = False,
    ) -> Output:
        bias: Tensor | float = 0.0 if logit_bias is None else logit_bias
        loss = siglip_loss(
            image_features,
            text_features,
            logit_scale,
            bias,
            normalize=False,
            group=self.group,
            sizes=self.sizes,
        )
        return {"contrastive_loss": loss} if output_dict else loss
