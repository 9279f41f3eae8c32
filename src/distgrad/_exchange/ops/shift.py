"""shift: a ring's step, each rank sending blocks to chosen ranks and receiving as many.

Every ring (``distgrad.losses._blockwise``, ``distgrad.parallel._ring_attention``) moves its
blocks with it through the one ring driver (``distgrad._exchange.ring``), each step started
(:meth:`start`) before the compute it overlaps.
"""

from __future__ import annotations

from collections.abc import Sequence

from torch import Tensor

from distgrad._exchange import functional
from distgrad._exchange.declare import exchange, like
from distgrad._exchange.group import Group
from distgrad._exchange.inflight import Steps
from distgrad._exchange.pairs import start_pairs

__all__ = ["shift"]


@exchange(
    lambda x, to, sources, recv_shape, *, group: like(x, (len(sources), *recv_shape)),
    traced=functional.shift,
)
def shift(
    x: Tensor,
    to: Sequence[int],
    sources: Sequence[int],
    recv_shape: Sequence[int],
    *,
    group: Group,
) -> Steps[Tensor]:
    """Send ``x[i]`` to group rank ``to[i]``; return ``[len(sources), *recv_shape]``, whose row
    j comes from group rank ``sources[j]`` (``x``'s dtype and device).

    Every rank of the group takes part, and each pair of ranks exchanges at most one message
    each way (a ring sends one block to each neighbour). Eagerly, point-to-point pairs, tagged
    (a dead peer is named); traced, one functional all_to_all that the compiler schedules
    (``distgrad._exchange.functional.shift``). Not guarded: the rings' blocks carry no tag.
    """
    if group.pg is None:  # alone: every message to itself
        return x.clone()
    out = x.new_empty((len(sources), *recv_shape))
    sends = [(x[i].contiguous(), peer) for i, peer in enumerate(to)]
    yield start_pairs(sends, [(out[j], peer) for j, peer in enumerate(sources)], group)
    return out
