"""Argument checks, declared once per op and read by one function.

Each op declares a :class:`Signature`: its arguments as typed fields (``distgrad.collectives.
_fields``: each gives its local check, its code across ranks and the words of its messages),
the integer lists it carries (``sizes``, ``perm``, ...), and how the ranks' tensor shapes must
relate. :meth:`Signature.bind` checks a call's arguments on this rank, names the call in every
message (``reduce(dst=0, op='sum')``), decides whether this call exchanges metadata, and if it
does, checks every rank's call against the declaration, so every op body is the few lines of
its work.

When a call exchanges metadata (``distgrad._exchange.handshake``):

* the first :data:`CHECKED_CALLS` calls on each group. Every rank counts its own calls, so the
  ranks agree on which calls these are without asking, and a mistake in the code (a shape, a
  dtype, an argument that differs between ranks) is the same clear error on every rank at
  start-up;
* every call in debug mode (:func:`distgrad.set_debug`, ``DISTGRAD_DEBUG=1`` or
  ``TORCH_DISTRIBUTED_DEBUG=DETAIL``);
* a call whose output shape this rank cannot compute from its own arguments (an uneven
  ``all_gather`` without ``sizes=``, ...): the sizes have to be exchanged anyway, and the same
  message checks the call for free.

Any other call sends nothing but its data and makes no host synchronisation: the ranks are
trusted to keep making the calls the checked ones made (same shapes, same arguments, inputs that
require grad on every rank or on none). Arguments a rank can check alone still raise at once on
that rank. Inside ``torch.compile`` nothing is exchanged or counted.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any, Literal, TypeVar

import torch
import torch.distributed as dist
from torch import Tensor

from distgrad._exchange import ops
from distgrad._exchange.backend import metadata_device
from distgrad._exchange.group import Group, on_forget, resolve
from distgrad._exchange.handshake import (
    RankCall,
    debug_enabled,
    dtype_name,
    dtype_problem,
    exchange,
    named,
    require_same,
    show,
)
from distgrad._exchange.wait import note_call
from distgrad._mesh import GroupLike, dtensor_problem
from distgrad.collectives._fields import Args, ListField, ScalarField
from distgrad.errors import CollectiveArgumentError, CollectiveMismatchError

__all__ = [
    "CHECKED_CALLS",
    "Bound",
    "Signature",
    "assume_alike",
    "break_for_sizes",
    "calls_so_far",
    "checks_this_call",
    "sizes_along",
    "sizes_from",
]

CHECKED_CALLS = 8
"""How many calls on each group are checked across ranks outside debug mode."""

# How many distgrad calls this process has made on each group, by the group's id and name (see
# distgrad._exchange.group). Every rank counts the same calls, so the counts name a call alike
# everywhere.
_calls: dict[tuple[int, str], int] = {}


def _forget_calls(groups: list[Group], world_gone: bool) -> None:
    for group in groups:
        _calls.pop(group.key, None)


on_forget(_forget_calls)


# The lean path's memory (Signature.bind): by call shape, what that call's checks made (its
# group, its description, its checked values). Why it is sound: every local check reads only
# the group, the op's arguments and the tensor's type, shape, dtype, device and requires_grad
# (with grad mode), which make the key; a call past the checked calls makes no check across
# ranks. Why it matters: the checks are about a third of an eager call's Python (measured:
# bind alone 4.4 us of a 32 KB all_reduce's 59 us forward on 2 gloo ranks). Forgotten with the
# groups (a destroyed group's calls must not come back), bounded by _LEAN_MAX.
_LEAN: dict[tuple[Any, ...], Bound] = {}
_LEAN_MAX = 4096
_is_compiling = torch.compiler.is_compiling


def _lean_key(signature: Signature, group: object, x: object, passed: dict[str, Any]) -> Any:
    """The call shape of a call, or None where ``x`` is not a plain tensor (a tensor subclass).
    (An argument that cannot be hashed makes a key that cannot be looked up: see bind.)"""
    if type(x) is not Tensor:
        return None
    assert isinstance(x, Tensor)
    values = tuple([tuple(v) if type(v) is list else v for v in passed.values()])
    return (
        id(signature),
        group,
        x.shape,
        x.dtype,
        x.device,
        x.requires_grad,
        torch.is_grad_enabled(),
        values,
    )


def _forget_lean(groups: list[Group], world_gone: bool) -> None:
    _LEAN.clear()


on_forget(_forget_lean)


def calls_so_far(group: Group) -> int:
    """How many checked-or-not distgrad calls this process has made on ``group``."""
    return _calls.get(group.key, 0)


def checks_this_call(group: Group, sizes_known: bool = True) -> bool:
    """Whether the next call on ``group`` exchanges metadata (see the module docstring).

    For checks that cost a host synchronisation (a tensor argument's value), which are made
    only on the calls that are checked across ranks anyway.
    """
    if torch.compiler.is_compiling() or group.size == 1:
        return False
    return debug_enabled() or not sizes_known or calls_so_far(group) < CHECKED_CALLS


def _next_call(group: Group) -> int:
    key = group.key
    count = _calls.get(key, 0)
    _calls[key] = count + 1
    return count


Shapes = Literal["equal", "except_dim", "free"]

# Every Signature by its op's name: a traced call's constant checks take names, not objects.
_SIGNATURES: dict[str, Signature] = {}
_T = TypeVar("_T")


@dataclass(slots=True)
class Bound:
    """A checked call: its group (marked with the call in debug mode), its description, every
    rank's call when it exchanged metadata, and each argument as its field made it
    (``bound["dim"]`` non-negative, ``bound["op"]`` a name, ``bound["sizes"]`` split)."""

    group: Group
    desc: str
    calls: list[RankCall] | None
    values: Mapping[str, Any]
    # The op's plan for this call, kept by the op (``call.plan or call.keep(make())``): a call
    # on the lean path gets the Bound its call shape's checks made, so a plan kept here is made
    # once per call shape.
    plan: Any = None

    def __getitem__(self, name: str) -> Any:
        return self.values[name]

    def keep(self, plan: _T) -> _T:
        """Keep ``plan`` as this call's (``plan = call.plan or call.keep(make())``)."""
        self.plan = plan
        return plan


@dataclass(frozen=True)
class Signature:
    """An op's arguments, declared once: what each rank checks alone, and what must hold across
    the ranks of one call.

    * ``fields``: typed scalar arguments every rank passes alike (``distgrad.collectives._fields``:
      each gives its local check, its code in the handshake and its messages);
    * ``lists``: up to two typed integer lists carried whole, so messages show them (never a
      hash); a list field says whether every rank passes the same one. (A list named by a plain
      string has no local check, and is the same on every rank if it is in ``same_lists``: the
      losses', whose checks are their own.)
    * ``shapes``: ``"equal"`` (same shape everywhere), ``"except_dim"`` (same shape but along
      ``dim``) or ``"free"``; dtype and device type always match, and so does whether ``x``
      requires grad (with grad mode on);
    * ``tensor_on``: ``"every"`` rank passes a tensor, or ``"some"`` (scatter's receivers may not).
    """

    op: str
    fields: tuple[ScalarField, ...] = ()
    lists: tuple[str | ListField, ...] = ()
    same_lists: tuple[str, ...] = ()
    shapes: Shapes = "equal"
    tensor_on: Literal["every", "some"] = "every"
    known_by: str = "sizes"  # the argument that makes the output shape known (messages)
    # Inside torch.compile, whether a call without ``known_by`` takes its peers' sizes to be
    # its own (checked on the device by ``assume_alike``); otherwise the graph breaks there.
    assumes_alike: bool = True
    # What bind() walks on every call, made once in __post_init__ rather than per call.
    _typed_lists: tuple[ListField, ...] = dataclasses.field(init=False, repr=False, compare=False)
    _arguments: tuple[ScalarField | ListField, ...] = dataclasses.field(
        init=False, repr=False, compare=False
    )

    def __post_init__(self) -> None:
        named(self.op)  # so that every rank can name this op when a peer calls it
        _SIGNATURES[self.op] = self  # so that a traced call's checks can find it by name
        typed = tuple(f for f in self.lists if not isinstance(f, str))
        object.__setattr__(self, "_typed_lists", typed)
        object.__setattr__(self, "_arguments", (*self.fields, *typed))

    def bind(self, group: GroupLike, x: object, **passed: Any) -> Bound:
        """Check one call of the op: every field's local check, in declared order (the first
        problem is this rank's), then, when the call is checked across ranks, every rank's
        call against the declaration; raise for any problem, on every rank that exchanged.

        ``passed``: every declared argument, by its name, as the caller passed it.

        The lean path: a call whose every check passed before, with the same group, the same
        tensor metadata and the same arguments (its *call shape*), past the checked calls and
        outside debug mode and ``torch.compile``, gets back the Bound that call's checks made
        (with the plan its op kept on it), and only counts and notes the call (``_LEAN``).
        """
        key = hit = None
        if _is_compiling():
            constant = _bound_constant(self, group, x, passed)
            if constant is not None:
                return constant
        else:
            key = _lean_key(self, group, x, passed)
            try:
                hit = _LEAN.get(key)
            except TypeError:  # an argument that cannot be hashed: no call shape
                key = None
            if hit is not None:
                g = hit.group
                if g.size == 1:  # never checked across ranks, nor counted (check())
                    # Seen alone (no process group): reused unless a group was made since.
                    if g.pg is not None or not dist.is_initialized():
                        return hit
                else:
                    call = _calls.get(g.key, 0)
                    if call >= CHECKED_CALLS and not debug_enabled():
                        _calls[g.key] = call + 1
                        note_call(hit.desc, call, g)
                        return hit
        g = resolve(group, self.op)
        arguments, typed_lists = self._arguments, self._typed_lists
        assert len(passed) == len(arguments) == len(self.fields) + len(self.lists), self.op
        desc = self.describe(passed)
        args = Args(g, x, passed, self.tensor_on == "some", {})
        values = args.values
        problem = None
        for field in arguments:
            if problem is None:
                values[field.name], problem = field.local(passed[field.name], args)
            else:
                values[field.name] = None  # not checked: the call raises anyway
        checked, calls = self.check(
            g,
            desc,
            x,
            # The handshake's codes, made only when this call is checked across ranks.
            lambda: [f.code(values[f.name], args) for f in self.fields],
            {f.name: values[f.name] for f in typed_lists},
            problem,
            dim=args.dim,
            sizes_known=all(f.known(passed) for f in typed_lists),
        )
        bound = Bound(checked, desc, calls, values)
        if key is not None and calls is None and checked is g and problem is None:
            if len(_LEAN) >= _LEAN_MAX:  # a program of ever-new call shapes: start over
                _LEAN.clear()
            _LEAN[key] = bound
        return bound

    def describe(self, passed: Mapping[str, Any]) -> str:
        """The call as messages name it: ``all_gather(dim=0)``, ``reduce(dst=0, op='sum')``."""
        shown = [f"{f.name}={f.describe(passed[f.name])}" for f in self.fields if f.shown]
        return f"{self.op}({', '.join(shown)})" if shown else self.op

    def check(
        self,
        group: Group,
        desc: str,
        x: object,
        codes: Sequence[int] | Callable[[], Sequence[int]] = (),
        lists: Mapping[str, Sequence[int] | None] | None = None,
        problem: str | None = None,
        *,
        dim: int = 0,
        sizes_known: bool = True,
    ) -> tuple[Group, list[RankCall] | None]:
        """Check this call; return the group (marked with the call in debug mode) and, when the
        call exchanged metadata, every rank's call (sizes come from there when not known).

        ``codes``: the fields' handshake codes, or a function that makes them (called only when
        the call is checked across ranks). ``problem`` is this rank's own complaint about its
        arguments, if any; ``sizes_known`` says whether this rank can compute the output shape
        without its peers (if not, the call exchanges metadata; inside torch.compile it returns
        no calls when the signature ``assumes_alike``, and the op calls :func:`assume_alike`).
        """
        lists = lists or {}
        problem = problem or _tensor_problem(x, self.tensor_on)
        if torch.compiler.is_compiling() and not sizes_known and not self.assumes_alike:
            # Its output's shape depends on its peers': only an exchange can tell.
            break_for_sizes(desc, self.known_by)
        elif torch.compiler.is_compiling() or group.size == 1:
            if problem is not None:
                raise CollectiveArgumentError(f"{desc} on rank {group.rank}: {problem}")
            return group, None
        call = _next_call(group)
        note_call(desc, call, group)  # for the error if a peer fails during this call
        if group.size > 1 and debug_enabled():
            group = replace(group, call=call)
        if sizes_known and call >= CHECKED_CALLS and not debug_enabled():
            if problem is not None:
                raise CollectiveArgumentError(f"{desc} on rank {group.rank}: {problem}")
            return group, None
        tensor = x if isinstance(x, Tensor) else None
        codes = [*(codes() if callable(codes) else codes), int(sizes_known)]
        carried = [lists.get(_name(field)) for field in self.lists]
        calls = exchange(self.op, desc, group, tensor, codes, carried, problem, call)
        self._check_calls(desc, group, calls, dim)
        return group, calls

    def _check_calls(self, desc: str, group: Group, calls: list[RankCall], dim: int) -> None:
        for i, field in enumerate(self.fields):
            require_same(
                desc,
                group,
                calls,
                field.name,
                lambda c, i=i, f=field: f.show(c.args[i]),  # type: ignore[misc]
                f"every rank must pass the same {field.name}",
            )
        require_same(
            desc,
            group,
            calls,
            f"whether {self.known_by} is given",
            lambda c: "given" if c.args[len(self.fields)] else "not given",
            f"pass {self.known_by} on every rank, or on none (a rank without it learns the "
            "sizes from its peers, and that exchange needs every rank)",
        )
        for i, listed in enumerate(self.lists):
            name = _name(listed)
            if name in self.same_lists or getattr(listed, "same", False):
                require_same(
                    desc,
                    group,
                    calls,
                    name,
                    lambda c, i=i: c.lists[i],  # type: ignore[misc]
                    f"every rank must pass the same {name}",
                    shown=lambda c, i=i: _shown_list(c.lists[i]),  # type: ignore[misc]
                )
        require_same(
            desc,
            group,
            calls,
            "grad mode (torch.is_grad_enabled())",
            lambda c: c.grad_mode,
            "every rank must call with the same grad mode",
        )
        with_tensor = [c for c in calls if c.has_tensor]
        if not with_tensor:
            return
        require_same(
            desc,
            group,
            with_tensor,
            "dtype",
            lambda c: dtype_name(c.dtype),
            "every rank must pass the same dtype",
        )
        require_same(
            desc,
            group,
            with_tensor,
            "device type",
            lambda c: c.device_type,
            "every rank must pass tensors on the same kind of device",
        )
        if with_tensor[0].grad_mode:
            require_same(
                desc,
                group,
                with_tensor,
                "whether x requires grad",
                lambda c: c.requires_grad,
                "every rank's x must require grad, or none's: the backward of a collective is "
                "a collective, which every rank runs or none does",
            )
        self._check_shapes(desc, group, with_tensor, dim)

    def _check_shapes(self, desc: str, group: Group, calls: list[RankCall], dim: int) -> None:
        if self.shapes == "equal":
            require_same(
                desc,
                group,
                calls,
                "shape",
                lambda c: c.shape,
                "every rank must pass a tensor of the same shape",
            )
        elif self.shapes == "except_dim":
            require_same(
                desc,
                group,
                calls,
                "number of dims",
                lambda c: len(c.shape),
                "every rank must pass a tensor with the same number of dims",
            )
            require_same(
                desc,
                group,
                calls,
                f"the shape outside dim {dim}",
                lambda c: tuple(s for i, s in enumerate(c.shape) if i != dim),
                f"all dims except dim {dim} must match",
                shown=lambda c: c.shape,
            )


def sizes_along(call: Bound, given: Sequence[int] | None, extent: int) -> tuple[int, ...]:
    """Every rank's extent along the call's dim: from the exchange when the call made one
    (checked against ``given``), else ``given``; inside torch.compile without either, this
    rank's ``extent`` on every rank, checked on the device (:func:`assume_alike`)."""
    if call.calls is not None:
        return sizes_from(call.desc, call.group, call.calls, given, call["dim"])
    if given is not None:
        return tuple(given)
    if call.group.size > 1:
        assume_alike(call.desc, call.group, [extent], "sizes=")
    return (extent,) * call.group.size


def sizes_from(
    desc: str,
    group: Group,
    calls: Sequence[RankCall],
    given: Sequence[int] | None,
    dim: int,
    name: str = "sizes",
) -> tuple[int, ...]:
    """Every rank's extent along ``dim``, from the exchanged shapes; checked against ``given``."""
    actual = tuple(c.shape[dim] for c in calls)
    if given is not None and tuple(given) != actual:
        wrong = next(r for r in range(len(actual)) if given[r] != actual[r])
        raise CollectiveMismatchError(
            f"{desc} on rank {group.rank}: {name} {list(given)} say rank {wrong} has "
            f"{given[wrong]} entries along dim {dim}, but its x has {actual[wrong]} (every "
            f"rank's x: {', '.join(show(c.shape) for c in calls)})"
        )
    return actual


def _tensor_problem(x: object, tensor_on: str) -> str | None:
    if isinstance(x, Tensor):
        if type(x) is not Tensor and (refused := dtensor_problem(x)) is not None:
            return refused  # what to call instead of torch's dispatch error
        return dtype_problem(x.dtype)
    if x is None and tensor_on == "some":
        return None
    if x is None or isinstance(x, (bool, int, float, complex)):
        return f"x must be a torch.Tensor, got {x!r}"
    return f"x must be a torch.Tensor, got {type(x).__module__}.{type(x).__qualname__}"


def assume_alike(desc: str, group: Group, values: Sequence[int], known_by: str) -> None:
    """Inside ``torch.compile``, where sizes not given cannot be learned (an output's shape
    cannot depend on data), take every rank's ``values`` (its extent along dim, its shape) to
    be this rank's, and check it on the device: one all_gather of a few int64 and an
    asynchronous assertion, no host synchronisation. A rank whose values differ fails the
    assertion, saying to pass ``known_by``."""
    mine = torch.tensor(list(values), dtype=torch.int64, device=metadata_device(group))
    every = ops.all_gather(mine, [len(values)] * group.size, group)
    torch._assert_async(
        (every.view(group.size, len(values)) == mine).all(),
        f"distgrad {desc}: inside torch.compile, a call without {known_by} takes every rank's "
        f"sizes to be alike, and they are not; pass {known_by}",
    )


# Inside torch.compile a call's checks run once, while the step is traced, as a constant of the
# graph (torch._dynamo.assume_constant_result), not traced: traced, the fields, the signature
# and the group left about 140 guard lines for dynamo to check before every run of the step,
# half of a compiled all_reduce's. What they read is what makes the key of the lean path (the
# group, the arguments, the tensor's type, shape, dtype, device and requires_grad, grad mode):
# the constant's inputs, so a change to any of them traces anew. Calls whose arguments are not
# plain constants (a DeviceMesh, a ReduceOp, symbolic sizes) are checked traced, as before.
_CONSTANT_TYPES = (int, str, bool, float, type(None), torch.dtype, torch.device)


def _bound_constant(
    signature: Signature, group: object, x: object, passed: dict[str, Any]
) -> Bound | None:
    """The Bound of a traced call, from its checks run once as a constant; None where the call
    is not made of constants (then ``bind`` traces its checks)."""
    if group is not None and not isinstance(group, dist.ProcessGroup):
        return None
    if x is None:
        meta = None
    elif type(x) is Tensor and all(type(d) is int for d in x.shape):
        meta = (tuple(x.shape), x.dtype, x.device, x.requires_grad, torch.is_grad_enabled())
    else:
        return None
    items = []
    for name, value in passed.items():
        if type(value) in (list, tuple):
            if not all(type(v) is int for v in value):
                return None
            value = tuple(value)
        elif type(value) not in _CONSTANT_TYPES:
            return None
        items.append((name, value))
    checked = _checked_once(signature.op, group, meta, tuple(items))
    if checked is None:  # its output's shape depends on its peers'
        break_for_sizes(signature.describe(passed), signature.known_by)
    desc, values, problem = checked
    if problem is not None:  # raised here, in the trace, as the eager call raises it
        raise CollectiveArgumentError(problem)
    # The group is resolved in the trace (itself a constant of the graph, guarded on the
    # process group passed): a ProcessGroup first seen inside a constant's result would have
    # no source dynamo can guard, and a later use of it in the step could not be traced.
    return Bound(resolve(group, signature.op), desc, None, dict(values))


def _check_alone(
    op: str, group: object, meta: Any, items: tuple[tuple[str, Any], ...]
) -> tuple[str, tuple[tuple[str, Any], ...], str | None] | None:
    """A traced call's checks, on this rank alone, run outside the trace: its description,
    its checked values and its problem (the message to raise); None where its output's shape
    depends on its peers'."""
    signature = _SIGNATURES[op]
    passed = dict(items)
    x = None
    if meta is not None:
        shape, dtype, device, requires_grad, _ = meta
        # A stand-in with x's type, shape, dtype, device and requires_grad (one element).
        x = torch.empty(1, dtype=dtype, device=device, requires_grad=requires_grad)
        x = x.expand(shape) if shape else x.view(())
    with torch.set_grad_enabled(meta is not None and meta[4]):
        g = resolve(group, signature.op)
        args = Args(g, x, passed, signature.tensor_on == "some", {})
        values = args.values
        problem = None
        for field in signature._arguments:
            if problem is None:
                values[field.name], problem = field.local(passed[field.name], args)
            else:
                values[field.name] = None
        desc = signature.describe(passed)
        problem = problem or _tensor_problem(x, signature.tensor_on)
        known = all(f.known(passed) for f in signature._typed_lists)
        if not known and not signature.assumes_alike:
            return None
        if problem is not None:
            problem = f"{desc} on rank {g.rank}: {problem}"
    return desc, tuple(values.items()), problem


_checked_once = torch._dynamo.assume_constant_result(_check_alone)  # type: ignore[no-untyped-call]


def break_for_sizes(desc: str, known_by: str) -> None:
    """Inside ``torch.compile``, a call whose output shape depends on its peers' sizes cannot
    be traced: break the graph there (``fullgraph=True`` raises this message; otherwise the
    exchange runs outside the graph)."""
    torch._dynamo.graph_break(
        msg=f"distgrad {desc}: the output's shape depends on the other ranks' sizes, which "
        f"torch.compile cannot learn without a host synchronisation; pass {known_by}"
    )


def _name(field: str | ListField) -> str:
    return field if isinstance(field, str) else field.name


def _shown_list(values: tuple[int, ...] | None) -> str:
    return "not given" if values is None else str(list(values))
