"""What the losses share: their checks across ranks, the batch sizes, and the value contract.

Contract (docs/losses.md): every rank gets the **global** mean loss as the value, and a
gradient equal to world_size times the gradient of its own share of that mean. The shares add
up to the global loss, so the ranks' gradients sum to world_size times the single-process
gradient, and DistributedDataParallel's averaging yields exactly the single-process gradient,
with no scaling by the user. (Summing gradients by hand instead: divide the loss by world_size.)
"""

from __future__ import annotations

from collections.abc import Sequence

from torch import Tensor

from distgrad._exchange import ops
from distgrad._exchange.group import Group
from distgrad.collectives._signature import Signature, assume_alike, sizes_from

__all__ = ["OPTIONS", "batch_sizes", "global_mean", "global_mean_of"]

# One signature per loss: the ranks' rows may differ, the embedding dim may not; ``sizes``
# (every rank's rows), when given, is the same list on every rank. A loss with options that
# change its exchanges (info_nce: how many hard negatives, which directions) carries them as a
# second list, the same on every rank: a rank with other options would wait on other messages.
OPTIONS = "options (hard negatives per query, directions, partition)"
_SIGNATURES = {
    name: Signature(name, lists=("sizes",), same_lists=("sizes",), shapes="except_dim")
    for name in ("clip_loss", "nt_xent", "siglip_loss", "barlow_twins")
}
_SIGNATURES["info_nce"] = Signature(
    "info_nce", lists=("sizes", OPTIONS), same_lists=("sizes", OPTIONS), shapes="except_dim"
)


def batch_sizes(
    name: str,
    x: Tensor,
    group: Group,
    problem: str | None,
    sizes: Sequence[int] | None = None,
    options: Sequence[int] = (),
) -> tuple[Group, tuple[int, ...]]:
    """Check a loss's call across ranks and return every rank's row count of ``x``.

    ``problem`` is this rank's own complaint about its arguments (raised on every rank when the
    call is checked across ranks, at once on this rank otherwise). Without ``sizes`` the ranks
    exchange their row counts (one small all_gather and a host synchronisation), which also
    checks the call; inside torch.compile they are taken to be alike and checked on the
    device instead (``assume_alike``). ``options``: the loss's options that must be alike on
    every rank (``OPTIONS``; only for a loss that declares them), checked with the rest.
    """
    if problem is None and sizes is not None:
        if len(sizes) != group.size or any(not isinstance(s, int) or s < 0 for s in sizes):
            problem = f"sizes must be {group.size} non-negative ints (one per rank), got {sizes}"
        elif sizes[group.rank] != len(x):
            problem = (
                f"sizes[{group.rank}] must be {len(x)}, the rows of this rank's batch, "
                f"got {sizes[group.rank]}"
            )
    lists = {"sizes": sizes, OPTIONS: list(options)}
    g, calls = _SIGNATURES[name].check(
        group, name, x, lists=lists, problem=problem, sizes_known=sizes is not None
    )
    if calls is not None:
        return g, sizes_from(name, g, calls, sizes, 0)
    if sizes is not None:
        return g, tuple(sizes)
    if g.size > 1:  # inside torch.compile
        assume_alike(name, g, [len(x), x.shape[1], *options], "sizes=")
    return g, (len(x),) * g.size


def global_mean(local_sum: Tensor, count: int, group: Group) -> Tensor:
    """The global mean of per-row losses as the value; world_size times the local share's
    gradient as the gradient (see the module docstring)."""
    share = local_sum * (group.size / count)
    total = ops.all_reduce(local_sum.detach().reshape(1), "sum", group).reshape(())
    return share + (total / count - share).detach()


def global_mean_of(local_sum: Tensor, global_sum: Tensor, count: int, group: Group) -> Tensor:
    """``global_mean`` where the loss already knows the global sum (detached, the same on
    every rank): no all_reduce."""
    share = local_sum * (group.size / count)
    return share + (global_sum / count - share).detach()
