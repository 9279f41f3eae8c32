"""Every ``group=`` takes the forms funcol takes of a mesh, and a DTensor is refused at the door.

Semantics asserted, on a 2x2 mesh ("dp", "tp") over 4 gloo ranks (one run, every form): a 1-D
mesh (``mesh["tp"]``), ``(mesh, "tp")``, ``(mesh, 1)``, ``(mesh, -1)`` and
``mesh.get_group("tp")`` name the same group, for a collective, a loss, a dg.parallel function
and a module's constructor; the dp forms likewise. Any other form raises
CollectiveArgumentError naming the op, what was passed and every accepted form. A DTensor
passed to a collective or a pattern raises CollectiveArgumentError saying to call
``.to_local()`` or ``.full_tensor()``, not torch's dispatch error.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Shard

import distgrad as dg
from distgrad import parallel as P
from distgrad.errors import CollectiveArgumentError
from distgrad.losses import clip_loss
from distgrad.testing import run_on_ranks
from tests._support import seeded

DT = torch.float64


def _raises(fn: Any, *patterns: str) -> None:
    with pytest.raises(CollectiveArgumentError) as info:
        fn()
    for pattern in patterns:
        assert info.match(pattern), (pattern, str(info.value))


def _every_form_on_a_2x2_mesh(rank: int, n: int) -> None:
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    x = torch.tensor([float(rank)], dtype=DT)
    peers = {"dp": [rank % 2, rank % 2 + 2], "tp": [rank - rank % 2, rank - rank % 2 + 1]}
    for name, index in (("dp", 0), ("tp", 1)):
        forms = [mesh[name], (mesh, name), (mesh, index), (mesh, index - 2), mesh.get_group(name)]
        for form in forms:
            got = dg.all_gather(x, group=form)  # type: ignore[arg-type]
            assert got.tolist() == peers[name], (name, form, got)
        # A loss: the same value whichever form names the group.
        gen = seeded(rank // 2 if name == "tp" else rank % 2)
        image, text = (torch.randn(3, 4, dtype=DT, generator=gen) for _ in range(2))
        losses = {float(clip_loss(image, text, group=form)) for form in forms}  # type: ignore[arg-type]
        assert len(losses) == 1, (name, losses)
    # dg.parallel: a function, a module's constructor, SyncBatchNorm's process_group.
    tp = (mesh, "tp")
    layer = P.ColumnParallelLinear(4, 6, group=tp, dtype=DT)
    assert layer.splits == [3, 3] and layer.weight.shape == (3, 4)
    assert dist.get_process_group_ranks(layer.group) == peers["tp"]
    h = P.gather_from_sequence(x, group=mesh["tp"])
    assert h.tolist() == peers["tp"]
    bn = P.SyncBatchNorm(2, process_group=(mesh, 0), dtype=DT)
    bn(torch.full((2, 2), float(rank), dtype=DT))
    want = (peers["dp"][0] + peers["dp"][1]) / 2 * 0.1  # momentum 0.1 from zeros
    assert torch.allclose(bn.running_mean, torch.full((2,), want, dtype=DT))
    # What is refused, and how.
    _raises(
        lambda: dg.all_gather(x, group=mesh),  # type: ignore[arg-type]
        r"all_gather: group is a 2-D DeviceMesh",
        r"mesh\['tp'\] or \(mesh, 'tp'\)",
    )
    _raises(
        lambda: dg.all_gather(x, group=(mesh, "pp")),  # type: ignore[arg-type]
        r"group=\(mesh, 'pp'\) names no dim of the mesh of shape \(2, 2\)",
        r"\['dp', 'tp'\]",
    )
    _raises(
        lambda: P.route(torch.zeros(2, 4, dtype=DT), 1, group=(mesh, 2)),  # type: ignore[arg-type]
        r"route: group=\(mesh, dim\) needs dim an index in \[-2, 2\)",
    )
    _raises(
        lambda: dg.all_reduce(x, group="tp"),  # type: ignore[arg-type]
        r"all_reduce: group must be a torch\.distributed ProcessGroup or None, or a DeviceMesh: "
        r"a 1-D mesh \(mesh\['tp'\]\) or a pair \(mesh, dim\)",
        r"got str 'tp'",
    )
    # DTensor at the door: a collective and a pattern say what to call.
    sharded = DTensor.from_local(x, mesh["tp"], [Shard(0)])
    to_call = (r"x\.to_local\(\) to communicate this rank's shard", r"x\.full_tensor\(\)")
    _raises(
        lambda: dg.all_gather(sharded, group=mesh["tp"]),
        r"all_gather\(dim=0\) on rank \d: .*x must be a plain torch\.Tensor, got a DTensor "
        r"\(placements \[Shard\(dim=0\)\]",
        *to_call,
    )
    _raises(
        lambda: P.column_parallel_linear(sharded, layer.weight, group=tp),
        r"column_parallel_linear on rank \d: x must be a plain torch\.Tensor, got a DTensor",
        *to_call,
    )


def test_every_group_form_on_a_2x2_mesh_and_dtensors_refused() -> None:
    run_on_ranks(_every_form_on_a_2x2_mesh, 4, timeout=120)


def test_a_wrong_group_names_every_accepted_form_without_a_process_group() -> None:
    """One process: the error is raised before anything needs a process group."""
    _raises(
        lambda: dg.all_gather(torch.ones(2), group=[0, 1]),  # type: ignore[arg-type]
        r"a 1-D mesh \(mesh\['tp'\]\) or a pair \(mesh, dim\) whose dim is an index or a name",
        r"torch\.distributed\.new_group\(\[0, 1\]\)",
    )
