"""distgrad in a DeviceMesh program: a 2x2 mesh (dp=2 x tp=2) on 4 local CPU ranks.

* FSDP2's ``fully_shard`` over "dp" shards every parameter and averages gradients over it;
* ``dg.parallel``'s column and row parallel linears split the encoder over "tp" (Megatron's
  replicated contract: both TP ranks compute the same loss, counted once);
* ``clip_loss`` over "dp" contrasts every image with every text of the global batch.

``group=`` takes the mesh forms directly: ``(mesh, "tp")``, ``mesh["dp"]``. The script checks
three SGD steps against the same model trained in one float64 process on the whole batch,
every parameter's gradient and updated value, with ``dg.testing.check_parallel_model``, and
prints its report. Run: ``python examples/mesh_2d.py`` (about 10 s on 2 cores).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.distributed.fsdp import fully_shard

import distgrad as dg
from distgrad import parallel as P

DT = torch.float64
D_IN, HIDDEN, D_OUT, BATCH = 6, 8, 4, 8


class Encoder(nn.Module):
    """The plain model: one MLP embeds images and texts alike."""

    def __init__(self) -> None:
        super().__init__()
        gen = torch.Generator().manual_seed(0)
        self.fc1 = nn.Linear(D_IN, HIDDEN, dtype=DT)
        self.fc2 = nn.Linear(HIDDEN, D_OUT, dtype=DT)
        with torch.no_grad():
            for p in self.parameters():
                p.copy_(torch.randn(p.shape, dtype=DT, generator=gen) * 0.5)

    def forward(self, x: Tensor) -> Tensor:
        return self.fc2(F.gelu(self.fc1(x)))


def make_model() -> nn.Module:
    return Encoder()


def parallelize(model: nn.Module, mesh: Any) -> nn.Module:
    """Tensor parallel over "tp" (same parameter names), then FSDP2 over "dp"."""
    assert isinstance(model, Encoder)
    tp = (mesh, "tp")
    model.fc1 = P.ColumnParallelLinear.from_linear(model.fc1, tp, objective="replicated")  # type: ignore[assignment]
    model.fc2 = P.RowParallelLinear.from_linear(model.fc2, tp, objective="replicated")  # type: ignore[assignment]
    fully_shard(model, mesh=mesh["dp"])
    return model


def make_batch() -> tuple[Tensor, Tensor]:
    gen = torch.Generator().manual_seed(1)
    return (
        torch.randn(BATCH, D_IN, dtype=DT, generator=gen),
        torch.randn(BATCH, D_IN, dtype=DT, generator=gen),
    )


def loss_fn(model: nn.Module, image: Tensor, text: Tensor, mesh: Any = None) -> Tensor:
    """CLIP's loss over the global batch: ``mesh`` is None in the one-process reference.
    (The ``(mesh, "dp")`` form rather than ``mesh["dp"]``: a submesh made inside a function
    compiled with inductor is a node inductor cannot lower, in torch 2.13.)"""
    group = None if mesh is None else (mesh, "dp")
    return dg.losses.clip_loss(model(image), model(text), group=group)


def check(steps: int = 3) -> dg.testing.ModelReport:
    return dg.testing.check_parallel_model(
        make_model,
        parallelize,
        make_batch(),
        loss_fn,
        world_size=4,
        mesh_shape=(2, 2),
        mesh_dim_names=("dp", "tp"),
        data=("dp",),
        steps=steps,
    )


if __name__ == "__main__":
    report = check()
    print(report)
    report.raise_if_mismatch()
