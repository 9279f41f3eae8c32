"""What every test shares: seeded leaves, random cotangents and the named tolerances.

One module, not a package: it holds one idea, reproducible data and how close is close enough.
Test modules import from here and from their area's helpers (``tests/collectives/reference.py``
for the collectives' single-process ground truth, ``tests/rpc/_helpers.py`` for asking RPC
workers about their state), never from another test module.

Random data comes from a seeded ``torch.Generator``, never the global generator: a test's
numbers do not depend on what ran before it in the process. Cotangents are random, never
ones: with ``out.sum().backward()`` every gathered block gets the same cotangent, and a
backward that sends slices to the wrong rank still passes.

Each tolerance is named for its reason. A test that needs a tolerance of its own writes it
next to the assertion, with a comment saying why.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Final, TypedDict

import torch
from torch import Tensor

from distgrad._exchange.group import first_row, own_rows

__all__ = [
    "COMPILED",
    "EXACT",
    "FLOAT32",
    "FLOAT64",
    "FLOAT64_ABSOLUTE",
    "FLOAT64_ROUNDING",
    "TORCH_FLOAT32",
    "TORCH_FLOAT64",
    "Tolerance",
    "cotangent",
    "cotangents",
    "leaf",
    "leaves",
    "seeded",
    "sparse_leaf",
]


class Tolerance(TypedDict):
    """``torch.testing.assert_close``'s two tolerances: pass one as ``**tol``."""

    rtol: float
    atol: float


# float64 against a single-process reference that sums in another order (a reduction's tree,
# where a gathered block sits, a blockwise logsumexp, a reduction over ranks): rounding stays
# near 1e-15 relative, a wrong gradient is off by O(1).
FLOAT64: Final[Tolerance] = {"rtol": 1e-10, "atol": 1e-12}
# float32, for the same reason (its rounding is about 1e-7 relative).
FLOAT32: Final[Tolerance] = {"rtol": 1e-5, "atol": 1e-6}
# float64 where both sides do the same arithmetic on the same numbers but for the order of a
# sum over a few ranks (the README's example, one DDP step, Megatron's regions): rounding only.
FLOAT64_ROUNDING: Final[Tolerance] = {"rtol": 1e-12, "atol": 1e-12}
# float64, absolute only: the model-parallel patterns (docs/patterns.md states this bound and
# the largest deviation measured against it, 7.1e-15; another summation order costs ~1e-15).
FLOAT64_ABSOLUTE: Final[Tolerance] = {"rtol": 0.0, "atol": 1e-10}
# Compiled against eager, float64: the compiler fuses and reorders arithmetic.
COMPILED: Final[Tolerance] = {"rtol": 1e-9, "atol": 1e-9}
# torch's own float64 defaults, stated once: RPC autograd against local autograd, which run
# the same ops in the same order on each worker and so agree to rounding.
TORCH_FLOAT64: Final[Tolerance] = {"rtol": 1e-7, "atol": 1e-7}
# torch's own float32 defaults (dtype conversions over RPC).
TORCH_FLOAT32: Final[Tolerance] = {"rtol": 1.3e-6, "atol": 1e-5}
# Bit for bit: the same computation on the same numbers in the same order.
EXACT: Final[Tolerance] = {"rtol": 0.0, "atol": 0.0}


def seeded(seed: int) -> torch.Generator:
    """A CPU generator seeded with ``seed``."""
    return torch.Generator().manual_seed(seed)


def leaf(
    seed: int, *shape: int, requires_grad: bool = True, dtype: torch.dtype = torch.float64
) -> Tensor:
    """A leaf tensor of ``shape`` with values from generator ``seed``."""
    t = torch.randn(*shape, dtype=dtype, generator=seeded(seed))
    return t.requires_grad_(requires_grad)


def leaves(seed: int, shapes: Sequence[tuple[int, ...]], grad: Sequence[bool]) -> list[Tensor]:
    """float64 leaves of ``shapes``, drawn in order from one generator ``seed``;
    ``grad[i]``: whether leaf ``i`` requires grad."""
    g = seeded(seed)
    return [
        torch.randn(*s, dtype=torch.float64, generator=g).requires_grad_(r)
        for s, r in zip(shapes, grad, strict=True)
    ]


def sparse_leaf(
    seed: int, requires_grad: bool = True, dtype: torch.dtype = torch.float64
) -> Tensor:
    """A 4x4 sparse COO leaf with 3 seeded values (uncoalesced: indices repeat once)."""
    indices = torch.tensor([[0, 1, 1, 0], [2, 0, 2, 2]])
    values = torch.randn(4, dtype=dtype, generator=seeded(seed))
    t = torch.sparse_coo_tensor(indices, values, (4, 4), dtype=dtype, check_invariants=True)
    return t.requires_grad_(requires_grad)


def cotangent(seed: int, like: Tensor) -> Tensor:
    """A random cotangent shaped like ``like``, from generator ``seed`` (never ones: a wrong
    route must show)."""
    return torch.randn(like.shape, dtype=like.dtype, generator=seeded(seed))


def cotangents(seed: int, outs: Sequence[Tensor]) -> list[Tensor]:
    """A random cotangent for each of ``outs``, drawn in order from one generator ``seed``."""
    g = seeded(seed)
    return [torch.randn(o.shape, dtype=o.dtype, generator=g) for o in outs]


def rows_of(t: Tensor, sizes: Sequence[int], rank: int) -> Tensor:
    """Rank ``rank``'s rows of a global batch ``t`` when rank r holds ``sizes[r]`` rows.

    Written with the rank as data (``first_row``, ``own_rows``: arithmetic, no index), so a
    rank body runs unchanged on processes and simulated (``run_on_ranks(simulate=True)``,
    where ``rank`` is one per-rank value and each rank gets its own rows)."""
    return t.narrow(0, first_row(sizes, rank), own_rows(sizes, rank))
