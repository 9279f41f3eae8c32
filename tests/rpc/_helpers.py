"""Helpers every RPC test uses: seeded leaves, cotangents, tolerances, worker state queries.

Defined once here; test modules import them (never each other). Remote functions live in
``_funcs`` (module level, so they pickle).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import Tensor
from torch.distributed import rpc as torch_rpc

from distgrad.rpc import _identity
from distgrad.rpc._release import wait_for_releases
from tests.rpc import _funcs

MODES = ("fast", "smart")

# float64 everywhere: distributed and local autograd run the same ops in the same order on
# each worker, so they agree to rounding; these are torch's float64 defaults, stated once.
RTOL = 1e-7
ATOL = 1e-7
# float32 cases (dtype conversions over RPC): torch's float32 defaults.
RTOL32 = 1.3e-6
ATOL32 = 1e-5


def seeded(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def leaf(seed: int, *shape: int, requires_grad: bool = True, dtype: Any = torch.float64) -> Tensor:
    """A leaf tensor with values from a seeded generator."""
    t = torch.randn(*shape, dtype=dtype, generator=seeded(seed))
    return t.requires_grad_(requires_grad)


def leaves(seed: int, shapes: Sequence[tuple[int, ...]], grad: Sequence[bool]) -> list[Tensor]:
    g = seeded(seed)
    return [
        torch.randn(*s, dtype=torch.float64, generator=g).requires_grad_(r)
        for s, r in zip(shapes, grad, strict=True)
    ]


def cotangent(seed: int, like: Tensor) -> Tensor:
    """A random cotangent shaped like ``like`` (never ones: a wrong route must show)."""
    return torch.randn(like.shape, dtype=like.dtype, generator=seeded(seed))


def cotangents(seed: int, outs: Sequence[Tensor]) -> list[Tensor]:
    g = seeded(seed)
    return [torch.randn(o.shape, dtype=o.dtype, generator=g) for o in outs]


def sparse_leaf(seed: int, requires_grad: bool = True, dtype: Any = torch.float64) -> Tensor:
    """A 4x4 sparse COO leaf with 3 seeded values (uncoalesced: indices repeat once)."""
    indices = torch.tensor([[0, 1, 1, 0], [2, 0, 2, 2]])
    values = torch.randn(4, dtype=dtype, generator=seeded(seed))
    t = torch.sparse_coo_tensor(indices, values, (4, 4), dtype=dtype, check_invariants=True)
    return t.requires_grad_(requires_grad)


def dense(t: Tensor | None) -> Tensor | None:
    return None if t is None else (t.to_dense() if t.is_sparse else t)


def assert_close(got: Tensor | None, want: Tensor | None, what: str, **tol: float) -> None:
    """``got`` equals ``want`` (dense or sparse) within the stated tolerance."""
    assert (got is None) == (want is None), f"{what}: got {got}, want {want}"
    if got is not None and want is not None:
        assert got.is_sparse == want.is_sparse, f"{what}: layouts {got.layout} vs {want.layout}"
        rtol, atol = tol.get("rtol", RTOL), tol.get("atol", ATOL)
        torch.testing.assert_close(
            dense(got), dense(want), rtol=rtol, atol=atol, msg=lambda m: f"{what}: {m}"
        )


def query(worker: str, fn: Callable[..., Any], *args: Any) -> Any:
    """Call ``fn(*args)`` on ``worker`` with torch's RPC, outside any distgrad context (for
    inspecting workers from inside a context without joining them to it)."""
    previous = _identity.set_current(None)
    try:
        return torch_rpc.rpc_sync(worker, fn, args=args)
    finally:
        _identity.set_current(previous)


def states(world_size: int) -> list[dict[str, int]]:
    return [query(f"worker{w}", _funcs.state) for w in range(world_size)]


def no_state_left(world_size: int) -> None:
    """Every worker holds no context, pass, SMART state or record (after releases arrive)."""
    wait_for_releases()
    for w, state in enumerate(states(world_size)):
        for key in ("contexts", "passes_in_flight", "smart_passes", "sends", "recvs"):
            assert state[key] == 0, f"worker{w} still holds {state[key]} {key}: {state}"


def assert_equal(got: Tensor | None, want: Tensor | None, what: str) -> None:
    """``got`` equals ``want`` bit for bit (both ``None``, or same values, dtype and layout)."""
    assert (got is None) == (want is None), f"{what}: got {got}, want {want}"
    if got is not None and want is not None:
        assert torch.equal(dense(got), dense(want)), (  # type: ignore[arg-type]
            f"{what}: differs by up to {float((dense(got) - dense(want)).abs().max())}"  # type: ignore[operator]
        )
