"""Synchronized batch norm: statistics over every rank's rows, on any device and backend.

Legend: ``N`` ranks; ``C`` channels (dim 1); ``n_r`` the values per channel on rank r (its
rows times the spatial size; 0 for a rank with no rows), ``n = n_0 + ... + n_{N-1}``.

Each rank computes its per-channel count, mean and sum of squared deviations ``m2_r``; one
all_gather of these ``2C + 1`` numbers gives every rank all of them, and each combines them the
same way (Chan et al.'s pairwise formula, as torch's SyncBatchNorm does on GPU)::

    mean = sum_r n_r mean_r / n
    var  = sum_r (m2_r + n_r (mean_r - mean)^2) / n       # biased: used to normalise

so no rank subtracts two large sums (``E[x^2] - E[x]^2`` would lose float32 precision). The
running variance takes the unbiased ``var * n / (n - 1)``, as torch's batch norm does.
"""

from __future__ import annotations

import torch
from torch import Tensor
from torch.nn.modules.batchnorm import _BatchNorm

from distgrad._exchange.group import ProcessGroup, resolve
from distgrad._mesh import GroupLike
from distgrad.collectives.all_gather import all_gather
from distgrad.errors import CollectiveArgumentError
from distgrad.parallel._checks import SYNC_BATCH_NORM, as_process_group

__all__ = ["SyncBatchNorm", "sync_batch_norm"]


def _global_stats(x: Tensor, group: ProcessGroup | None) -> tuple[Tensor, Tensor, Tensor]:
    """(mean [C], biased var [C], n as a 0-dim tensor) over every rank's values of x."""
    size = resolve(group, "sync_batch_norm").size
    channels = x.shape[1]
    dims = [0, *range(2, x.dim())]  # every dim but the channels'
    count = x.numel() // channels if channels else 0
    if count:
        var, mean = torch.var_mean(x, dim=dims, correction=0)  # one pass, no copy of x
        m2 = var * count
    else:  # no rows: zeros and a zero count, still computed from x (so that they need a
        mean = m2 = x.sum(dim=dims)  # gradient whenever x does, as on the other ranks)
    mine = torch.cat([mean.new_full((1,), float(count)), mean, m2])[None]  # [1, 2C + 1]
    table = all_gather(mine, group, sizes=[1] * size)  # [N, 2C + 1]
    counts, means, m2s = table[:, :1], table[:, 1 : channels + 1], table[:, channels + 1 :]
    n = counts.sum()
    mean = (counts * means).sum(0) / n
    var = (m2s + counts * (means - mean) ** 2).sum(0) / n
    return mean, var, n


def sync_batch_norm(
    x: Tensor,
    running_mean: Tensor | None,
    running_var: Tensor | None,
    weight: Tensor | None = None,
    bias: Tensor | None = None,
    group: GroupLike = None,
    *,
    training: bool = True,
    momentum: float = 0.1,
    eps: float = 1e-5,
) -> Tensor:
    """Batch norm of ``x`` ``[B_r, C, ...]`` with statistics over every rank's ``B_r`` rows.

    Same arguments and result as ``torch.nn.functional.batch_norm`` on the concatenation of
    every rank's ``x`` (this rank's rows of it), with ``B_r`` free per rank, zero included.
    In training, the batch mean and biased variance normalise, and ``running_mean`` and
    ``running_var`` (when given) are updated in place with ``momentum``, the variance
    unbiased; every rank updates its copy to the same values. Outside training the running
    statistics normalise and nothing is communicated. ``x`` is not modified.

    Gradient (the objective is the sum over ranks of what each rank back-propagates): each
    rank's ``x`` gets the gradient of the whole objective through the shared statistics
    (this rank's rows); ``weight`` and ``bias`` get this rank's part: sum them over ranks as
    for any replicated parameter (DDP averaging gives the single-process gradient when every
    rank back-propagates N times its share).

    Communication: training forward 1 all_gather of ``2C + 1`` values per rank, backward 1
    reduce_scatter of ``[N, 2C + 1]``; evaluation none. Raises ``CollectiveArgumentError`` (a
    ``ValueError``; after the exchange, on every rank) when the ranks hold one value per
    channel in all.

    Args:
        x: this rank's rows ``[B_r, C, ...]``; not modified.
        running_mean: the running mean ``[C]``, updated in place in training, or None.
        running_var: the running variance ``[C]``, updated in place in training, or None.
        weight: the affine scale ``[C]``, or None.
        bias: the affine shift ``[C]``, or None.
        group: the tensor- or sequence-parallel group (default: the default group) or a DeviceMesh
            dimension.
        training: use the batch's statistics (and update the running ones).
        momentum: the running statistics' update factor.
        eps: added to the variance before the square root.

    Returns:
        This rank's rows of the normalised whole batch.

    Raises:
        CollectiveArgumentError: in training, the ranks hold one value per channel in all (after
            the exchange, on every rank).
        RuntimeError: outside training without running statistics (torch's batch norm).
        torch.distributed.DistBackendError: a peer died or never came (docs/faults.md).

    Example:
        >>> x = torch.randn(4, 3)
        >>> out = dg.parallel.sync_batch_norm(x, None, None)  # one rank: torch's batch norm
        >>> torch.allclose(out, torch.nn.functional.batch_norm(x, None, None, training=True))
        True
    """
    call = SYNC_BATCH_NORM.bind(group, x, x=x)
    if not training:
        return torch.nn.functional.batch_norm(
            x, running_mean, running_var, weight, bias, False, 0.0, eps
        )
    mean, var, n = _global_stats(x, as_process_group(group, "sync_batch_norm"))
    if not torch.compiler.is_compiling() and int(n.item()) <= 1:
        raise call.error(
            "expected more than 1 value per channel over all ranks when "
            f"training, got {int(n.item())} (input shape {tuple(x.shape)} on this rank)"
        )
    if running_mean is not None and running_var is not None:
        with torch.no_grad():
            unbiased = var * n / (n - 1)
            running_mean.lerp_(mean.to(running_mean.dtype), momentum)
            running_var.lerp_(unbiased.to(running_var.dtype), momentum)
    shape = (1, -1) + (1,) * (x.dim() - 2)
    # y = (x - mean) / sqrt(var + eps) * weight + bias, as x * scale + shift: one pass over x.
    scale = torch.rsqrt(var + eps)
    if weight is not None:
        scale = scale * weight
    shift = -mean * scale
    if bias is not None:
        shift = shift + bias
    return torch.addcmul(shift.view(shape), x, scale.view(shape))


class SyncBatchNorm(_BatchNorm):
    """``torch.nn.BatchNorm1d/2d/3d`` with statistics over every rank of ``group``, on any
    device and backend (gloo on CPU included), uneven and empty per-rank batches allowed.

    Same arguments, parameters, buffers and state dict as torch's batch norm layers (and
    ``torch.nn.SyncBatchNorm``: ``process_group=``, ``bias=``, :meth:`convert_sync_batchnorm`);
    ``momentum=None`` keeps a cumulative average, as torch does. ``process_group`` takes any
    form of ``group=`` (a DeviceMesh dim included); ``group=`` and :meth:`convert` are kept as
    aliases. Gradient, communication and errors: :func:`sync_batch_norm`.

    Args:
        num_features: the channels ``C``.
        eps: added to the variance before the square root.
        momentum: the running statistics' update factor (None: a cumulative average).
        affine: learn a scale and a shift.
        track_running_stats: keep running statistics.
        process_group: the group whose ranks share the statistics (any form of ``group=``).
        device: where the parameters and buffers are made.
        dtype: their dtype.
        bias: learn the shift (with ``affine``).
        group: an alias of ``process_group``.

    Raises:
        CollectiveArgumentError: ``process_group`` and ``group`` both given.

    Example:
        >>> bn = dg.parallel.SyncBatchNorm(3)
        >>> x = torch.randn(4, 3)
        >>> torch.allclose(bn(x), torch.nn.BatchNorm1d(3)(x))  # one rank: torch's layer
        True
    """

    def __init__(
        self,
        num_features: int,
        eps: float = 1e-5,
        momentum: float | None = 0.1,
        affine: bool = True,
        track_running_stats: bool = True,
        process_group: GroupLike = None,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
        *,
        bias: bool = True,
        group: GroupLike = None,
    ) -> None:
        super().__init__(
            num_features, eps, momentum, affine, track_running_stats, device, dtype, bias=bias
        )
        self.process_group = as_process_group(
            _one_group(process_group, group, "SyncBatchNorm"), "SyncBatchNorm"
        )

    @property
    def group(self) -> ProcessGroup | None:
        """The group, as ``process_group`` (distgrad's earlier name for it)."""
        return self.process_group

    def _check_input_dim(self, input: Tensor) -> None:
        """Nothing here: :func:`sync_batch_norm` checks its ``x`` (one argument, one message)."""

    def forward(self, input: Tensor) -> Tensor:
        training = self.training or self.running_mean is None
        factor = 0.0 if self.momentum is None else self.momentum
        if self.training and self.track_running_stats and self.num_batches_tracked is not None:
            self.num_batches_tracked.add_(1)
            if self.momentum is None:  # a cumulative moving average
                factor = 1.0 / float(self.num_batches_tracked)
        use_running = not self.training or self.track_running_stats
        return sync_batch_norm(
            input,
            self.running_mean if use_running else None,
            self.running_var if use_running else None,
            self.weight,
            self.bias,
            self.process_group,
            training=training,
            momentum=factor,
            eps=self.eps,
        )

    @classmethod
    def convert_sync_batchnorm(
        cls, module: torch.nn.Module, process_group: GroupLike = None
    ) -> torch.nn.Module:
        """Return ``module`` with every ``torch.nn.BatchNorm*d`` (and ``torch.nn.SyncBatchNorm``)
        inside replaced by this class, parameters and buffers carried over (shared, not copied),
        as ``torch.nn.SyncBatchNorm.convert_sync_batchnorm`` does."""
        if isinstance(module, _BatchNorm) and not isinstance(module, cls):
            new = cls(
                module.num_features,
                module.eps,
                module.momentum,
                module.affine,
                module.track_running_stats,
                process_group,
                bias=module.bias is not None,
            )
            if module.affine:
                new.weight, new.bias = module.weight, module.bias
            new.running_mean, new.running_var = module.running_mean, module.running_var
            new.num_batches_tracked = module.num_batches_tracked
            new.train(module.training)
            if hasattr(module, "qconfig"):
                new.qconfig = module.qconfig
            return new
        for name, child in module.named_children():
            module.add_module(name, cls.convert_sync_batchnorm(child, process_group))
        return module

    @classmethod
    def convert(
        cls, module: torch.nn.Module, group: GroupLike = None, *, process_group: GroupLike = None
    ) -> torch.nn.Module:
        """:meth:`convert_sync_batchnorm` under distgrad's earlier name (``group`` for
        ``process_group``)."""
        return cls.convert_sync_batchnorm(module, _one_group(process_group, group, "convert"))


def _one_group(process_group: GroupLike, group: GroupLike, op: str) -> GroupLike:
    """``process_group`` (torch's name) or ``group`` (distgrad's earlier one), not both."""
    if process_group is not None and group is not None:
        raise CollectiveArgumentError(
            f"{op}: pass process_group (torch's name) or group (its alias), not both"
        )
    return group if process_group is None else process_group
