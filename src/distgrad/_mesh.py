"""Groups from device meshes, and DTensors refused at the door.

Every ``group=`` in distgrad accepts what ``torch.distributed._functional_collectives`` accepts
of a mesh: a ``ProcessGroup``; a 1-D ``DeviceMesh`` (``mesh["tp"]``); a pair ``(mesh, dim)``
whose dim is an index or one of ``mesh.mesh_dim_names``; or ``None`` (the default group).
:func:`process_group` turns a mesh form into the ``ProcessGroup`` of this rank's slice of the
mesh along that dim, the group ``mesh.get_group(dim)`` returns; ``distgrad._exchange.group.resolve``
calls it for anything that is not a ``ProcessGroup``, so a process group costs nothing more.

A DTensor passed where distgrad communicates a tensor is refused (:func:`dtensor_problem`)
with a message that says what to call: distgrad's ops communicate plain tensors under the sum
contract (docs/semantics.md), and whether a DTensor means its local shard or its whole value
is the caller's to say, with ``.to_local()`` or ``.full_tensor()``.
"""

from __future__ import annotations

from typing import TypeAlias

import torch.distributed as dist
from torch import Tensor

from distgrad.errors import CollectiveArgumentError

__all__ = ["GroupLike", "dtensor_problem", "process_group", "refuse_dtensors"]

if dist.is_available():
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor import DTensor
else:  # pragma: no cover - torch built without distributed: no mesh can exist

    class DeviceMesh:  # type: ignore[no-redef]
        ndim: int

    class DTensor(Tensor):  # type: ignore[no-redef]
        pass


GroupLike: TypeAlias = "dist.ProcessGroup | DeviceMesh | tuple[DeviceMesh, int | str] | None"
"""What every ``group=`` accepts: the type in the public signatures of the collectives, the
losses and the parallel patterns (``None`` is the default group)."""

ACCEPTED = (
    "a torch.distributed ProcessGroup or None, or a DeviceMesh: a 1-D mesh (mesh['tp']) or a "
    "pair (mesh, dim) whose dim is an index or a name of mesh.mesh_dim_names"
)


def process_group(group: object, op: str) -> dist.ProcessGroup:
    """The ``ProcessGroup`` that ``group``, a 1-D mesh or a ``(mesh, dim)`` pair, stands for on
    this rank; a :class:`CollectiveArgumentError` naming ``op``, what was passed and every
    accepted form for anything else."""
    if isinstance(group, DeviceMesh):
        if group.ndim != 1:
            raise CollectiveArgumentError(
                f"{op}: group is a {group.ndim}-D DeviceMesh {_shape(group)}; a collective runs "
                f"over one of its dims: pass {_dim_hint(group)}"
            )
        return _member_group(group, 0, op)
    if isinstance(group, tuple) and len(group) == 2 and isinstance(group[0], DeviceMesh):
        mesh, dim = group
        return _member_group(mesh, _dim_index(mesh, dim, op), op)
    raise CollectiveArgumentError(_not_a_group(group, op))


def _dim_index(mesh: DeviceMesh, dim: object, op: str) -> int:
    names = tuple(mesh.mesh_dim_names or ())
    if isinstance(dim, str):
        if dim in names:
            return names.index(dim)
        raise CollectiveArgumentError(
            f"{op}: group=(mesh, {dim!r}) names no dim of the mesh {_shape(mesh)}; its dims "
            f"are {_dims(mesh)}"
        )
    if isinstance(dim, int) and not isinstance(dim, bool) and -mesh.ndim <= dim < mesh.ndim:
        return dim % mesh.ndim
    raise CollectiveArgumentError(
        f"{op}: group=(mesh, dim) needs dim an index in [{-mesh.ndim}, {mesh.ndim}) or a name "
        f"of the mesh's dims {_dims(mesh)}, got {dim!r}"
    )


def _member_group(mesh: DeviceMesh, dim: int, op: str) -> dist.ProcessGroup:
    if mesh.get_coordinate() is None:
        raise CollectiveArgumentError(
            f"{op}: this process (global rank {dist.get_rank()}) is not in the DeviceMesh "
            f"{_shape(mesh)} it passed as group; every rank that calls a collective must belong "
            "to its group"
        )
    found = mesh.get_group(dim)
    assert isinstance(found, dist.ProcessGroup), type(found)
    return found


def _shape(mesh: DeviceMesh) -> str:
    return f"of shape {tuple(mesh.shape)}" + (
        f" and dims {tuple(mesh.mesh_dim_names)}" if mesh.mesh_dim_names else ""
    )


def _dims(mesh: DeviceMesh) -> str:
    names = mesh.mesh_dim_names
    return f"{list(names)} (or 0 to {mesh.ndim - 1})" if names else f"0 to {mesh.ndim - 1}"


def _dim_hint(mesh: DeviceMesh) -> str:
    names = mesh.mesh_dim_names
    if names:
        return f"mesh[{names[-1]!r}] or (mesh, {names[-1]!r}) (its dims: {list(names)})"
    return f"(mesh, dim) with dim 0 to {mesh.ndim - 1}"


def _not_a_group(group: object, op: str) -> str:
    shown = f"{type(group).__name__} {group!r}"
    hint = ""
    if isinstance(group, int):
        hint = (
            f"; group is {op}'s second positional argument (as in torch.distributed): to pick a "
            f"dim, pass dim={group}"
        )
    elif isinstance(group, list | tuple):
        hint = f"; make a group of these ranks with torch.distributed.new_group({list(group)!r})"
    return f"{op}: group must be {ACCEPTED}; got {shown}{hint}"


def dtensor_problem(x: object, name: str = "x") -> str | None:
    """The complaint about ``x`` if it is a DTensor (what to call instead), else None."""
    if not isinstance(x, DTensor):
        return None
    placements = ", ".join(repr(p) for p in x.placements)
    return (
        f"{name} must be a plain torch.Tensor, got a DTensor (placements [{placements}] on a "
        f"mesh {_shape(x.device_mesh)}): distgrad communicates plain tensors; pass "
        f"{name}.to_local() to communicate this rank's shard (and DTensor.from_local to wrap the "
        f"result), or {name}.full_tensor() for the whole tensor on every rank"
    )


def refuse_dtensors(op: str, **tensors: object) -> None:
    """Raise :class:`CollectiveArgumentError` for the first DTensor among ``tensors``, on the
    rank that passed it, before any communication."""
    for name, x in tensors.items():
        problem = dtensor_problem(x, name)
        if problem is not None:
            raise CollectiveArgumentError(f"{op} on rank {_rank()}: {problem}")


def _rank() -> int:
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
