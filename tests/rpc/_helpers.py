"""What RPC tests share beyond tests/_support.py (seeded leaves, cotangents, tolerances):
comparing dense or sparse gradients, and asking workers about their state.

Test modules import these (never each other). Remote functions live in ``_funcs`` (module
level, so they pickle).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor
from torch.distributed import rpc as torch_rpc

from distgrad.rpc import _identity
from distgrad.rpc._release import wait_for_releases
from tests._support import TORCH_FLOAT64
from tests.rpc import _funcs

MODES = ("fast", "smart")


def dense(t: Tensor | None) -> Tensor | None:
    return None if t is None else (t.to_dense() if t.is_sparse else t)


def assert_close(got: Tensor | None, want: Tensor | None, what: str, **tol: float) -> None:
    """``got`` equals ``want`` (dense or sparse) within the stated tolerance (default:
    ``TORCH_FLOAT64``)."""
    assert (got is None) == (want is None), f"{what}: got {got}, want {want}"
    if got is not None and want is not None:
        assert got.is_sparse == want.is_sparse, f"{what}: layouts {got.layout} vs {want.layout}"
        rtol = tol.get("rtol", TORCH_FLOAT64["rtol"])
        atol = tol.get("atol", TORCH_FLOAT64["atol"])
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
