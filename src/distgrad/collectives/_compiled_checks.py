"""A call's checks inside ``torch.compile``: run once, as a constant of the graph.

While a step is traced, each call's checks run once, outside the trace, and their result is a
constant of the graph (``torch._dynamo.assume_constant_result``). Traced instead, the fields,
the signature and the group left about 140 guard lines for dynamo to check before every run of
the step, half of a compiled all_reduce's. What the checks read is what makes the key of the
lean path (the group, the arguments, the tensors' type, shape, dtype, device and
requires_grad, grad mode): the constant's inputs, so a change to any of them traces anew. A
call whose arguments are not plain data or plain tensors (a DeviceMesh, a ReduceOp, symbolic
sizes) is checked traced (:meth:`Signature.bind <distgrad.collectives._signature.Signature.bind>`).

Nothing is exchanged inside a graph: a call whose output shape depends on its peers' sizes
breaks the graph (:func:`break_for_sizes`) or takes them to be alike and checks that on the
device (:func:`assume_alike`).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, Protocol

import torch
import torch.distributed as dist
from torch import Tensor
from torch.nn import Parameter

from distgrad._exchange import ops
from distgrad._exchange.backend import metadata_device
from distgrad._exchange.group import Group, resolve
from distgrad.errors import CollectiveArgumentError

__all__ = ["assume_alike", "bound_constant", "break_for_sizes", "register"]

# Every Signature by its op's name: the constant's inputs are plain data, not objects.
_SIGNATURES: dict[str, Declared] = {}
_CONSTANT_TYPES = (int, str, bool, float, type(None), torch.dtype, torch.device)

# A tensor as the constant's inputs carry it: (shape, dtype, device, requires_grad).
TensorMeta = tuple[tuple[int, ...], torch.dtype, torch.device, bool]
Checked = tuple[str, tuple[tuple[str, Any], ...], str | None]


class Declared(Protocol):
    """What a traced call's checks read of a signature."""

    @property
    def op(self) -> str: ...
    @property
    def known_by(self) -> str: ...
    def describe(self, passed: Mapping[str, Any]) -> str: ...
    def check_alone(self, group: Group, x: object, passed: dict[str, Any]) -> Checked | None: ...


def register(signature: Declared) -> None:
    """Let a traced call's constant checks find ``signature`` by its op's name."""
    _SIGNATURES[signature.op] = signature


def bound_constant(
    signature: Declared, group: object, x: object, passed: dict[str, Any]
) -> tuple[Group, str, dict[str, Any]] | None:
    """A traced call's group, description and checked values, from its checks run once as a
    constant; None where the call is not made of constants (then ``bind`` traces its checks)."""
    if group is not None and not isinstance(group, dist.ProcessGroup):
        return None
    if x is None:
        meta = None
    else:
        meta = _tensor_meta(x)
        if meta is None:
            return None
    items = []
    for name, value in passed.items():
        if isinstance(value, Tensor):
            tensor = _tensor_meta(value)
            if tensor is None:
                return None
            items.append((name, True, tensor))
            continue
        if type(value) in (list, tuple):
            if not all(type(v) in _CONSTANT_TYPES for v in value):
                return None
            value = tuple(value)
        elif type(value) not in _CONSTANT_TYPES:
            return None
        items.append((name, False, value))
    grad_mode = torch.is_grad_enabled()
    checked = _checked_once(signature.op, group, meta, tuple(items), grad_mode)
    if checked is None:  # its output's shape depends on its peers'
        break_for_sizes(signature.describe(passed), signature.known_by)
    desc, values, problem = checked
    if problem is not None:  # raised here, in the trace, as the eager call raises it
        raise CollectiveArgumentError(problem)
    # The group is resolved in the trace (itself a constant of the graph, guarded on the
    # process group passed): a ProcessGroup first seen inside a constant's result would have
    # no source dynamo can guard, and a later use of it in the step could not be traced.
    return resolve(group, signature.op), desc, dict(values)


def _tensor_meta(x: object) -> TensorMeta | None:
    if type(x) is not Tensor and type(x) is not Parameter:  # a layer's weight: as a tensor
        return None
    assert isinstance(x, Tensor)
    if not all(type(d) is int for d in x.shape):
        return None
    return tuple(x.shape), x.dtype, x.device, x.requires_grad


def _stand_in(meta: TensorMeta) -> Tensor:
    """A tensor with ``meta``'s shape, dtype, device and requires_grad (one element)."""
    shape, dtype, device, requires_grad = meta
    x = torch.empty(1, dtype=dtype, device=device, requires_grad=requires_grad)
    return x.expand(shape) if shape else x.view(())


def _check_alone(
    op: str,
    group: object,
    meta: TensorMeta | None,
    items: tuple[tuple[str, bool, Any], ...],
    grad_mode: bool,
) -> Checked | None:
    """A traced call's checks, on this rank alone, run outside the trace: its description,
    its checked values and its problem (the message to raise); None where its output's shape
    depends on its peers'."""
    signature = _SIGNATURES[op]
    passed = {name: _stand_in(v) if tensor else v for name, tensor, v in items}
    x = None if meta is None else _stand_in(meta)
    with torch.set_grad_enabled(grad_mode):
        return signature.check_alone(resolve(group, op), x, passed)


_checked_once = torch._dynamo.assume_constant_result(_check_alone)  # type: ignore[no-untyped-call]


def break_for_sizes(desc: str, known_by: str) -> None:
    """Inside ``torch.compile``, a call whose output shape depends on its peers' sizes cannot
    be traced: break the graph there (``fullgraph=True`` raises this message; otherwise the
    exchange runs outside the graph)."""
    torch._dynamo.graph_break(
        msg=f"distgrad {desc}: the output's shape depends on the other ranks' sizes, which "
        f"torch.compile cannot learn without a host synchronisation; pass {known_by}"
    )


def assume_alike(desc: str, group: Group, values: Sequence[int], known_by: str) -> None:
    """Inside ``torch.compile``, where sizes not given cannot be learned (an output's shape
    cannot depend on data), take every rank's ``values`` (its extent along dim, its shape) to
    be this rank's, and check it on the device: one all_gather of a few int64 and an
    asynchronous assertion, no host synchronisation. A rank whose values differ fails the
    assertion, saying to pass ``known_by``."""
    mine = torch.tensor(list(values), dtype=torch.int64, device=metadata_device(group))
    every = ops.all_gather(mine, [len(values)] * group.size, group=group)
    torch._assert_async(
        (every.view(group.size, len(values)) == mine).all(),
        f"distgrad {desc}: inside torch.compile, a call without {known_by} takes every rank's "
        f"sizes to be alike, and they are not; pass {known_by}",
    )
