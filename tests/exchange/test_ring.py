"""The one ring driver (``distgrad._exchange.ring.run``), on real gloo ranks.

Semantics asserted: on W ranks, rank r's ``compute`` is called once per step t with the block
of rank ``(r - t) mod W``, exactly as that rank made it (uneven shapes, an empty block); the
accumulator that comes home to rank j is every rank's part of block j combined in ring order
from rank j (checked against the same parts combined in one process, with a combine that is
not commutative, so the order is checked too). And the loop order: every compute but the last
runs while an exchange is in flight (started before the compute, waited for after it), as
recorded by a wrapper around the declared ``shift.start`` that calls through to it.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import Tensor

from distgrad._exchange import ring as ring_module
from distgrad._exchange.group import resolve
from distgrad._exchange.ring import Ring, run
from distgrad.testing import run_on_ranks
from tests._support import FLOAT64, seeded

SIZES = {1: [3], 2: [3, 1], 3: [2, 0, 4], 4: [1, 3, 2, 2]}


def _block(owner: int, sizes: list[int]) -> Tensor:
    return torch.randn(sizes[owner], 2, 3, generator=seeded(owner), dtype=torch.float64)


def _part(rank: int, owner: int, sizes: list[int]) -> Tensor:
    """Rank ``rank``'s part of block ``owner``'s accumulator, [S_owner, 5]."""
    return torch.randn(sizes[owner], 5, generator=seeded(100 * rank + owner), dtype=torch.float64)


def _combine(arrived: Tensor, part: Tensor) -> Tensor:
    return 0.5 * arrived + part  # not commutative: the order the parts come in shows


def _driven(rank: int, world: int, with_acc: bool) -> dict[str, Any]:
    sizes = SIZES[world]
    events: list[tuple[str, int]] = []
    real = ring_module.shift

    class Logged:
        def __init__(self, inner: Any, number: int) -> None:
            self.inner, self.number = inner, number

        def wait(self) -> Any:
            events.append(("wait", self.number))
            return self.inner.wait()

    started = 0

    def logged_start(*args: Any, **kwargs: Any) -> Logged:
        nonlocal started
        events.append(("start", started))
        started += 1
        return Logged(real.start(*args, **kwargs), started - 1)

    class Shift:  # the declared exchange, its starts and waits recorded
        start = staticmethod(logged_start)

    seen: list[tuple[int, int, Tensor]] = []

    def compute(step: int, source: int, block: Tensor) -> Tensor | None:
        events.append(("compute", step))
        seen.append((step, source, block.clone()))
        return _part(rank, source, sizes) if with_acc else None

    ring = Ring(
        resolve(None),
        lambda j: (sizes[j], 2, 3),
        (lambda j: (sizes[j], 5)) if with_acc else None,
    )
    ring_module.shift = Shift  # type: ignore[assignment]
    try:
        home = run(ring, _block(rank, sizes), compute, _combine)
    finally:
        ring_module.shift = real
    return {"seen": seen, "home": home, "events": events}


@pytest.mark.parametrize("world", [1, 2, 3, 4])
@pytest.mark.parametrize("with_acc", [False, True], ids=["blocks", "accumulators"])
def test_every_rank_computes_every_block_once_and_each_accumulator_comes_home(
    world: int, with_acc: bool
) -> None:
    sizes = SIZES[world]
    for rank, got in enumerate(run_on_ranks(_driven, world, args=(with_acc,), timeout=60)):
        assert [(step, source) for step, source, _ in got["seen"]] == [
            (t, (rank - t) % world) for t in range(world)
        ]
        for _, source, block in got["seen"]:
            torch.testing.assert_close(block, _block(source, sizes), **FLOAT64)
        if not with_acc:
            assert got["home"] is None
            continue
        # Block ``rank``'s parts in ring order: its own rank first, then rank + 1, ...
        want = _part(rank, rank, sizes)
        for later in range(1, world):
            want = _combine(want, _part((rank + later) % world, rank, sizes))
        torch.testing.assert_close(got["home"], want, **FLOAT64)


@pytest.mark.parametrize("world", [2, 3, 4])
@pytest.mark.parametrize("with_acc", [False, True], ids=["blocks", "accumulators"])
def test_each_compute_runs_with_an_exchange_in_flight(world: int, with_acc: bool) -> None:
    """Before every compute but the last of a ring without accumulators (whose last block has
    nothing left to send), an exchange has been started and not yet waited for; with
    accumulators, before every compute. Messages: W - 1, or W + 1 with accumulators."""
    for got in run_on_ranks(_driven, world, args=(with_acc,), timeout=60):
        events = got["events"]
        starts = [n for kind, n in events if kind == "start"]
        assert len(starts) == (world + 1 if with_acc else world - 1), events
        in_flight: set[int] = set()
        for kind, n in events:
            if kind == "start":
                in_flight.add(n)
            elif kind == "wait":
                in_flight.remove(n)
            elif with_acc or n < world - 1:
                assert len(in_flight) == 1, (n, events)
        assert not in_flight, events
