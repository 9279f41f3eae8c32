"""lightly's ``NTXentLoss`` and ``BarlowTwinsLoss``, exact over the global batch.

One changed import in lightly's training code (``lightly.loss`` -> this module): the
constructors take lightly 1.6's arguments, the forwards its signature. What each flag does
(docs/integrations.md has the figures):

* ``gather_distributed``: accepted and moot. These losses are :func:`distgrad.losses.nt_xent`
  and :func:`distgrad.losses.barlow_twins` over the global batch whatever it says: every rank
  returns the global loss, and DistributedDataParallel's averaging gives the single-process
  gradient. (lightly with ``gather_distributed=False`` takes negatives, or the
  cross-correlation, from the local batch only; Barlow Twins with it still standardises each
  rank's embeddings with that rank's own batch statistics.)
* ``memory_bank_size`` with entries (MoCo's queue of past negatives: ``(4096, dim)``): refused;
  ``0`` and ``(0, dim)``, which disable lightly's bank, are accepted. A bank's
  entries carry no gradient and come from earlier steps, so no single-process computation on
  the current batch is its truth; use lightly's own loss for MoCo.
* ``temperature`` must be positive (lightly accepts a negative one; a negative temperature
  turns the softmax around).
"""

from __future__ import annotations

from collections.abc import Sequence

from torch import Tensor, nn

from distgrad._mesh import GroupLike
from distgrad.integrations._options import refuse
from distgrad.losses.barlow_twins import barlow_twins
from distgrad.losses.contrastive import nt_xent

__all__ = ["BarlowTwinsLoss", "NTXentLoss"]


class NTXentLoss(nn.Module):
    """SimCLR's NT-Xent over the global batch, with lightly's ``NTXentLoss`` signature.

    ``forward(out0, out1)``: the two views' projections, ``[B_l, D]`` each; returns the mean
    over all 2B anchors of every rank of ``-log softmax`` of its positive (the other view of
    its sample) against the other 2B - 2 embeddings, on cosine similarities divided by
    ``temperature``. lightly's value on a rank with ``gather_distributed=True`` is the mean
    over its own anchors; the mean of those over ranks (even shards) is this value.

    ``group``, ``sizes``: see :func:`distgrad.losses.nt_xent`. Communication: two all_gathers
    of ``[B_l, D]`` and a scalar all_reduce forward, two reduce-scatters backward.

    Args:
        temperature: the softmax temperature, as lightly's; must be positive.
        memory_bank_size: lightly's memory bank (entries, or ``(entries, dim)``); only a
            disabled bank (``0`` or ``(0, dim)``) is accepted.
        gather_distributed: accepted, and changes nothing (the negatives are always the
            global batch's).
        group: distgrad's: the process group (default: the default group) or a DeviceMesh
            dimension, whose ranks hold the global batch.
        sizes: distgrad's: every rank's row count, the same list on every rank; given, the
            ranks need not exchange their row counts (default: they do).

    Raises:
        UnsupportedOptionError: a memory bank with entries, or a temperature that is not
            positive. The forward raises as ``distgrad.losses.nt_xent`` does.

    Example:
        >>> g = torch.Generator().manual_seed(0)
        >>> out0, out1 = torch.randn(2, 4, 8, generator=g)
        >>> loss_fn = dg.integrations.lightly.NTXentLoss(temperature=0.2, gather_distributed=True)
        >>> torch.equal(loss_fn(out0, out1), dg.losses.nt_xent(out0, out1, temperature=0.2))
        True
    """

    def __init__(
        self,
        temperature: float = 0.5,
        memory_bank_size: int | Sequence[int] = 0,
        gather_distributed: bool = False,
        *,
        group: GroupLike = None,
        sizes: Sequence[int] | None = None,
    ) -> None:
        super().__init__()
        entries = memory_bank_size if isinstance(memory_bank_size, int) else memory_bank_size[0]
        if entries != 0:  # lightly: (0, dim) and 0 disable the bank
            raise refuse(
                "NTXentLoss",
                "memory_bank_size",
                memory_bank_size,
                "pass 0 (SimCLR: the global batch's negatives), or use lightly's own loss "
                "for a memory bank, whose past entries have no single-process truth",
            )
        if not temperature > 0:
            raise refuse("NTXentLoss", "temperature", temperature, "pass a positive number")
        self.temperature, self.memory_bank_size = temperature, memory_bank_size
        self.gather_distributed = gather_distributed
        self.group, self.sizes = group, sizes

    def forward(self, out0: Tensor, out1: Tensor) -> Tensor:
        return nt_xent(out0, out1, temperature=self.temperature, group=self.group, sizes=self.sizes)


class BarlowTwinsLoss(nn.Module):
    """Barlow Twins over the global batch, with lightly's ``BarlowTwinsLoss`` signature.

    ``forward(z_a, z_b)``: each view standardised per dim with the global batch's mean and
    biased variance (eps 1e-5, as lightly's ``batch_norm``), ``C = z_a^T z_b / B``, and
    ``sum_i (1 - C_ii)^2 + lambda_param * sum_{i != j} C_ij^2``: the same value on every rank.
    On one process this is lightly's loss; on several, lightly standardises with each rank's
    own statistics, this with the global batch's (what one process computes).

    ``group``, ``sizes``: see :func:`distgrad.losses.barlow_twins`. Communication: 5
    all_reduces of statistics (``[D]`` and ``[D, D]``) forward and backward.

    Args:
        lambda_param: the weight of the off-diagonal terms, as lightly's (distgrad's
            ``lambda_offdiag``).
        gather_distributed: accepted, and changes nothing (the statistics are always the
            global batch's).
        group: distgrad's: the process group (default: the default group) or a DeviceMesh
            dimension, whose ranks hold the global batch.
        sizes: distgrad's: every rank's row count, the same list on every rank; given, the
            ranks need not exchange their row counts (default: they do).

    Raises:
        Nothing at construction; the forward raises as ``distgrad.losses.barlow_twins`` does.

    Example:
        >>> g = torch.Generator().manual_seed(0)
        >>> z_a, z_b = torch.randn(2, 8, 4, dtype=torch.float64, generator=g)
        >>> loss_fn = dg.integrations.lightly.BarlowTwinsLoss(lambda_param=5e-3)
        >>> torch.equal(loss_fn(z_a, z_b), dg.losses.barlow_twins(z_a, z_b, lambda_offdiag=5e-3))
        True
    """

    def __init__(
        self,
        lambda_param: float = 5e-3,
        gather_distributed: bool = False,
        *,
        group: GroupLike = None,
        sizes: Sequence[int] | None = None,
    ) -> None:
        super().__init__()
        self.lambda_param, self.gather_distributed = lambda_param, gather_distributed
        self.group, self.sizes = group, sizes

    def forward(self, z_a: Tensor, z_b: Tensor) -> Tensor:
        return barlow_twins(
            z_a, z_b, lambda_offdiag=self.lambda_param, group=self.group, sizes=self.sizes
        )
