"""Tensor and sequence parallelism: Megatron's region operators and the parallel linear layers.

Legend: ``N`` ranks in the tensor-parallel group; ``T`` rows (tokens) of the global batch,
``T_r`` of them on rank r when the rows are sharded (sequence parallelism); a parallel layer's
hidden features are split ``H_r`` per rank (any split, uneven included).

Two contracts (docs/semantics.md, docs/patterns.md):

* ``objective="sum"`` (distgrad's default): the objective is the sum over ranks of what each
  rank back-propagates, and a parameter that every rank holds whole (a row-parallel bias) has
  its gradients summed over ranks, like any replicated parameter. A replicated activation
  needs no "f" operator: the collective that replicated it (an all_gather, the previous
  layer's all_reduce) sums the ranks' partial gradients in its own backward.
* ``objective="replicated"`` (Megatron's convention): every rank computes the same loss and it
  counts once; "f" (:func:`copy_to_region`) sums the partial gradients of the replicated input,
  "g" (:func:`reduce_from_region`) passes the gradient through, and replicated parameters get
  the whole gradient on every rank (not to be summed over the tensor-parallel group).

Inside a sequence-parallel layer both contracts coincide: an all_gather on the way in
(backward a reduce_scatter) and a reduce_scatter on the way out (backward an all_gather). At
the edges of a sequence-parallel region, :func:`split_to_sequence` and
:func:`gather_from_sequence` take the contract of the code around them.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Literal, TypeVar

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.autograd.function import FunctionCtx

from distgrad._exchange.group import ProcessGroup, resolve
from distgrad._mesh import GroupLike
from distgrad.collectives.all_gather import all_gather, reduce_scatter
from distgrad.collectives.all_reduce import all_reduce
from distgrad.parallel._checks import (
    COLUMN_LAYER,
    COLUMN_PARALLEL_LINEAR,
    COPY_TO_REGION,
    GATHER_FROM_SEQUENCE,
    REDUCE_FROM_REGION,
    REDUCE_SCATTER_TO_SEQUENCE,
    ROW_LAYER,
    ROW_PARALLEL_LINEAR,
    SPLIT_TO_SEQUENCE,
    as_process_group,
)

__all__ = [
    "ColumnParallelLinear",
    "Objective",
    "RowParallelLinear",
    "column_parallel_linear",
    "copy_to_region",
    "gather_from_sequence",
    "reduce_from_region",
    "reduce_scatter_to_sequence",
    "row_parallel_linear",
    "split_to_sequence",
]

Objective = Literal["sum", "replicated"]


class _CopyToRegion(torch.autograd.Function):
    """Megatron's f: the identity forward; the backward is g's forward (an all_reduce)."""

    @staticmethod
    def forward(ctx: FunctionCtx, x: Tensor, group: ProcessGroup | None) -> Tensor:
        ctx.group = group  # type: ignore[attr-defined]
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None]:
        # The partner op, so double backward follows the same contract.
        return reduce_from_region(grad, ctx.group), None


def copy_to_region(x: Tensor, group: GroupLike = None) -> Tensor:
    """Enter a tensor-parallel region with a replicated ``x`` (Megatron's "f").

    Returns ``x`` unchanged (a view). Use it under the replicated contract only: every rank
    holds the same ``x`` and computes the same loss, which counts once.

    Gradient: the sum over ranks of the gradients of the returned tensor (each rank's part
    went through its own shard of the weights), returned on every rank: the adjoint of
    :func:`reduce_from_region`. ``x`` is not modified.

    Communication: forward none; backward 1 all_reduce of ``x``'s shape.

    Args:
        x: the replicated input, the same on every rank; not modified.
        group: the tensor- or sequence-parallel group (default: the default group) or a DeviceMesh
            dimension.

    Returns:
        ``x`` itself, as a view.

    Raises:
        torch.distributed.DistBackendError: a peer died or never came (docs/faults.md).

    Example:
        >>> x = torch.ones(2, requires_grad=True)
        >>> dg.parallel.copy_to_region(x).backward(torch.tensor([1.0, 2.0]))
        >>> x.grad  # the sum over ranks of the gradient: one rank here
        tensor([1., 2.])
    """
    COPY_TO_REGION.bind(group, x)
    return _CopyToRegion.apply(x, as_process_group(group, "copy_to_region"))  # type: ignore[no-untyped-call,no-any-return]


def reduce_from_region(x: Tensor, group: GroupLike = None) -> Tensor:
    """Leave a tensor-parallel region: sum the ranks' partial results (Megatron's "g").

    Under the replicated contract: every rank computes the same loss from the sum, which
    counts once.

    Gradient: the incoming gradient, unchanged (no communication): the adjoint of
    :func:`copy_to_region`. ``x`` is not modified.

    Communication: forward 1 all_reduce of ``x``; backward none.

    Args:
        x: this rank's partial result; not modified.
        group: the tensor- or sequence-parallel group (default: the default group) or a DeviceMesh
            dimension.

    Returns:
        The sum over ranks of ``x``, on every rank.

    Raises:
        CollectiveMismatchError: the ranks' shapes or dtypes differ (while checked).
        torch.distributed.DistBackendError: a peer died or never came (docs/faults.md).

    Example:
        >>> dg.parallel.reduce_from_region(torch.tensor([1.0, 2.0]))  # one rank: its own
        tensor([1., 2.])
    """
    REDUCE_FROM_REGION.bind(group, x)
    group = as_process_group(group, "reduce_from_region")
    return all_reduce(x, "sum", group, objective="replicated")


def gather_from_sequence(
    x: Tensor,
    group: GroupLike = None,
    *,
    sizes: Sequence[int] | None = None,
    objective: Objective = "sum",
    dim: int = 0,
) -> Tensor:
    """Leave a sequence-parallel region: concatenate every rank's rows (dim 0) in rank order.

    ``sizes`` is every rank's row count ``T_r`` (uneven allowed); without it the ranks
    exchange their counts first. ``dim``: another dim to concatenate along (-1: a
    tensor-parallel output's features, Megatron's gather along the last dim).

    Gradient: under ``objective="sum"``, the reduce-scatter of the gradient: each rank
    receives, for its own rows, the sum over ranks of their gradients (the adjoint of
    :func:`reduce_scatter_to_sequence`); under ``"replicated"`` (every rank computes the same
    loss from the result, counted once: Megatron's gather with no tensor-parallel output
    gradient), this rank's rows of its own gradient, no communication (the adjoint of
    :func:`split_to_sequence`). ``x`` is not modified.

    Communication: forward 1 all_gather of [T_r, ...]; backward 1 reduce_scatter of [T, ...]
    under ``"sum"``, none under ``"replicated"``.

    Args:
        x: this rank's rows; not modified.
        group: the tensor- or sequence-parallel group (default: the default group) or a DeviceMesh
            dimension.
        sizes: every rank's row count ``T_r``; given, nothing but the data is sent.
        objective: ``"sum"`` (the losses of every rank add up) or ``"replicated"`` (every rank
            computes the same loss, counted once: Megatron's convention).
        dim: the dimension to concatenate along (-1: a tensor-parallel output's features).

    Returns:
        Every rank's rows concatenated along ``dim`` in rank order.

    Raises:
        CollectiveArgumentError: ``sizes`` of the wrong length or not this rank's count, an unknown
            ``objective``; raised on every rank of the group.
        torch.distributed.DistBackendError: a peer died or never came (docs/faults.md).

    Example:
        >>> dg.parallel.gather_from_sequence(torch.arange(3.0), sizes=[3])  # one rank
        tensor([0., 1., 2.])
    """
    GATHER_FROM_SEQUENCE.bind(group, x, objective=objective)
    group = as_process_group(group, "gather_from_sequence")
    return all_gather(x, group, dim=dim, sizes=sizes, objective=objective)


class _SplitReplicated(torch.autograd.Function):
    """Megatron's scatter to a parallel region: keep this rank's slice along ``dim`` forward;
    the backward gathers every rank's slice gradients, so each rank holds the whole gradient."""

    @staticmethod
    def forward(
        ctx: FunctionCtx,
        x: Tensor,
        sizes: tuple[int, ...],
        rank: int,
        group: ProcessGroup | None,
        dim: int,
    ) -> Tensor:
        ctx.sizes, ctx.group, ctx.dim = sizes, group, dim  # type: ignore[attr-defined]
        return x.narrow(dim, sum(sizes[:rank]), sizes[rank]).clone()

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None, None, None, None]:
        # The partner op, so double backward follows the same contract.
        whole = gather_from_sequence(
            grad, ctx.group, sizes=ctx.sizes, objective="replicated", dim=ctx.dim
        )
        return whole, None, None, None, None


def split_to_sequence(
    x: Tensor,
    group: GroupLike = None,
    *,
    sizes: Sequence[int] | None = None,
    objective: Objective = "sum",
    dim: int = 0,
) -> Tensor:
    """Enter a sequence-parallel region from a tensor every rank holds whole: keep this rank's
    rows (dim 0, or ``dim``: -1 splits the features, Megatron's scatter along the last dim).

    ``sizes`` is every rank's row count (default: an even split, which needs ``x.shape[dim]``
    to divide by the group size).

    Gradient: under ``objective="sum"`` the gradient of this rank's rows, zeros elsewhere (a
    slice: each rank's part of a replicated tensor; the collective that replicated ``x`` sums
    them); under ``"replicated"`` (Megatron's scatter to the sequence-parallel region) every
    rank's row gradients gathered, the whole gradient on every rank. ``x`` is not modified.

    Communication: forward none; backward none under ``"sum"``, 1 all_gather of [T_r, ...]
    under ``"replicated"``.

    Args:
        x: the tensor every rank holds whole; not modified.
        group: the tensor- or sequence-parallel group (default: the default group) or a DeviceMesh
            dimension.
        sizes: every rank's row count (default: an even split).
        objective: ``"sum"`` (the losses of every rank add up) or ``"replicated"`` (every rank
            computes the same loss, counted once: Megatron's convention).
        dim: the dimension to split (-1: the features).

    Returns:
        This rank's rows of ``x``.

    Raises:
        CollectiveArgumentError: ``sizes`` that do not add up to ``x.shape[dim]``, an unknown
            ``objective``; raised on every rank of the group.

    Example:
        >>> dg.parallel.split_to_sequence(torch.arange(3.0), sizes=[3])  # one rank: every row
        tensor([0., 1., 2.])
    """
    call = SPLIT_TO_SEQUENCE.bind(group, x, objective=objective, dim=dim, sizes=sizes)
    g, dim, sizes = call.group, call["dim"], call["sizes"]
    if objective == "replicated" and g.size > 1:
        group = as_process_group(group, "split_to_sequence")
        return _SplitReplicated.apply(x, sizes, g.rank, group, dim)  # type: ignore[no-untyped-call,no-any-return]
    return x.narrow(dim, sum(sizes[: g.rank]), sizes[g.rank])


def reduce_scatter_to_sequence(
    x: Tensor, group: GroupLike = None, *, sizes: Sequence[int] | None = None, dim: int = 0
) -> Tensor:
    """Enter a sequence-parallel region: sum the ranks' partial [T, ...] results and keep this
    rank's rows (dim 0, or ``dim``).

    ``sizes`` is every rank's row count ``T_r`` (default: an even split of ``T``).

    Gradient (both contracts): the all_gather of the gradients of every rank's rows. ``x`` is
    not modified.

    Communication: forward 1 reduce_scatter of [T, ...]; backward 1 all_gather of [T_r, ...].

    Args:
        x: this rank's partial ``[T, ...]`` result; not modified.
        group: the tensor- or sequence-parallel group (default: the default group) or a DeviceMesh
            dimension.
        sizes: every rank's row count ``T_r`` (default: an even split of ``T``).
        dim: the dimension to split along.

    Returns:
        This rank's rows of the sum over ranks.

    Raises:
        CollectiveArgumentError: ``sizes`` that do not add up to ``x.shape[dim]``; raised on every
            rank of the group.
        torch.distributed.DistBackendError: a peer died or never came (docs/faults.md).

    Example:
        >>> dg.parallel.reduce_scatter_to_sequence(torch.arange(3.0))  # one rank: every row
        tensor([0., 1., 2.])
    """
    REDUCE_SCATTER_TO_SEQUENCE.bind(group, x)
    group = as_process_group(group, "reduce_scatter_to_sequence")
    return reduce_scatter(x, "sum", group, dim=dim, sizes=sizes)


def column_parallel_linear(
    x: Tensor,
    weight: Tensor,
    bias: Tensor | None = None,
    group: GroupLike = None,
    *,
    sequence_parallel: bool = False,
    sizes: Sequence[int] | None = None,
    objective: Objective = "sum",
    gather_output: bool = False,
    splits: Sequence[int] | None = None,
) -> Tensor:
    """``x @ weight.T + bias`` with this rank's ``H_r`` output features of a split linear layer.

    ``weight`` is this rank's rows of the full weight, ``[H_r, D_in]``, and ``bias`` its
    ``[H_r]`` entries. Without ``sequence_parallel``, ``x`` is the whole input ``[..., D_in]``,
    the same on every rank; with it, ``x`` is this rank's ``T_r`` rows (dim 0), gathered first
    (``sizes``: every rank's ``T_r``; without it the ranks exchange their counts). The result,
    ``[..., H_r]``, feeds :func:`row_parallel_linear`; with ``gather_output`` (Megatron's
    option) every rank's features are gathered along the last dim into the whole
    ``[..., H]`` (``splits``: every rank's ``H_r``; without it the ranks exchange them). ``x``
    is not modified.

    Gradient: ``weight`` and ``bias`` get their whole gradient on this rank (no other rank
    holds them). ``x``: with ``sequence_parallel``, every rank's partial gradient of the
    gathered rows is reduce-scattered back to the rows' owners; otherwise, under
    ``objective="sum"``, this rank's partial gradient (the collective that replicated ``x``
    sums the partials in its backward), and under ``"replicated"`` (Megatron's f) their sum
    over ranks. The gathered output's gradient: under ``"sum"`` each rank's features get the
    sum over ranks of their gradients (all_gather's adjoint), under ``"replicated"`` this
    rank's slice of its own (Megatron's: every rank holds the same loss).

    Communication: forward 1 all_gather of [T_r, D_in] with ``sequence_parallel``, else none;
    backward 1 reduce_scatter of [T, D_in] with ``sequence_parallel``, 1 all_reduce of
    ``x`` under ``"replicated"``, else none. ``gather_output`` adds 1 all_gather of
    [..., H_r] forward and, under ``"sum"``, 1 reduce_scatter of [..., H] backward.

    Args:
        x: the whole input ``[..., D_in]``, or with ``sequence_parallel`` this rank's ``T_r`` rows.
        weight: this rank's rows of the full weight, ``[H_r, D_in]``.
        bias: this rank's ``[H_r]`` entries of the bias, or None.
        group: the tensor- or sequence-parallel group (default: the default group) or a DeviceMesh
            dimension.
        sequence_parallel: ``x`` is this rank's rows, gathered first.
        sizes: with ``sequence_parallel``, every rank's row count ``T_r``.
        objective: ``"sum"`` (the losses of every rank add up) or ``"replicated"`` (every rank
            computes the same loss, counted once: Megatron's convention).
        gather_output: return every rank's features, the whole ``[..., H]``.
        splits: with ``gather_output``, every rank's ``H_r``.

    Returns:
        ``[..., H_r]``, this rank's output features (``[..., H]`` with ``gather_output``).

    Raises:
        CollectiveArgumentError: ``sizes`` or ``splits`` that do not fit, an unknown ``objective``;
            raised on every rank of the group.
        RuntimeError: ``x``'s features do not match ``weight`` (torch's matmul).
        torch.distributed.DistBackendError: a peer died or never came (docs/faults.md).

    Example:
        >>> linear = torch.nn.Linear(3, 4)  # one rank holds every output feature
        >>> x = torch.randn(2, 3)
        >>> y = dg.parallel.column_parallel_linear(x, linear.weight, linear.bias)
        >>> torch.allclose(y, linear(x))
        True
    """
    COLUMN_PARALLEL_LINEAR.bind(
        group,
        x,
        objective=objective,
        weight=weight,
        bias=bias,
        sequence_parallel=sequence_parallel,
        gather_output=gather_output,
    )
    group = as_process_group(group, "column_parallel_linear")
    if sequence_parallel:
        x = gather_from_sequence(x, group, sizes=sizes)
    elif objective == "replicated":
        x = copy_to_region(x, group)
    y = F.linear(x, weight, bias)
    if gather_output:
        y = all_gather(y, group, dim=-1, sizes=splits, objective=objective)
    return y


def row_parallel_linear(
    x: Tensor,
    weight: Tensor,
    bias: Tensor | None = None,
    group: GroupLike = None,
    *,
    sequence_parallel: bool = False,
    sizes: Sequence[int] | None = None,
    objective: Objective = "sum",
    input_is_parallel: bool = True,
    splits: Sequence[int] | None = None,
) -> Tensor:
    """``x @ weight.T + bias`` of a linear layer whose input features are split over the ranks.

    ``x`` is this rank's ``[..., H_r]`` features (the output of
    :func:`column_parallel_linear`), ``weight`` its columns of the full weight,
    ``[D_out, H_r]``; ``bias`` ``[D_out]`` is whole on every rank and added once, after the
    sum. With ``input_is_parallel=False`` (Megatron's option) ``x`` is the whole
    ``[..., H]``, the same on every rank, and each rank keeps its ``H_r`` features first
    (``splits``: every rank's ``H_r``, default as even as possible, larger first). Without
    ``sequence_parallel`` the result ``[..., D_out]`` is the same on every rank; with it, each
    rank keeps its ``T_r`` rows (``sizes``; default an even split). ``x`` is not modified.

    Gradient: ``x`` and ``weight`` get their whole gradient on this rank (a whole ``x``: its
    features' slice under ``"sum"``, the collective that replicated it sums the slices; every
    rank's slices gathered under ``"replicated"``, Megatron's scatter); ``bias`` gets this
    rank's part under ``objective="sum"`` and with ``sequence_parallel`` (sum it over the
    ranks, as for any replicated parameter), the whole gradient on every rank under
    ``"replicated"`` (Megatron's g: not to be summed over the group).

    Communication: forward 1 all_reduce of [..., D_out] (``sequence_parallel``: 1
    reduce_scatter of [T, D_out]); backward 1 all_reduce of [..., D_out] under ``"sum"``, none
    under ``"replicated"`` (``sequence_parallel``: 1 all_gather of [T_r, D_out]); a whole
    input adds 1 all_gather of [..., H_r] backward under ``"replicated"``.

    Args:
        x: this rank's ``[..., H_r]`` features, or the whole ``[..., H]`` with
            ``input_is_parallel=False``.
        weight: this rank's columns of the full weight, ``[D_out, H_r]``.
        bias: the whole ``[D_out]`` bias, added once after the sum, or None.
        group: the tensor- or sequence-parallel group (default: the default group) or a DeviceMesh
            dimension.
        sequence_parallel: keep this rank's ``T_r`` rows of the result.
        sizes: with ``sequence_parallel``, every rank's row count (default: an even split).
        objective: ``"sum"`` (the losses of every rank add up) or ``"replicated"`` (every rank
            computes the same loss, counted once: Megatron's convention).
        input_is_parallel: ``x`` holds this rank's features (default); False: the whole input.
        splits: with ``input_is_parallel=False``, every rank's ``H_r``.

    Returns:
        ``[..., D_out]``, the same on every rank, or this rank's rows with ``sequence_parallel``.

    Raises:
        CollectiveArgumentError: ``sizes`` or ``splits`` that do not fit, an unknown ``objective``;
            raised on every rank of the group.
        RuntimeError: ``x``'s features do not match ``weight`` (torch's matmul).
        torch.distributed.DistBackendError: a peer died or never came (docs/faults.md).

    Example:
        >>> linear = torch.nn.Linear(4, 2)  # one rank holds every input feature
        >>> x = torch.randn(3, 4)
        >>> y = dg.parallel.row_parallel_linear(x, linear.weight, linear.bias)
        >>> torch.allclose(y, linear(x))
        True
    """
    call = ROW_PARALLEL_LINEAR.bind(
        group,
        x,
        objective=objective,
        weight=weight,
        bias=bias,
        splits=None if input_is_parallel else splits,  # x's features, when split here
    )
    group = as_process_group(group, "row_parallel_linear")
    if not input_is_parallel:
        features = call["splits"]
        x = split_to_sequence(x, group, sizes=features, objective=objective, dim=-1)
    partial = F.linear(x, weight)
    if sequence_parallel:
        y = reduce_scatter_to_sequence(partial, group, sizes=sizes)
    else:
        y = all_reduce(partial, "sum", group, objective=objective)
    return y if bias is None else y + bias


_Layer = TypeVar("_Layer", bound="_ParallelLinear")


class _ParallelLinear(nn.Module):
    """What both parallel layers hold: this rank's shard of a linear layer (``weight``,
    ``bias``), every rank's ``splits`` of the split features, the group and the contract."""

    splits: list[int]

    def _hold(
        self,
        shard: nn.Linear,
        group: GroupLike,
        op: str,
        sequence_parallel: bool,
        objective: Objective,
    ) -> None:
        self.weight, self.bias = shard.weight, shard.bias
        self.group: ProcessGroup | None = as_process_group(group, op)
        self.sequence_parallel, self.objective = sequence_parallel, objective

    @classmethod
    def from_linear(
        cls: type[_Layer], linear: nn.Linear, group: GroupLike = None, **options: Any
    ) -> _Layer:
        """This rank's shard of ``linear`` (copied), with the same options as the constructor:
        its rows in a column-parallel layer, its columns (the bias whole) in a row-parallel one.
        """
        layer = cls(
            linear.in_features,
            linear.out_features,
            linear.bias is not None,
            group,
            device=linear.weight.device,
            dtype=linear.weight.dtype,
            **options,
        )
        rank = resolve(layer.group).rank
        start = sum(layer.splits[:rank])
        own = slice(start, start + layer.splits[rank])
        with torch.no_grad():
            layer._copy_shard(linear, own)
        return layer

    def _copy_shard(self, linear: nn.Linear, own: slice) -> None:
        """Copy this rank's part of ``linear``; ``own``: its features of the split dim."""
        raise NotImplementedError


class ColumnParallelLinear(_ParallelLinear):
    """The output features of a linear layer split over the ranks: :func:`column_parallel_linear`
    with this rank's ``weight`` ``[H_r, in_features]`` and ``bias`` ``[H_r]`` as parameters.

    ``splits`` gives every rank's ``H_r`` (default: as even as possible, larger first).
    ``gather_output`` (default False, unlike Megatron's True) returns the whole ``[..., H]``
    on every rank. ``group`` takes any form of ``group=`` (a DeviceMesh dim included);
    ``layer.group`` is its ``ProcessGroup``. :meth:`from_linear` takes this rank's rows of an
    existing ``nn.Linear``. Gradient and communication: :func:`column_parallel_linear`.

    Args:
        in_features: the input width.
        out_features: the whole output width ``H``, split over the ranks.
        bias: whether the layer has a bias.
        group: the tensor- or sequence-parallel group (default: the default group) or a DeviceMesh
            dimension.
        sequence_parallel: as ``column_parallel_linear`` takes it.
        objective: ``"sum"`` (the losses of every rank add up) or ``"replicated"`` (every rank
            computes the same loss, counted once: Megatron's convention).
        gather_output: as ``column_parallel_linear`` takes it.
        splits: every rank's ``H_r`` (default: as even as possible, larger first).
        device: where the parameters are made.
        dtype: the parameters' dtype.

    Raises:
        CollectiveArgumentError: ``splits`` that do not add up to ``out_features``; raised on every
            rank of the group.

    Example:
        >>> layer = dg.parallel.ColumnParallelLinear(3, 4)
        >>> layer.weight.shape  # this rank's rows: all of them, on one rank
        torch.Size([4, 3])
        >>> layer(torch.randn(2, 3)).shape
        torch.Size([2, 4])
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool = True,
        group: GroupLike = None,
        *,
        sequence_parallel: bool = False,
        objective: Objective = "sum",
        gather_output: bool = False,
        splits: Sequence[int] | None = None,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        op = "ColumnParallelLinear"
        call = COLUMN_LAYER.bind(
            group,
            None,
            objective=objective,
            sequence_parallel=sequence_parallel,
            gather_output=gather_output,
            out_features=out_features,
            splits=splits,
        )
        g, self.splits = call.group, list(call["splits"])
        mine = self.splits[g.rank]
        local = nn.Linear(in_features, mine, bias, device=device, dtype=dtype)
        self._hold(local, group, op, sequence_parallel, objective)
        self.gather_output = gather_output

    def _copy_shard(self, linear: nn.Linear, own: slice) -> None:
        """This rank's rows of ``linear``'s weight and bias."""
        self.weight.copy_(linear.weight[own])
        if self.bias is not None and linear.bias is not None:
            self.bias.copy_(linear.bias[own])

    def forward(self, x: Tensor, sizes: Sequence[int] | None = None) -> Tensor:
        """``sizes``: every rank's rows, with ``sequence_parallel`` (else exchanged)."""
        return column_parallel_linear(
            x,
            self.weight,
            self.bias,
            self.group,
            sequence_parallel=self.sequence_parallel,
            sizes=sizes,
            objective=self.objective,
            gather_output=self.gather_output,
            splits=self.splits,
        )


class RowParallelLinear(_ParallelLinear):
    """The input features of a linear layer split over the ranks: :func:`row_parallel_linear`
    with this rank's ``weight`` ``[out_features, H_r]`` and the whole ``bias`` as parameters.

    ``splits`` gives every rank's ``H_r`` (default: as even as possible, larger first, the
    split :class:`ColumnParallelLinear` makes of the same width). ``input_is_parallel``
    (default True: this rank's features, as :class:`ColumnParallelLinear` returns them); False
    takes the whole input and keeps this rank's features (Megatron's option). ``group`` takes
    any form of ``group=``; ``layer.group`` is its ``ProcessGroup``. :meth:`from_linear` takes
    this rank's columns of an existing ``nn.Linear``. Gradient and communication:
    :func:`row_parallel_linear`.

    Args:
        in_features: the whole input width ``H``, split over the ranks.
        out_features: the output width.
        bias: whether the layer has a bias.
        group: the tensor- or sequence-parallel group (default: the default group) or a DeviceMesh
            dimension.
        sequence_parallel: as ``row_parallel_linear`` takes it.
        objective: ``"sum"`` (the losses of every rank add up) or ``"replicated"`` (every rank
            computes the same loss, counted once: Megatron's convention).
        input_is_parallel: as ``row_parallel_linear`` takes it.
        splits: every rank's ``H_r`` (default: as even as possible, larger first).
        device: where the parameters are made.
        dtype: the parameters' dtype.

    Raises:
        CollectiveArgumentError: ``splits`` that do not add up to ``in_features``; raised on every
            rank of the group.

    Example:
        >>> linear = torch.nn.Linear(4, 2)
        >>> layer = dg.parallel.RowParallelLinear.from_linear(linear)  # this rank's columns
        >>> x = torch.randn(3, 4)
        >>> torch.allclose(layer(x), linear(x))
        True
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool = True,
        group: GroupLike = None,
        *,
        sequence_parallel: bool = False,
        objective: Objective = "sum",
        input_is_parallel: bool = True,
        splits: Sequence[int] | None = None,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        op = "RowParallelLinear"
        call = ROW_LAYER.bind(
            group, None, objective=objective, in_features=in_features, splits=splits
        )
        g, self.splits = call.group, list(call["splits"])
        local = nn.Linear(self.splits[g.rank], out_features, bias, device=device, dtype=dtype)
        self._hold(local, group, op, sequence_parallel, objective)
        self.input_is_parallel = input_is_parallel

    def _copy_shard(self, linear: nn.Linear, own: slice) -> None:
        """This rank's columns of ``linear``'s weight; the bias whole."""
        self.weight.copy_(linear.weight[:, own])
        if self.bias is not None and linear.bias is not None:
            self.bias.copy_(linear.bias)

    def forward(self, x: Tensor, sizes: Sequence[int] | None = None) -> Tensor:
        """``sizes``: every rank's rows, with ``sequence_parallel`` (default an even split)."""
        return row_parallel_linear(
            x,
            self.weight,
            self.bias,
            self.group,
            sequence_parallel=self.sequence_parallel,
            sizes=sizes,
            objective=self.objective,
            input_is_parallel=self.input_is_parallel,
            splits=self.splits,
        )
