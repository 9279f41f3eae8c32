"""What the losses share: their declared arguments, the batch sizes, and the value contract.

Each loss declares its :class:`~distgrad.collectives._signature.Signature` here and calls
``bind`` as the collectives do, so one argument gets one message whichever op it is passed to.
The ranks' rows may differ, the embedding dim may not; ``sizes`` (every rank's rows), when
given, is the same list on every rank, and so are the options that change a loss's exchanges
(info_nce: how many hard negatives, which directions, which partition): a rank with other
options would wait on other messages.

Contract (docs/losses.md): every rank gets the **global** mean loss as the value, and a
gradient equal to world_size times the gradient of its own share of that mean. The shares add
up to the global loss, so the ranks' gradients sum to world_size times the single-process
gradient, and DistributedDataParallel's averaging yields exactly the single-process gradient,
with no scaling by the user. (Summing gradients by hand instead: divide the loss by world_size.)
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from torch import Tensor

from distgrad._exchange import ops
from distgrad._exchange.group import Group
from distgrad.collectives._fields import Args, Block, Choice, Pair, Positive, Scalar, tensor_problem
from distgrad.collectives._list_fields import Sizes
from distgrad.collectives._signature import Bound, Signature, sizes_along

__all__ = [
    "BARLOW_TWINS",
    "CLIP_LOSS",
    "DIRECTIONS",
    "INFO_NCE",
    "NT_XENT",
    "PARTITIONS",
    "SIGLIP_LOSS",
    "batch_sizes",
    "global_mean",
    "global_mean_of",
]

#: info_nce's ``directions``, by whether they are symmetric (sorted as the check sorts them)
DIRECTIONS: tuple[tuple[str, ...], ...] = (("query_to_key",), ("query_to_key", "key_to_query"))
PARTITIONS = ("joint", "per_direction")


@dataclass(frozen=True)
class Directions(Scalar):
    """info_nce's ``directions``, in any order; its value: whether both directions."""

    name: str = "directions"
    shown: bool = False

    def local(self, value: Any, args: Args) -> tuple[Any, str | None]:
        chosen = _sorted(value)
        if chosen not in DIRECTIONS or len(set(value)) != len(value):
            allowed = " or ".join(repr(d) for d in DIRECTIONS)
            return False, f"{self.name} must be {allowed}, got {value!r}"
        return chosen == DIRECTIONS[1], None

    def code(self, value: Any, args: Args) -> int:
        return int(value) if isinstance(value, bool) else -1

    def show(self, code: int) -> object:
        return repr(DIRECTIONS[code]) if 0 <= code < len(DIRECTIONS) else "?"


def _sorted(value: object) -> tuple[Any, ...] | None:
    if not isinstance(value, (tuple, list)):
        return None
    return tuple(sorted(value, reverse=True)) if all([isinstance(v, str) for v in value]) else None


@dataclass(frozen=True)
class Negatives(Scalar):
    """info_nce's hard ``negatives``, [B_l, m, D] for a query of [B_l, D], or None; its value
    (the same on every rank): m, the negatives per query."""

    name: str = "negatives"
    shown: bool = False

    @property
    def compared(self) -> str:
        return "negatives per query"

    def local(self, value: Any, args: Args) -> tuple[Any, str | None]:
        if value is None:
            return 0, None
        problem = tensor_problem(value, self.name)
        if problem is not None:
            return 0, problem
        if value.dim() != 3:
            return 0, f"{self.name} must be a [batch, m, dim] tensor, got {tuple(value.shape)}"
        query = args.passed["query"]
        if value.shape[0] != query.shape[0] or value.shape[2] != query.shape[1]:
            want = f"[{query.shape[0]}, m, {query.shape[1]}]"
            return 0, f"{self.name} must be {want} (m per query), got {tuple(value.shape)}"
        return value.shape[1], None

    def code(self, value: Any, args: Args) -> int:
        return value if isinstance(value, int) else -1


def _loss(op: str, pair: tuple[str, str], *fields: Any) -> Signature:
    """A loss's signature: its two [B_l, D] tensors, whose rows pair (``x`` is the second,
    the one whose rows the ranks share), its own fields, then ``sizes``."""
    first, second = pair
    return Signature(
        op,
        fields=(Pair(first), *fields),
        lists=(Sizes(rule="own"),),
        shapes="except_dim",
        tensor=second,
    )


INFO_NCE = _loss(
    "info_nce",
    ("query", "key"),
    Directions(),
    Choice("partition", PARTITIONS),
    Negatives(),
    Block(),
    Positive("temperature"),
)
NT_XENT = _loss("nt_xent", ("view1", "view2"), Block(), Positive("temperature"))
CLIP_LOSS = _loss("clip_loss", ("image", "text"), Block(), Positive("logit_scale"))
SIGLIP_LOSS = _loss("siglip_loss", ("image", "text"), Block(), Positive("logit_scale"))
BARLOW_TWINS = _loss("barlow_twins", ("view1", "view2"))


def batch_sizes(call: Bound, x: Tensor, alike: Sequence[int] = ()) -> tuple[int, ...]:
    """Every rank's row count of ``x``, for a call checked by its signature.

    Without ``sizes`` the ranks exchanged their row counts (one small all_gather and a host
    synchronisation, which also checked the call); inside torch.compile they are taken to be
    alike and checked on the device instead, with the embedding dim and ``alike`` (a loss's
    options that change its exchanges).
    """
    return sizes_along(call, call["sizes"], x.shape[0], [x.shape[1], *alike])


def global_mean(local_sum: Tensor, count: int, group: Group) -> Tensor:
    """The global mean of per-row losses as the value; world_size times the local share's
    gradient as the gradient (see the module docstring)."""
    share = local_sum * (group.size / count)
    total = ops.all_reduce(local_sum.detach().reshape(1), "sum", group=group).reshape(())
    return share + (total / count - share).detach()


def global_mean_of(local_sum: Tensor, global_sum: Tensor, count: int, group: Group) -> Tensor:
    """``global_mean`` where the loss already knows the global sum (detached, the same on
    every rank): no all_reduce."""
    share = local_sum * (group.size / count)
    return share + (global_sum / count - share).detach()
