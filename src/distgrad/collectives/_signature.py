"""Argument checks, declared once per op and read by one function: the door of every op.

Each op (a collective, a loss, a parallel pattern) declares a :class:`Signature`: its arguments
as typed fields (``_fields``, ``_list_fields``: each gives its local check, its code across
ranks and the words of its messages) and how the ranks' tensor shapes must relate.
:meth:`Signature.bind` checks a call's arguments on this rank, names the call in every message
(``reduce(dst=0, op='sum')``, then ``on rank <group rank>:``), decides whether this call
exchanges metadata (``_checked_calls``), and if it does, checks every rank's call against the
declaration, so every op body is the few lines of its work. A call checked before takes the
lean path (``_lean``); inside ``torch.compile`` the checks run once, as a constant of the
graph (``_compiled_checks``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any, Literal

import torch
from torch import Tensor

from distgrad._exchange.group import Group, resolve
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
from distgrad._mesh import GroupLike
from distgrad.collectives._bound import Bound
from distgrad.collectives._checked_calls import CHECKED_CALLS, checks_this_call, next_call
from distgrad.collectives._compiled_checks import (
    Checked,
    assume_alike,
    bound_constant,
    break_for_sizes,
    register,
)
from distgrad.collectives._fields import (
    Args,
    Block,
    Choice,
    Count,
    Dim,
    NotBoth,
    Option,
    Rank,
    ScalarField,
    tensor_problem,
)
from distgrad.collectives._lean import remember, reuse
from distgrad.collectives._list_fields import ListField, Parts, Perm, Shape, Sizes
from distgrad.errors import CollectiveArgumentError, CollectiveMismatchError

__all__ = ["CHECKED_CALLS", "Bound", "Signature", "sizes_along", "sizes_from"]

Shapes = Literal["equal", "except_dim", "free"]
_is_compiling = torch.compiler.is_compiling
# The fields whose values are plain data (never a tensor): a signature made of them only keys
# its lean path by its values as passed.
_PLAIN = (Rank, Dim, Choice, Block, Count, NotBoth, Option, Sizes, Perm, Shape, Parts)


@dataclass(frozen=True)
class Signature:
    """An op's arguments, declared once: what each rank checks alone, and what must hold across
    the ranks of one call.

    * ``fields``: typed scalar arguments (``_fields``): those every rank passes alike are
      carried in the handshake and compared; the others (a tensor argument, a temperature, a
      block size) are checked on this rank only. An argument may have several fields;
    * ``lists``: up to two typed integer lists carried whole (``_list_fields``), so messages
      show them (never a hash); a list field says whether every rank passes the same one;
    * ``shapes``: ``"equal"`` (same shape everywhere), ``"except_dim"`` (same shape but along
      ``dim``) or ``"free"``; dtype and device type always match, and so does whether ``x``
      requires grad (with grad mode on);
    * ``tensor``: ``x``'s name in messages; ``tensor_on``: ``"every"`` rank passes a tensor,
      ``"some"`` (scatter's receivers may not) or ``"none"`` (a layer's constructor);
    * ``handshake``: False for an op made of collectives that check themselves (a parallel
      pattern): its own arguments are checked on this rank, worded the same, and nothing is
      exchanged or counted.
    """

    op: str
    fields: tuple[ScalarField, ...] = ()
    lists: tuple[ListField, ...] = ()
    shapes: Shapes = "equal"
    tensor: str = "x"
    tensor_on: Literal["every", "some", "none"] = "every"
    known_by: str = "sizes"  # the argument that makes the output shape known (messages)
    # Inside torch.compile, whether a call without ``known_by`` takes its peers' sizes to be
    # its own (checked on the device by ``assume_alike``); otherwise the graph breaks there.
    assumes_alike: bool = True
    handshake: bool = True
    # What bind() walks on every call, made once in __post_init__ rather than per call.
    _arguments: tuple[ScalarField | ListField, ...] = dataclasses.field(
        init=False, repr=False, compare=False
    )
    _carried: tuple[ScalarField, ...] = dataclasses.field(init=False, repr=False, compare=False)
    _names: frozenset[str] = dataclasses.field(init=False, repr=False, compare=False)
    # Whether every argument is plain data (no tensor): the lean path keys such calls faster.
    plain: bool = dataclasses.field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        named(self.op)  # so that every rank can name this op when a peer calls it
        register(self)  # so that a traced call's constant checks can find it by name
        arguments: tuple[ScalarField | ListField, ...] = (*self.fields, *self.lists)
        object.__setattr__(self, "_arguments", arguments)
        object.__setattr__(self, "_carried", tuple(f for f in self.fields if f.same))
        object.__setattr__(self, "_names", frozenset(f.name for f in arguments))
        plain = all(isinstance(f, _PLAIN) for f in arguments)
        object.__setattr__(self, "plain", plain)

    def bind(self, group: GroupLike, x: object, /, **passed: Any) -> Bound:
        """Check one call of the op: every field's local check, in declared order (the first
        problem is this rank's), then, when the call is checked across ranks, every rank's
        call against the declaration; raise for any problem, on every rank that exchanged.

        ``passed``: every declared argument, by its name, as the caller passed it. A call of
        a call shape whose checks passed before takes the lean path (``_lean``).
        """
        key = None
        if _is_compiling():
            constant = bound_constant(self, group, x, passed)
            if constant is not None:
                return Bound(constant[0], constant[1], None, constant[2])
        else:
            hit, key = reuse(self, group, x, passed)
            if hit is not None:
                return hit
        g = resolve(group, self.op)
        desc = self.describe(passed)
        args, problem, known = self._local(g, x, passed, checked=None)
        checked, calls = self._across(g, desc, args, problem, known)
        bound = Bound(checked, desc, calls, args.values)
        if key is not None and calls is None and checked is g:
            remember(key, bound)
        return bound

    def describe(self, passed: Mapping[str, Any]) -> str:
        """The call as messages name it: ``all_gather(dim=0)``, ``reduce(dst=0, op='sum')``."""
        shown = [f"{f.name}={f.describe(passed[f.name])}" for f in self.fields if f.shown]
        return f"{self.op}({', '.join(shown)})" if shown else self.op

    def check_alone(self, group: Group, x: object, passed: dict[str, Any]) -> Checked | None:
        """A traced call's checks on this rank alone (``_compiled_checks``): its description,
        its checked values and its problem worded whole; None where its output's shape depends
        on its peers'."""
        args, problem, known = self._local(group, x, passed, checked=False)
        if self.handshake and not known and not self.assumes_alike:
            return None
        desc = self.describe(passed)
        if problem is not None:
            problem = f"{desc} on rank {group.rank}: {problem}"
        return desc, tuple(args.values.items()), problem

    def _local(
        self, g: Group, x: object, passed: Mapping[str, Any], checked: bool | None
    ) -> tuple[Args, str | None, bool]:
        """Every field's local check, then ``x``'s: the checked arguments, this rank's first
        problem, and whether this rank knows the output's shape without its peers."""
        assert passed.keys() == self._names, (self.op, sorted(passed))
        known = True
        for listed in self.lists:  # loops, not generators, here: fewer Python calls per op
            known = known and listed.known(passed)
        if checked is None:
            checked = self.handshake and checks_this_call(g, known)
        args = Args(g, x, passed, self.tensor_on == "some", {}, self.tensor, checked)
        values = args.values
        problem = None
        for field in self._arguments:
            if problem is None:
                values[field.name], problem = field.local(passed[field.name], args)
            else:
                values[field.name] = None  # not checked: the call raises anyway
        return args, problem or self._tensor_problem(x), known

    def _tensor_problem(self, x: object) -> str | None:
        if self.tensor_on == "none" or (x is None and self.tensor_on == "some"):
            return None
        problem = tensor_problem(x, self.tensor)
        if problem is None and self.handshake:
            assert isinstance(x, Tensor)
            return dtype_problem(x.dtype)
        return problem

    def _across(
        self, group: Group, desc: str, args: Args, problem: str | None, known: bool
    ) -> tuple[Group, list[RankCall] | None]:
        """Check this call across ranks when it is checked; return the group (marked with the
        call in debug mode) and, when the call exchanged metadata, every rank's call (sizes
        come from there when not known)."""
        compiling = _is_compiling()
        if compiling and self.handshake and not known and not self.assumes_alike:
            # Its output's shape depends on its peers': only an exchange can tell.
            break_for_sizes(desc, self.known_by)
        elif compiling or group.size == 1 or not self.handshake:
            if problem is not None:
                raise CollectiveArgumentError(f"{desc} on rank {group.rank}: {problem}")
            return group, None
        call = next_call(group)
        note_call(desc, call, group)  # for the error if a peer fails during this call
        if debug_enabled():
            group = replace(group, call=call)
        elif known and call >= CHECKED_CALLS:
            if problem is not None:
                raise CollectiveArgumentError(f"{desc} on rank {group.rank}: {problem}")
            return group, None
        x = args.x if isinstance(args.x, Tensor) else None
        codes = [f.code(args.values[f.name], args) for f in self._carried]
        codes.append(int(known))
        carried = [args.values[f.name] for f in self.lists]
        calls = exchange(self.op, desc, group, x, codes, carried, problem, call)
        self._check_calls(desc, group, calls, args.dim)
        return group, calls

    def _check_calls(self, desc: str, group: Group, calls: list[RankCall], dim: int) -> None:
        for call in calls:
            if call.args != calls[0].args:  # some rank passed other scalars: which?
                self._check_scalars(desc, group, calls)
                break
        for i, listed in enumerate(self.lists):
            if listed.same:
                require_same(
                    desc,
                    group,
                    calls,
                    listed.name,
                    lambda c, i=i: c.lists[i],  # type: ignore[misc]
                    f"every rank must pass the same {listed.name}",
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
        if with_tensor:
            self._check_tensors(desc, group, with_tensor, dim)

    def _check_scalars(self, desc: str, group: Group, calls: list[RankCall]) -> None:
        for i, field in enumerate(self._carried):
            require_same(
                desc,
                group,
                calls,
                field.compared,
                lambda c, i=i, f=field: f.show(c.args[i]),  # type: ignore[misc]
                f"every rank must pass the same {field.compared}",
            )
        require_same(
            desc,
            group,
            calls,
            f"whether {self.known_by} is given",
            lambda c: "given" if c.args[len(self._carried)] else "not given",
            f"pass {self.known_by} on every rank, or on none (a rank without it learns the "
            "sizes from its peers, and that exchange needs every rank)",
        )

    def _check_tensors(self, desc: str, group: Group, calls: list[RankCall], dim: int) -> None:
        require_same(
            desc,
            group,
            calls,
            "dtype",
            lambda c: dtype_name(c.dtype),
            "every rank must pass the same dtype",
        )
        require_same(
            desc,
            group,
            calls,
            "device type",
            lambda c: c.device_type,
            "every rank must pass tensors on the same kind of device",
        )
        if calls[0].grad_mode:
            require_same(
                desc,
                group,
                calls,
                f"whether {self.tensor} requires grad",
                lambda c: c.requires_grad,
                f"every rank's {self.tensor} must require grad, or none's: the backward of a "
                "collective is a collective, which every rank runs or none does",
            )
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


def sizes_along(
    call: Bound, given: Sequence[int] | None, extent: int, alike: Sequence[int] = ()
) -> tuple[int, ...]:
    """Every rank's extent along the call's dim: from the exchange when the call made one
    (checked against ``given``), else ``given``; inside torch.compile without either, this
    rank's ``extent`` on every rank, checked on the device with ``alike`` (what else the ranks
    must share) by :func:`~distgrad.collectives._compiled_checks.assume_alike`."""
    dim = call.values.get("dim", 0)
    if call.calls is not None:
        return sizes_from(call.desc, call.group, call.calls, given, dim)
    if given is not None:
        return tuple(given)
    if call.group.size > 1:
        assume_alike(call.desc, call.group, [extent, *alike], "sizes=")
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
    actual = tuple([c.shape[dim] for c in calls])
    if given is not None and tuple(given) != actual:
        wrong = next(r for r in range(len(actual)) if given[r] != actual[r])
        raise CollectiveMismatchError(
            f"{desc} on rank {group.rank}: {name} {list(given)} say rank {wrong} has "
            f"{given[wrong]} entries along dim {dim}, but its x has {actual[wrong]} (every "
            f"rank's x: {', '.join(show(c.shape) for c in calls)})"
        )
    return actual


def _shown_list(values: tuple[int, ...] | None) -> str:
    return "not given" if values is None else str(list(values))
