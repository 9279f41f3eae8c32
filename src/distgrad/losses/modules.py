"""The losses as ``nn.Module``s that own their learnable scalars.

Each module keeps its scalars in log space where they must stay positive (temperature, logit
scale) and calls the functional loss. Its parameters get the **single-process gradient on
every rank**, whether or not the module sits inside DistributedDataParallel or a
``fully_shard``-ed (FSDP2) model: the forward passes each parameter through
:func:`_replicated`, whose backward averages the ranks' gradients (one scalar all_reduce).
Inside DDP or FSDP2, averaging equal gradients changes nothing; outside (a loss module built
next to the wrapped model, its parameters in the same optimizer) the ranks still take
identical steps. Cost: one scalar all_reduce per learnable parameter, forward and backward (none
for a fixed temperature).

The scalars are parameters of shape ``[1]``, not 0-dim: ``fully_shard`` refuses 0-dim
parameters (open_clip offers the same shape, ``nonscalar_logit_scale=True``, for FSDP).
Checkpoints of earlier releases (0-dim scalars; SigLIPLoss's earlier names ``log_scale`` and
``bias``) still load: see ``_LossModule._load_from_state_dict``.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any, ClassVar

import torch
from torch import Tensor, nn

from distgrad._mesh import GroupLike
from distgrad.collectives._fields import positive_problem
from distgrad.collectives.all_reduce import all_reduce
from distgrad.losses._compat import renamed
from distgrad.losses.barlow_twins import barlow_twins
from distgrad.losses.contrastive import (
    BlockSize,
    Directions,
    Partition,
    clip_loss,
    info_nce,
    nt_xent,
    siglip_loss,
)

__all__ = ["BarlowTwinsLoss", "CLIPLoss", "InfoNCELoss", "NTXentLoss", "SigLIPLoss"]


def _replicated(p: Tensor, group: GroupLike) -> Tensor:
    """``p`` (the same on every rank) as a 0-dim tensor; its gradient becomes the average over
    ranks."""
    if not (p.requires_grad and torch.is_grad_enabled()):  # a fixed scalar: nothing to average
        return p.reshape(())
    averaged = all_reduce(p, "avg", group)
    return (averaged + (p - averaged).detach()).reshape(())


def _parameter(value: float) -> nn.Parameter:
    return nn.Parameter(torch.tensor([value]))  # [1], not 0-dim: see the module docstring


def _log_parameter(value: float, name: str) -> nn.Parameter:
    problem = positive_problem(name, value)  # the words of the losses' own check
    if problem is not None:
        raise ValueError(problem)
    return _parameter(math.log(value))


class _LossModule(nn.Module):
    """What the loss modules share: the options they pass to the functional loss, and loading
    the checkpoints of earlier releases."""

    #: state_dict names of earlier releases, and today's name of each
    _renamed: ClassVar[dict[str, str]] = {}

    def __init__(self, normalize: bool, group: GroupLike, block_size: BlockSize) -> None:
        super().__init__()
        self.normalize, self.group, self.block_size = normalize, group, block_size

    def _load_from_state_dict(
        self,
        state_dict: dict[str, Any],
        prefix: str,
        local_metadata: dict[str, Any],
        strict: bool,
        missing_keys: list[str],
        unexpected_keys: list[str],
        error_msgs: list[str],
    ) -> None:
        # Earlier releases stored the scalars 0-dim (and SigLIPLoss under other names): load
        # them into today's [1]-shaped parameters. (torch copies the dict before loading.)
        for old, new in self._renamed.items():
            if prefix + old in state_dict and prefix + new not in state_dict:
                state_dict[prefix + new] = state_dict.pop(prefix + old)
        for name, param in self._parameters.items():
            value = state_dict.get(prefix + name)
            if isinstance(value, Tensor) and value.dim() == 0 and param is not None:
                state_dict[prefix + name] = value.reshape(param.shape)
        super()._load_from_state_dict(
            state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys, error_msgs
        )


class _Temperature(_LossModule):
    def __init__(
        self,
        temperature: float,
        learnable: bool,
        normalize: bool,
        group: GroupLike,
        block_size: BlockSize,
    ) -> None:
        super().__init__(normalize, group, block_size)
        self.log_temperature = _log_parameter(temperature, "temperature")
        self.log_temperature.requires_grad_(learnable)

    def temperature(self) -> Tensor:
        return _replicated(self.log_temperature, self.group).exp()


class NTXentLoss(_Temperature):
    """:func:`~distgrad.losses.nt_xent` with a temperature (learnable with ``learnable=True``,
    stored as its log in the ``[1]`` parameter ``log_temperature``).

    Args:
        temperature: the initial temperature.
        learnable: make the temperature a parameter (its log, ``log_temperature``).
        normalize: L2-normalise the embeddings first (``False``: take them as given).
        group: the process group (default: the default group) or a DeviceMesh dimension.
        block_size: ``None`` the dense path; an int the ring path, which never holds more than
            ``[B_l, block_size]`` logits per rank; ``"auto"`` the dense path unless its logits
            would be too large.

    Raises:
        ValueError: an invalid constructor argument (a temperature that is not finite and
            positive); the forward raises as the functional loss does.

    Example:
        >>> loss_fn = dg.losses.NTXentLoss()
        >>> [p.requires_grad for p in loss_fn.parameters()]  # a fixed temperature
        [False]
        >>> loss_fn(torch.eye(3), torch.eye(3)).shape
        torch.Size([])
    """

    def __init__(
        self,
        temperature: float = 0.5,
        *,
        learnable: bool = False,
        normalize: bool = True,
        group: GroupLike = None,
        block_size: BlockSize = None,
    ) -> None:
        super().__init__(temperature, learnable, normalize, group, block_size)

    def forward(self, view1: Tensor, view2: Tensor, sizes: Sequence[int] | None = None) -> Tensor:
        """The loss; ``sizes``: every rank's row count, as the functional loss takes it."""
        return nt_xent(
            view1,
            view2,
            temperature=self.temperature(),
            normalize=self.normalize,
            group=self.group,
            sizes=sizes,
            block_size=self.block_size,
        )


class InfoNCELoss(_Temperature):
    """:func:`~distgrad.losses.info_nce` with a temperature (learnable with ``learnable=True``,
    stored as its log in the ``[1]`` parameter ``log_temperature``); ``directions`` and
    ``partition`` as the function takes them, hard negatives passed to the forward.

    Args:
        temperature: the initial temperature.
        learnable: make the temperature a parameter (its log, ``log_temperature``).
        directions: as ``info_nce`` takes it.
        partition: as ``info_nce`` takes it.
        normalize: L2-normalise the embeddings first (``False``: take them as given).
        group: the process group (default: the default group) or a DeviceMesh dimension.
        block_size: ``None`` the dense path; an int the ring path, which never holds more than
            ``[B_l, block_size]`` logits per rank; ``"auto"`` the dense path unless its logits
            would be too large.

    Raises:
        ValueError: an invalid constructor argument (a temperature that is not finite and
            positive); the forward raises as the functional loss does.

    Example:
        >>> loss_fn = dg.losses.InfoNCELoss(0.05, learnable=True)
        >>> [name for name, _ in loss_fn.named_parameters()]
        ['log_temperature']
        >>> loss_fn(torch.eye(3), torch.eye(3)).item() < 1e-6  # every query finds its key
        True
    """

    def __init__(
        self,
        temperature: float = 0.1,
        *,
        learnable: bool = False,
        directions: Directions = ("query_to_key",),
        partition: Partition = "joint",
        normalize: bool = True,
        group: GroupLike = None,
        block_size: BlockSize = None,
    ) -> None:
        super().__init__(temperature, learnable, normalize, group, block_size)
        self.directions, self.partition = directions, partition

    def forward(
        self,
        query: Tensor,
        key: Tensor,
        sizes: Sequence[int] | None = None,
        *,
        negatives: Tensor | None = None,
    ) -> Tensor:
        """The loss; ``sizes``: every rank's row count, ``negatives``: [B_l, m, D], as the
        functional loss takes them."""
        return info_nce(
            query,
            key,
            negatives=negatives,
            directions=self.directions,
            partition=self.partition,
            temperature=self.temperature(),
            normalize=self.normalize,
            group=self.group,
            sizes=sizes,
            block_size=self.block_size,
        )


class CLIPLoss(_LossModule):
    """:func:`~distgrad.losses.clip_loss` with CLIP's learnable logit scale, stored as its log
    in the ``[1]`` parameter ``log_logit_scale`` (initialised to ``log(1/0.07)``).

    The scale used is clamped at ``max_logit_scale`` (100, as in CLIP) in the forward: above
    it the scale's gradient is 0. open_clip instead clamps the parameter after each optimizer
    step; for that behaviour pass ``max_logit_scale=math.inf`` and clamp after the step
    (docs/losses.md, "Coming from open_clip").

    Args:
        logit_scale: the initial scale (the parameter holds its log).
        max_logit_scale: the largest scale the forward uses.
        normalize: L2-normalise the embeddings first (``False``: take them as given).
        group: the process group (default: the default group) or a DeviceMesh dimension.
        block_size: ``None`` the dense path; an int the ring path, which never holds more than
            ``[B_l, block_size]`` logits per rank; ``"auto"`` the dense path unless its logits
            would be too large.

    Raises:
        ValueError: an invalid constructor argument (a scale that is not finite and positive); the
            forward raises as the functional loss does.

    Example:
        >>> loss_fn = dg.losses.CLIPLoss()
        >>> [name for name, _ in loss_fn.named_parameters()]
        ['log_logit_scale']
        >>> round(loss_fn(torch.eye(2), torch.eye(2)).item(), 6)  # matching pairs: near 0
        1e-06
    """

    def __init__(
        self,
        logit_scale: float = 1 / 0.07,
        *,
        max_logit_scale: float = 100.0,
        normalize: bool = True,
        group: GroupLike = None,
        block_size: BlockSize = None,
    ) -> None:
        super().__init__(normalize, group, block_size)
        self.max_logit_scale = max_logit_scale
        self.log_logit_scale = _log_parameter(logit_scale, "logit_scale")

    def forward(self, image: Tensor, text: Tensor, sizes: Sequence[int] | None = None) -> Tensor:
        """The loss; ``sizes``: every rank's row count, as the functional loss takes it."""
        scale = _replicated(self.log_logit_scale, self.group).exp().clamp(max=self.max_logit_scale)
        return clip_loss(
            image,
            text,
            scale,
            normalize=self.normalize,
            group=self.group,
            sizes=sizes,
            block_size=self.block_size,
        )


class SigLIPLoss(_LossModule):
    """:func:`~distgrad.losses.siglip_loss` with SigLIP's learnable logit scale (stored as its
    log in the ``[1]`` parameter ``log_logit_scale``, initialised to 10) and logit bias (the
    ``[1]`` parameter ``logit_bias``, initialised to -10).

    The keywords ``scale=`` and ``bias=`` of earlier releases still work and warn; checkpoints
    with the earlier parameter names ``log_scale`` and ``bias`` still load.

    Args:
        logit_scale: the initial scale (the parameter holds its log).
        logit_bias: the initial bias.
        normalize: L2-normalise the embeddings first (``False``: take them as given).
        group: the process group (default: the default group) or a DeviceMesh dimension.
        block_size: ``None`` the dense path; an int the ring path, which never holds more than
            ``[B_l, block_size]`` logits per rank; ``"auto"`` the dense path unless its logits
            would be too large.

    Raises:
        ValueError: an invalid constructor argument (a scale that is not finite and positive); the
            forward raises as the functional loss does.

    Example:
        >>> loss_fn = dg.losses.SigLIPLoss()
        >>> sorted(name for name, _ in loss_fn.named_parameters())
        ['log_logit_scale', 'logit_bias']
        >>> loss_fn(torch.eye(2), torch.eye(2)).shape  # a scalar
        torch.Size([])
    """

    _renamed: ClassVar[dict[str, str]] = {"log_scale": "log_logit_scale", "bias": "logit_bias"}

    @renamed(scale="logit_scale", bias="logit_bias")
    def __init__(
        self,
        logit_scale: float = 10.0,
        logit_bias: float = -10.0,
        *,
        normalize: bool = True,
        group: GroupLike = None,
        block_size: BlockSize = None,
    ) -> None:
        super().__init__(normalize, group, block_size)
        self.log_logit_scale = _log_parameter(logit_scale, "logit_scale")
        self.logit_bias = _parameter(float(logit_bias))

    def forward(self, image: Tensor, text: Tensor, sizes: Sequence[int] | None = None) -> Tensor:
        """The loss; ``sizes``: every rank's row count, as the functional loss takes it."""
        return siglip_loss(
            image,
            text,
            _replicated(self.log_logit_scale, self.group).exp(),
            _replicated(self.logit_bias, self.group),
            normalize=self.normalize,
            group=self.group,
            sizes=sizes,
            block_size=self.block_size,
        )


class BarlowTwinsLoss(nn.Module):
    """:func:`~distgrad.losses.barlow_twins` as a module (no learnable state).

    Args:
        lambda_offdiag: the weight of the off-diagonal terms.
        eps: added to the variance before the standardisation divides by its square root.
        group: the process group (default: the default group) or a DeviceMesh dimension.

    Raises:
        Nothing at construction; the forward raises as ``barlow_twins`` does.

    Example:
        >>> g = torch.Generator().manual_seed(0)
        >>> view1, view2 = torch.randn(2, 8, 4, dtype=torch.float64, generator=g)
        >>> loss_fn = dg.losses.BarlowTwinsLoss()
        >>> torch.equal(loss_fn(view1, view2), dg.losses.barlow_twins(view1, view2))
        True
    """

    def __init__(
        self, lambda_offdiag: float = 5e-3, *, eps: float = 1e-5, group: GroupLike = None
    ) -> None:
        super().__init__()
        self.lambda_offdiag, self.eps, self.group = lambda_offdiag, eps, group

    def forward(self, view1: Tensor, view2: Tensor, sizes: Sequence[int] | None = None) -> Tensor:
        """The loss; ``sizes``: every rank's row count, as the functional loss takes it."""
        return barlow_twins(
            view1,
            view2,
            lambda_offdiag=self.lambda_offdiag,
            eps=self.eps,
            group=self.group,
            sizes=sizes,
        )
