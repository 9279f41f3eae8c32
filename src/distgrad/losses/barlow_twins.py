"""Barlow Twins with batch statistics over the global batch.

Legend: ``B`` the global batch, ``B_l`` this rank's rows, ``D`` the embedding dim.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from distgrad._mesh import GroupLike
from distgrad.collectives.all_reduce import apply_all_reduce
from distgrad.losses._global import BARLOW_TWINS, batch_sizes

__all__ = ["barlow_twins"]


def barlow_twins(
    view1: Tensor,
    view2: Tensor,
    *,
    lambda_offdiag: float = 5e-3,
    eps: float = 1e-5,
    group: GroupLike = None,
    sizes: Sequence[int] | None = None,
) -> Tensor:
    """Barlow Twins: push the cross-correlation of the two views' embeddings to the identity.

    Each view is standardised per dim with the global batch's mean and (biased) variance, as
    a BatchNorm without affine parameters would on the whole batch; then
    ``C = z1n^T z2n / B`` ([D, D]) and
    ``L = sum_i (1 - C_ii)^2 + lambda_offdiag * sum_{i != j} C_ij^2``.

    Every rank computes the same ``L`` from all-reduced statistics and gets it as the value;
    under the sum contract each rank's gradient is world_size times its part of ``dL/dz``, so
    DistributedDataParallel's averaging gives exactly the single-process gradient.

    ``sizes`` is every rank's row count, the same list on every rank (``[B_l] * world_size``
    for even shards); without it the ranks first exchange their row counts. The statistics are
    computed in float32 at least, with autocast off (``contrastive._unit`` says why).

    Communication: forward 5 all_reduces, of statistics only (two [D] means, two [D]
    variances, one [D, D] correlation), never of the embeddings, plus the row-count exchange
    when ``sizes`` is not given; backward the same all_reduces of their gradients. Memory:
    [B_l, D] and [D, D].

    Args:
        view1: this rank's embeddings of the first view, [B_l, D].
        view2: this rank's embeddings of the second view, [B_l, D].
        lambda_offdiag: the weight of the off-diagonal terms.
        eps: added to the variance before the standardisation divides by its square root.
        group: the process group (default: the default group) or a DeviceMesh dimension.
        sizes: every rank's row count, the same list on every rank (``[B_l] * world_size``); given,
            the loss sends nothing but the embeddings and the value.

    Returns:
        The global batch's loss, a scalar, the same on every rank.

    Raises:
        CollectiveArgumentError: an invalid argument on some rank (views of different shapes,
            ``sizes`` that are not every rank's row count, a ``block_size`` that is not positive);
            raised on every rank of the group.
        CollectiveMismatchError: the ranks' embeddings do not fit together (another dim or dtype),
            found while the group's first calls are checked and in debug mode.
        torch.distributed.DistBackendError: a peer died or never came (docs/faults.md).

    Example:
        >>> g = torch.Generator().manual_seed(0)
        >>> view1, view2 = torch.randn(2, 8, 16, dtype=torch.float64, generator=g)
        >>> round(dg.losses.barlow_twins(view1, view2).item(), 4)  # one process, the whole batch
        19.5006
        >>> inputs = {"view1": view1, "view2": view2}
        >>> dg.testing.check_against_single_process(  # 4 ranks of 2 rows, simulated here
        ...     dg.losses.barlow_twins, inputs, world_size=4, simulate=True
        ... ).ok  # the same value and gradients
        True
    """
    call = BARLOW_TWINS.bind(group, view2, view1=view1, sizes=sizes)
    g = call.group
    count = sum(batch_sizes(call, view2))

    def standardise(z: Tensor) -> Tensor:
        z = z.to(torch.promote_types(z.dtype, torch.float32))
        mean = apply_all_reduce(z.sum(0), g, "sum") / count
        centred = z - mean
        var = apply_all_reduce((centred**2).sum(0), g, "sum") / count
        return centred / torch.sqrt(var + eps)

    with torch.autocast(view2.device.type, enabled=False):
        corr = apply_all_reduce(standardise(view1).T @ standardise(view2), g, "sum") / count
        diagonal = corr.diagonal()
        on = (1 - diagonal).pow(2).sum()
        off = corr.pow(2).sum() - diagonal.pow(2).sum()
        return on + lambda_offdiag * off
