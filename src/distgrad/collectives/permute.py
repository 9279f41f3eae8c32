"""permute: point-to-point exchange along a permutation; its adjoint is the inverse permutation."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from torch import Tensor

from distgrad._exchange import ops
from distgrad._exchange.async_op import offers_async_op
from distgrad._exchange.group import Group, own_rows
from distgrad._exchange.handshake import show
from distgrad._mesh import GroupLike
from distgrad.collectives import _common as c
from distgrad.collectives._compiled_checks import assume_alike
from distgrad.collectives._differentiable import Adjoint, Collective, Plan, apply
from distgrad.collectives._list_fields import Perm, Shape
from distgrad.collectives._signature import Signature
from distgrad.errors import CollectiveMismatchError

__all__ = ["permute"]

SIGNATURE = Signature(
    "permute", lists=(Perm(), Shape("recv_shape")), shapes="free", known_by="recv_shape"
)


@dataclass(frozen=True)
class _Plan(Plan):
    perm: tuple[int, ...]
    recv_shape: tuple[int, ...]  # the shape this rank receives
    send_shape: tuple[int, ...]  # the shape this rank sends

    def inverse(self) -> _Plan:
        inverse = [0] * len(self.perm)
        for source, target in enumerate(self.perm):
            inverse[target] = source
        return _Plan(self.group, tuple(inverse), self.send_shape, self.recv_shape)


class _Permute(Collective):
    name = "permute"

    @staticmethod
    def run(x: Tensor, plan: _Plan) -> Tensor:
        recv_shape = c.byte_shape(plan.recv_shape, x.dtype)
        exchange = ops.permute.in_flight if plan.async_op else ops.permute
        out = exchange(c.as_bytes(x), plan.perm, recv_shape, group=plan.group)
        return c.from_exchange(out, x.dtype)

    @staticmethod
    def adjoint(plan: _Plan) -> Adjoint:
        return _Permute, plan.inverse()


@offers_async_op
def permute(
    x: Tensor,
    perm: Sequence[int],
    group: GroupLike = None,
    *,
    recv_shape: Sequence[int] | None = None,
    async_op: bool = False,
) -> Tensor:
    """Send ``x`` to group rank ``perm[rank]`` and return what arrives from the rank that maps
    here.

    ``perm`` is a permutation of the group ranks 0..size-1, the same on every rank; a ring shift
    is ``[(r + 1) % size for r in range(size)]``. Ranks may send tensors of different shapes
    (each receives its source's shape); dtype and device type must match. ``recv_shape`` is the
    shape this rank receives: pass it on every rank (``x.shape`` when every rank sends the same
    shape) and the call sends nothing but the data; without it the ranks first exchange their
    shapes (one small all_gather and a host synchronisation), or inside ``torch.compile`` take
    every rank's shape to be this rank's and check that on the device. ``x`` is not modified.

    Gradient (the objective is the sum over ranks of each rank's loss): ``permute`` of the
    gradient with the inverse permutation: every gradient goes back to the rank that sent the
    value.

    Communication: forward 1 send and 1 receive of x per rank, plus the shape exchange when
    ``recv_shape`` is not given; backward the same with the inverse permutation.

    ``async_op=True``: return at once an :class:`~distgrad.AsyncTensor`, which waits for the
    data on first use; the backward's exchange is started the same way (docs/semantics.md,
    "Overlap: async_op").

    Args:
        x: this rank's tensor; not modified.
        perm: ``perm[r]`` is the rank that rank r sends to: a permutation of the group's ranks, the
            same on every rank.
        group: the process group (default: the default group), a DeviceMesh dimension
            (``mesh["tp"]``, ``(mesh, "tp")``, ``(mesh, 1)``); a DTensor input is refused.
        recv_shape: the shape this rank receives; given on every rank, the call sends nothing but
            the data.
        async_op: return at once an ``AsyncTensor`` that waits for its data on first use.

    Returns:
        The tensor sent by the rank that maps to this one.

    Raises:
        CollectiveArgumentError: an argument is invalid on some rank (``perm`` not a permutation of
            the group's ranks, ``recv_shape`` that is not a shape); raised on every rank of the
            group, before any data moves, naming the rank, the argument and what was expected.
        CollectiveMismatchError: the ranks' arguments do not fit together (``perm`` lists that
            differ, a ``recv_shape`` unlike the shape sent, dtypes that differ), found while the
            group's first calls are checked across ranks, in debug mode (``set_debug``) and, after
            them, by the data guard (``set_guard``).
        torch.distributed.DistBackendError: a peer's process died while this rank waited
            (``PeerGoneError``, a subclass, when distgrad's liveness check saw it first); the
            message names the op, the pass and the peer (docs/faults.md).
        RuntimeError: a peer never came within the group's timeout (the backend's timeout error,
            with distgrad's account of who waited where first).

    Example:
        >>> def shifted(rank, world_size):  # a ring: r sends to r + 1
        ...     ring = [(r + 1) % world_size for r in range(world_size)]
        ...     return dg.permute(torch.ones(1) * rank, ring, recv_shape=[1])
        >>> dg.testing.run_on_ranks(shifted, 3, simulate=True)
        [tensor([2.]), tensor([0.]), tensor([1.])]
    """
    call = SIGNATURE.bind(group, x, perm=perm, recv_shape=recv_shape)
    g, desc, calls = call.group, call.desc, call.calls
    order: tuple[int, ...] = call["perm"]
    wanted: tuple[int, ...] | None = call["recv_shape"]
    if g.size == 1:
        return x.clone()
    if calls is not None:
        for peer in calls:
            _check_recv_shape(
                desc, g, peer.rank, peer.lists[1], calls[order.index(peer.rank)].shape
            )
        # The shape the source (the rank that maps here) sends, read with the rank as data
        # (own_rows: one per-rank shape under simulate=True).
        source = own_rows([order.index(r) for r in range(g.size)], g.rank)
        dims = range(len(calls[0].shape))
        wanted = tuple(own_rows([c.shape[d] for c in calls], source) for d in dims)
    elif wanted is None:  # inside torch.compile: every rank's shape taken to be this rank's
        assume_alike(desc, g, list(x.shape), "recv_shape=")
        wanted = tuple(x.shape)
    return apply(_Permute, x, _Plan(g, order, wanted, tuple(x.shape)), async_op=async_op)


def _check_recv_shape(
    desc: str, g: Group, rank: int, wanted: tuple[int, ...] | None, sent: tuple[int, ...]
) -> None:
    if wanted is not None and wanted != sent:
        raise CollectiveMismatchError(
            f"{desc} on rank {g.rank}: rank {rank} expects to receive shape {show(wanted)} "
            f"(recv_shape), but its source sends {show(sent)}"
        )
