"""examples/mesh_2d.py's training step compiled with inductor equals the eager step.

Semantics asserted: on a 2x2 DeviceMesh (4 gloo ranks, float64), FSDP2 over "dp" (its
all-gathers and reduce-scatters), ``dg.parallel``'s column and row linears over "tp" and
``clip_loss`` over "dp" (distgrad's exchanges), the loss compiled with inductor and the same
loss run eagerly, each training its own copy of the model with SGD from the same start for 3
steps: every step's loss and every parameter after each step agree to rounding
(``COMPILED``: the compiler reorders arithmetic). FSDP2's hooks run outside the graph (dynamo
skips them by default), so the compiled graph holds distgrad's exchanges and the model's
compute; the FSDP2 collectives around it are torch's own.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.distributed.device_mesh import init_device_mesh

from distgrad.testing import run_on_ranks
from tests._support import COMPILED

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


def _trained(rank: int, n: int, steps: int) -> list[float]:
    sys.path.insert(0, str(EXAMPLES))
    import mesh_2d  # the example itself: its model, its parallelize, its loss

    torch._inductor.config.compile_threads = 1
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    image, text = mesh_2d.make_batch()
    share = len(image) // 2
    rows = slice(mesh["dp"].get_local_rank() * share, (mesh["dp"].get_local_rank() + 1) * share)
    image, text = image[rows], text[rows]
    models = [mesh_2d.parallelize(mesh_2d.make_model(), mesh) for _ in range(2)]
    losses: list[Any] = [mesh_2d.loss_fn, torch.compile(mesh_2d.loss_fn, backend="inductor")]
    optimizers = [torch.optim.SGD(m.parameters(), lr=0.5) for m in models]
    found = []
    for _ in range(steps):
        values = []
        for model, loss_fn, optimizer in zip(models, losses, optimizers, strict=True):
            loss = loss_fn(model, image, text, mesh)
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            values.append(loss.detach())
        torch.testing.assert_close(values[1], values[0], **COMPILED)
        for (name, want), got in zip(
            models[0].named_parameters(), models[1].parameters(), strict=True
        ):
            torch.testing.assert_close(
                got.full_tensor(), want.full_tensor(), **COMPILED, msg=lambda m, n=name: f"{n}: {m}"
            )
        found.append(float(values[1]))
    return found


@pytest.mark.slow  # inductor on 4 ranks on 2 cores: about a minute
@pytest.mark.timeout(600)
def test_the_2d_mesh_training_step_compiled_with_inductor_equals_eager() -> None:
    losses = run_on_ranks(_trained, 4, args=(3,), timeout=500)
    assert all(len(set(per_rank)) == 3 for per_rank in losses), losses  # it trains
