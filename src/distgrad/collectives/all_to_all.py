"""all_to_all: its own adjoint, with the input and output sizes swapped."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from torch import Tensor

from distgrad._exchange import ops
from distgrad._exchange.async_op import offers_async_op
from distgrad._exchange.group import Group
from distgrad._exchange.handshake import RankCall
from distgrad._mesh import GroupLike
from distgrad.collectives import _common as c
from distgrad.collectives._differentiable import Adjoint, Collective, Plan, apply
from distgrad.collectives._fields import Dim
from distgrad.collectives._list_fields import Sizes
from distgrad.collectives._signature import Bound, Signature
from distgrad.errors import CollectiveMismatchError

__all__ = ["all_to_all", "apply_all_to_all"]

SIGNATURE = Signature(
    "all_to_all",
    fields=(Dim(),),
    lists=(
        Sizes("input_sizes", rule="split", same=False),
        Sizes("output_sizes", rule="any", same=False, even_with="input_sizes"),
    ),
    shapes="except_dim",
    known_by="output_sizes",
    assumes_alike=False,
)


@dataclass(frozen=True)
class _Plan(Plan):
    input_sizes: tuple[int, ...]
    output_sizes: tuple[int, ...]
    dim: int

    def swapped(self) -> _Plan:
        return _Plan(self.group, self.output_sizes, self.input_sizes, self.dim)


class _AllToAll(Collective):
    name = "all_to_all"

    @staticmethod
    def run(x: Tensor, plan: _Plan) -> Tensor:
        moved = c.to_exchange(x, plan.dim)
        exchange = ops.all_to_all.in_flight if plan.async_op else ops.all_to_all
        out = exchange(moved, plan.input_sizes, plan.output_sizes, group=plan.group)
        return c.from_exchange(out, x.dtype, plan.dim)

    @staticmethod
    def adjoint(plan: _Plan) -> Adjoint:
        return _AllToAll, plan.swapped()


def apply_all_to_all(
    x: Tensor,
    group: Group,
    input_sizes: tuple[int, ...],
    output_sizes: tuple[int, ...],
    dim: int,
    async_op: bool = False,
) -> Tensor:
    """all_to_all without the checks, for ops built on it (their arguments are checked)."""
    if group.size == 1:
        return x.clone()
    return apply(_AllToAll, x, _Plan(group, input_sizes, output_sizes, dim), async_op=async_op)


@offers_async_op
def all_to_all(
    x: Tensor,
    group: GroupLike = None,
    *,
    dim: int = 0,
    input_sizes: Sequence[int] | None = None,
    output_sizes: Sequence[int] | None = None,
    async_op: bool = False,
) -> Tensor:
    """Split ``x`` along ``dim`` into one part per rank, send part i to rank i, concatenate what
    arrives, in rank order.

    ``input_sizes[i]`` is the length of the part sent to rank i (default: an even split, which
    requires ``x.shape[dim]`` to divide by the group size). ``output_sizes[i]`` is the length
    received from rank i. With neither given, every rank splits evenly and receives as much as
    it sends, as ``torch.distributed.all_to_all_single`` does: every rank passes the same
    shape. With ``input_sizes`` alone, the ranks first exchange their sizes (one small
    all_gather and a host synchronisation); pass ``output_sizes`` too and the call sends nothing
    but the data. Other dims, dtype and device type must match across ranks. ``x`` is not
    modified.

    Gradient (the objective is the sum over ranks of each rank's loss): ``all_to_all`` of the
    gradient with ``input_sizes`` and ``output_sizes`` swapped: every slice goes back to the rank
    that sent it.

    Communication: forward 1 all_to_all of x, plus the size exchange when ``output_sizes`` must
    be learned; backward 1 all_to_all of the gradient.

    ``async_op=True``: return at once an :class:`~distgrad.AsyncTensor`, which waits for the
    data on first use; the backward's exchange is started the same way (docs/semantics.md,
    "Overlap: async_op").

    Args:
        x: this rank's tensor; not modified.
        group: the process group (default: the default group), a DeviceMesh dimension
            (``mesh["tp"]``, ``(mesh, "tp")``, ``(mesh, 1)``); a DTensor input is refused.
        dim: the dimension to split and concatenate along.
        input_sizes: the length of the part sent to each rank (default: an even split).
        output_sizes: the length received from each rank; given with ``input_sizes``, the call
            sends nothing but the data.
        async_op: return at once an ``AsyncTensor`` that waits for its data on first use.

    Returns:
        The parts every rank sent to this one, concatenated along ``dim`` in rank order.

    Raises:
        CollectiveArgumentError: an argument is invalid on some rank (sizes of the wrong length or
            that do not add up to ``x.shape[dim]``, ``output_sizes`` without ``input_sizes``);
            raised on every rank of the group, before any data moves, naming the rank, the argument
            and what was expected.
        CollectiveMismatchError: the ranks' arguments do not fit together (sizes sent that are not
            the sizes received, other dims or dtypes that differ), found while the group's first
            calls are checked across ranks, in debug mode (``set_debug``) and, after them, by the
            data guard (``set_guard``).
        torch.distributed.DistBackendError: a peer's process died while this rank waited
            (``PeerGoneError``, a subclass, when distgrad's liveness check saw it first); the
            message names the op, the pass and the peer (docs/faults.md).
        RuntimeError: a peer never came within the group's timeout (the backend's timeout error,
            with distgrad's account of who waited where first).

    Example:
        >>> def swapped(rank, world_size):  # part i goes to rank i
        ...     return dg.all_to_all(torch.tensor([10.0, 11.0]) + 10 * rank)
        >>> dg.testing.run_on_ranks(swapped, 2, simulate=True)
        [tensor([10., 20.]), tensor([11., 21.])]
    """
    call = SIGNATURE.bind(group, x, dim=dim, input_sizes=input_sizes, output_sizes=output_sizes)
    if call.group.size == 1:
        return x.clone()
    return apply(_AllToAll, x, call.plan or call.keep(_plan(call)), async_op=async_op)


def _plan(call: Bound) -> _Plan:
    expected = call["output_sizes"]
    if call.calls is not None:
        expected = _check_table(call.desc, call.group, call.calls)
    assert expected is not None, "a call whose output sizes are unknown exchanges metadata"
    return _Plan(call.group, call["input_sizes"], expected, call["dim"])


def _check_table(desc: str, group: Group, calls: list[RankCall]) -> tuple[int, ...]:
    """What this rank receives from each rank; every rank checks every rank's expectation.

    ``calls[s].lists``: what rank s sends to each rank, and what it expects from each (None:
    it learns that here).
    """
    n = group.size
    for r in range(n):
        expects = calls[r].lists[1]
        for s in range(n):
            sends = calls[s].lists[0]
            assert sends is not None
            if expects is not None and expects[s] != sends[r]:
                raise CollectiveMismatchError(
                    f"{desc} on rank {group.rank}: rank {r} expects {expects[s]} entries from "
                    f"rank {s} (output_sizes[{s}]; with neither size list given, a rank "
                    f"expects the even split of its own x), but rank {s} sends {sends[r]} "
                    f"(input_sizes[{r}])"
                )
    return tuple(sends[group.rank] for sends in (c.lists[0] for c in calls) if sends is not None)
