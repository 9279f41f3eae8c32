"""TorchScript functions the RPC tests call remotely (their own module: scripting at import)."""

from __future__ import annotations

import torch


@torch.jit.script
def script_add(t1: torch.Tensor, t2: torch.Tensor) -> torch.Tensor:
    return torch.add(t1, t2)


@torch.jit.script
def script_mul_sum(t1: torch.Tensor, t2: torch.Tensor) -> torch.Tensor:
    return (t1 * t2).sum(0)
