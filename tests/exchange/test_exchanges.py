"""Each exchange's declared output (``distgrad._exchange.declare.Exchange.meta``, the shape of
its ``async_op=True`` result) is what its eager call returns, on every rank, for even and uneven
sizes and for the ranks off a root: shape, dtype and device. A declaration that drifted from its
steps would give an in-flight result the wrong shape while eager stayed right.

The traced form of each exchange (``Exchange.traced``: torch's functional collectives, what a
compiled graph runs) gives the eager steps' values too: run eagerly here, since torch's
functional collectives also run outside a graph. So does a started exchange
(``Exchange.start``, a ring's step in flight), waited for. Values equal to float64 rounding (a
sum over ranks may be added in another order by the backend's reduce-scatter)."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from distgrad._exchange import ops
from distgrad._exchange.group import resolve
from distgrad.testing import run_on_ranks
from tests._support import seeded


def _cases(rank: int, n: int) -> dict[str, tuple[Any, ...]]:
    """name -> (x, *args) for every exchange, with sizes that differ between ranks."""
    sizes = [r + 1 for r in range(n)]  # rank r has r + 1 rows
    x = torch.randn(sizes[rank], 3, generator=seeded(rank), dtype=torch.float64)
    whole = torch.randn(sum(sizes), 3, generator=seeded(10 + rank), dtype=torch.float64)
    to_first = [sizes[rank] if r == 0 else 0 for r in range(n)]
    from_all = [sizes[r] for r in range(n)] if rank == 0 else [0] * n
    ring = [(r + 1) % n for r in range(n)]
    after, before = (rank + 1) % n, (rank - 1) % n
    if n == 2:  # one block each way, of the sender's rows
        shift = (x[None], [after], [before], [sizes[before], 3])
    else:  # a block to each neighbour, the sources out of rank order on some ranks
        blocks = torch.randn(2, 2, 3, generator=seeded(20 + rank), dtype=torch.float64)
        shift = (blocks, [after, before], [before, after], [2, 3])
    return {
        "all_gather": (x, sizes),
        "reduce_scatter": (whole, sizes),
        "all_to_all": (x, to_first, from_all),
        "all_reduce": (whole, "max"),
        "broadcast": (whole, n - 1),
        "reduce": (whole, 0),
        "gather": (x, sizes, 0),
        "scatter": (whole if rank == 1 else None, sizes, 1, [3], torch.float64, x.device),
        "permute": (x, ring, [sizes[(rank - 1) % n], 3]),
        "shift": shift,
    }


def _compare(rank: int, n: int) -> list[str]:
    group = resolve(None)
    found = []
    cases = _cases(rank, n)
    assert set(cases) == {e.name for e in ops.EXCHANGES}  # every exchange has a case
    for exchange in ops.EXCHANGES:
        x, *args = cases[exchange.name]
        out = exchange(x, *args, group=group)
        shape, dtype, device = exchange.meta(x, *args, group=group)
        if (tuple(out.shape), out.dtype, out.device) != (tuple(shape), dtype, device):
            found.append(
                f"{exchange.name} on rank {rank}: eager {tuple(out.shape)} {out.dtype} "
                f"{out.device}, declared {tuple(shape)} {dtype} {device}"
            )
        traced = exchange._result(exchange.traced(x, *args, group=group), x)
        started = exchange._result(exchange.start(x, *args, group=group).wait(), x)
        for form, value in (("traced form", traced), ("started exchange", started)):
            try:
                torch.testing.assert_close(value, out, rtol=1e-15, atol=1e-15)
            except AssertionError as error:
                found.append(f"{exchange.name} on rank {rank}: {form} differs: {error}")
    # Complex data: the traced reductions sum the real and imaginary parts as the steps do.
    z = torch.randn(sum(r + 1 for r in range(n)), 3, dtype=torch.complex128, generator=seeded(rank))
    sizes = [r + 1 for r in range(n)]
    for exchange, args in ((ops.all_reduce, ("sum",)), (ops.reduce_scatter, (sizes,))):
        out = exchange(z, *args, group=group)
        traced = exchange.traced(z, *args, group=group)
        if not torch.allclose(traced, out, rtol=1e-15, atol=1e-15):
            found.append(f"{exchange.name} on rank {rank}: complex traced form differs")
    return found


@pytest.mark.parametrize("n", [2, 3])
def test_every_exchange_returns_its_declared_output_and_its_traced_form_agrees(n: int) -> None:
    for found in run_on_ranks(_compare, n):
        assert not found, "\n".join(found)
