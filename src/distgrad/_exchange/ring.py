"""One ring driver for every ring of distgrad: the ring losses' forward and backward
(``distgrad.losses._blockwise``) and ring attention's (``distgrad.parallel._ring_attention``).

Legend: ``W`` the group size, rank ``r``; block ``j`` is rank j's (its keys, or its keys and
values); at step ``t`` (0 .. W-1) rank r computes on block ``r - t (mod W)``.

Two things travel round the ring, both to rank r + 1 and from rank r - 1:

* the **blocks**, only read (keys; keys and values; and any per-key statistic the compute
  reads): each is needed whole before its step's compute starts;
* optionally an **accumulator** per block, that every rank adds its part to (the keys'
  gradient; CLIP's column logsumexps): a rank's part of block j is known only after it has
  computed on block j, and the accumulator must come home to rank j after the last rank.

The loop order (one for every ring; docs/patterns.md, "One ring driver", draws it): the blocks
travel one step *ahead* of their use, the accumulators one step *behind* their compute, both
in the same message, so each step's compute runs while one exchange is in flight::

    start m(-1) = [block r]                      # the next block, before any compute
    for t in 0 .. W-1:
        part = compute(t, block r-t)             # m(t-1) in flight meanwhile
        block r-t-1, acc = wait m(t-1)           # the block for step t+1; block r-t's acc
        acc = combine(acc, part)                 # (none at t = 0: this rank's part is all)
        start m(t) = [block r-t-1 (while t+2 < W) | acc (with accumulators)]
    acc of block r = wait m(W-1)                 # home, complete

``m(t)``, sent by every rank after its compute of step t, carries the block its receiver
computes on at step t + 2 (rank r already holds it: it arrived in ``m(t-1)``) and the
accumulator of the block the sender just computed on, which the receiver adds its part to
after its own compute of step t + 1. So each compute runs while the exchange started just
before it is in flight, and what it reads came in the exchange before that one. Messages:
``W + 1`` with an accumulator (the block ``W - 1`` times and the accumulator ``W`` times, the
last bringing it home), ``W - 1`` without; one alone (W = 1) sends nothing.

Each message is one flat buffer (the block's elements, then the accumulator's), so the block
and the accumulator may have different shapes, and every rank's block its own (ring
attention's uneven sequence blocks, a loss's keys padded to the largest shard). It moves
through the declared exchange ``ops.shift``: started (``shift.start``) eagerly, and while
``torch.compile`` traces, torch's functional ``all_to_all_single`` and its wait, which the
compiler orders (so a compiled ring is a graph of compute and functional collectives).

The driver knows nothing of what is computed: ``compute(step, source, block)`` returns this
rank's part of the block's accumulator (or None: nothing to add, as for a causal block that
lies wholly after the queries). A fused kernel can replace the compute without touching the
ring.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from distgrad._exchange.group import Group
from distgrad._exchange.inflight import InFlight
from distgrad._exchange.ops.shift import shift

__all__ = ["Ring", "Shapes", "run"]

#: The shape of rank j's block (or accumulator), from j: its owner's.
Shapes = Callable[[int], Sequence[int]]


@dataclass(frozen=True)
class Ring:
    """A ring over ``group``: which block a rank holds at each step, and the shapes that
    travel (``block(j)``: rank j's block; ``acc(j)``: its accumulator, or None for a ring
    with none). The one plan type of every ring."""

    group: Group
    block: Shapes
    acc: Shapes | None = None

    @property
    def steps(self) -> int:
        return self.group.size

    def source(self, step: int) -> int:
        """Whose block this rank computes on at ``step`` (arithmetic on the rank: under
        ``simulate=True`` it is a per-rank value)."""
        return (self.group.rank - step) % self.group.size


def _numel(shape: Sequence[int]) -> int:
    return math.prod(shape)


def _message(block: Tensor | None, acc: Tensor | None) -> Tensor:
    """One flat buffer: the block's elements, then the accumulator's."""
    parts = [t.reshape(-1) for t in (block, acc) if t is not None]
    return parts[0] if len(parts) == 1 else torch.cat(parts)


def _carried(ring: Ring, step: int) -> tuple[Sequence[int] | None, Sequence[int] | None]:
    """The shapes of what m(step) brings this rank from rank - 1: the block of its step
    + 2 (while there is one), and the accumulator of the block of its step + 1 (from step 0,
    in a ring with accumulators)."""
    block = ring.block(ring.source(step + 2)) if step + 2 < ring.steps else None
    acc = ring.acc(ring.source(step + 1)) if ring.acc is not None and step >= 0 else None
    return block, acc


def _start(ring: Ring, step: int, block: Tensor | None, acc: Tensor | None) -> InFlight[Tensor]:
    """Start m(step): ``block`` and ``acc`` to rank + 1, the same from rank - 1."""
    g = ring.group
    after, before = (g.rank + 1) % g.size, (g.rank - 1) % g.size
    size = sum(_numel(s) for s in _carried(ring, step) if s is not None)
    return shift.start(_message(block, acc)[None], [after], [before], (size,), group=g)


def _split(ring: Ring, step: int, data: Tensor) -> tuple[Tensor | None, Tensor | None]:
    """m(step) as it arrived, ``[numel]``: (block, accumulator), views of it."""
    block_shape, acc_shape = _carried(ring, step)
    block = acc = None
    used = 0
    if block_shape is not None:
        used = _numel(block_shape)
        block = data[:used].view(tuple(block_shape))
    if acc_shape is not None:
        acc = data[used:].view(tuple(acc_shape))
    return block, acc


def run(
    ring: Ring,
    own: Tensor,
    compute: Callable[[int, int, Tensor], Tensor | None],
    combine: Callable[[Tensor, Tensor], Tensor] = torch.add,
) -> Tensor | None:
    """Drive ``ring`` in the loop order of the module docstring.

    ``own`` is this rank's block (of shape ``ring.block(rank)``). ``compute(step, source,
    block)`` is called once per step, in step order, with the block of rank ``source``; it
    returns this rank's part of that block's accumulator (of shape ``ring.acc(source)``), or
    None (nothing to add; always None in a ring without accumulators). ``combine(arrived,
    part)`` adds a part to an accumulator that arrived (default: ``arrived + part``).

    Returns this rank's block's accumulator with every rank's part combined, in step order
    from this rank's own (None for a ring without accumulators)."""
    steps = ring.steps
    if steps == 1:
        part = compute(0, ring.source(0), own)
        if part is None and ring.acc is not None:
            return own.new_zeros(tuple(ring.acc(ring.source(0))))
        return part
    held = own
    moving: InFlight[Tensor] | None = _start(ring, -1, own, None)
    for step in range(steps):
        source = ring.source(step)
        part = compute(step, source, held)
        block = arrived = None
        if moving is not None:  # m(step - 1): the next block, and this block's accumulator
            block, arrived = _split(ring, step - 1, moving.wait()[0])
            moving = None
        acc = None
        if ring.acc is not None:
            if arrived is None:  # step 0: this rank's part is all there is so far
                acc = part if part is not None else own.new_zeros(tuple(ring.acc(source)))
            else:
                acc = arrived if part is None else combine(arrived, part)
        ahead = block if step + 2 < steps else None  # the receiver's block of step + 2
        if ahead is not None or acc is not None:
            moving = _start(ring, step, ahead, acc)
        if block is not None:
            held = block
    if moving is None:
        return None
    _, home = _split(ring, steps - 1, moving.wait()[0])
    return home
