"""The one skeleton of every collective's autograd Function, written once.

An op states three things and nothing else (JAX states a transpose the same way, beside its op):

* its **plan**: a frozen dataclass, derived from :class:`Plan`, of what the exchange needs;
* its **work**, ``run(x, plan)``: the forward's exchange, through ``distgrad._exchange.ops``;
* its **adjoint**, ``adjoint(plan)``: one line naming the partner op and the transposed plan
  (``return _ReduceScatterSum, plan``; ``return _AllToAll, plan.swapped()``). The backward is
  the partner's forward on the incoming gradient: another op of this package, so a double
  backward goes through the partner's own adjoint, and no backward branches on the backend.

An op that offers ``objective="replicated"`` (one loss shared by every rank, counted once) also
states ``replicated(grad, plan)``: what this rank keeps of its incoming gradient, with no
communication. Everything else is here: the ordering check of debug mode, the replicated check,
``ctx.needs_input_grad``, and the anchor of a rank that passes no tensor (scatter's receivers).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field, replace
from typing import Any, ClassVar

import torch
from torch import Tensor
from torch.autograd.function import FunctionCtx

from distgrad._exchange.async_op import deferred
from distgrad._exchange.group import Group
from distgrad._exchange.handshake import debug_enabled
from distgrad.collectives._common import Objective
from distgrad.collectives._debug import check_backward_order, check_replicated

__all__ = ["Adjoint", "Collective", "Plan", "apply", "partner"]


@dataclass(frozen=True)
class Plan:
    """What every op's plan holds: the group, the objective the gradient refers to, and whether
    the call was made with ``async_op=True`` (its exchanges then start and their results wait
    on first use: ``run`` calls the exchange's ``in_flight`` form)."""

    group: Group
    objective: Objective = field(default="sum", kw_only=True)
    async_op: bool = field(default=False, kw_only=True)


Adjoint = tuple[type["Collective"], Plan]
"""The partner op and the plan it runs with: the transposed plan."""


class Collective(torch.autograd.Function):
    """The autograd Function of one collective: subclasses set ``name`` and define ``run`` and
    ``adjoint`` (and ``replicated`` where the op offers that objective); ``forward`` and
    ``backward`` are made here, once, for each subclass."""

    name: ClassVar[str]  # the op's name in messages and in debug mode's ordering check

    @staticmethod
    def run(x: Any, plan: Any) -> Tensor:
        """The forward's work on ``x`` (None on a rank that passes no tensor)."""
        raise NotImplementedError

    @staticmethod
    def adjoint(plan: Any) -> Adjoint:
        """The partner op whose forward on the gradient is this op's backward, and its plan."""
        raise NotImplementedError

    @staticmethod
    def replicated(grad: Tensor, plan: Any) -> Tensor | None:
        """With ``objective="replicated"``: the gradient this rank keeps, without communicating."""
        raise AssertionError("this op offers no replicated objective; its checks refuse it")

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        # Functions made per subclass, not methods that read ``cls`` from ``ctx``: autograd and
        # torch.compile both call a Function's forward and backward as plain functions.
        cls.forward = staticmethod(_forward_of(cls))  # type: ignore[method-assign,assignment]
        cls.backward = staticmethod(_backward_of(cls))  # type: ignore[method-assign,assignment]


def _forward_of(op: type[Collective]) -> Any:
    def forward(ctx: FunctionCtx, x: Tensor | None, plan: Plan, anchor: Tensor | None) -> Tensor:
        ctx.plan = plan  # type: ignore[attr-defined]
        ctx.anchor_like = anchor.detach() if anchor is not None else None  # type: ignore[attr-defined]
        return op.run(x, plan)

    return forward


def _backward_of(op: type[Collective]) -> Any:
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor | None, None, Tensor | None]:
        plan: Plan = ctx.plan
        if not torch.compiler.is_compiling() and debug_enabled():  # (its test, inline)
            check_backward_order(op.name, plan.group)
        if plan.objective == "replicated":
            check_replicated(op.name, plan.group, grad)
            back = op.replicated(grad, plan)
        else:
            # A collective every rank runs, whether or not this rank's input wants its result
            # (one whose result nobody reads is waited for here, so its errors are raised).
            adjoint, back_plan = op.adjoint(plan)
            later = plan.async_op and ctx.needs_input_grad[0]
            if back_plan.async_op != later:  # (a transposed plan is made without it)
                back_plan = replace(back_plan, async_op=later)
            if later:
                with deferred():
                    back = partner(adjoint, back_plan, grad)
            else:
                back = partner(adjoint, back_plan, grad)
        needs = ctx.needs_input_grad
        # An anchor's values reach no output: its gradient is zeros, and torch.autograd.grad
        # may ask for it like any input.
        anchor = ctx.anchor_like.new_zeros(ctx.anchor_like.shape) if needs[2] else None
        return (back if needs[0] else None), None, anchor

    return backward


def apply(
    op: type[Collective],
    x: Tensor | None,
    plan: Plan,
    anchor: Tensor | None = None,
    async_op: bool = False,
) -> Tensor:
    """``op.apply(x, plan, anchor)``, typed (torch leaves ``Function.apply`` untyped).

    ``anchor``: a leaf that makes autograd record the op on a rank whose ``x`` is None (see
    ``_common.anchor``); its gradient is zeros. ``async_op``: the call's choice, put in the
    plan (a kept plan is shared by both kinds of call), which carries it to the exchange and
    to the backward. Traced, the call is the blocking one: the compiled graph orders its
    exchanges itself.
    """
    if async_op and not torch.compiler.is_compiling():
        plan = replace(plan, async_op=True)
    if torch.compiler.is_compiling() or _functorch_active():
        out: Tensor = op.apply(x, plan, anchor)  # type: ignore[no-untyped-call]
        return out
    return _c_apply(op)(x, plan, anchor)  # type: ignore[no-any-return]


# ``Function.apply``'s Python wrapper, around torch's C apply, costs about 15 us per call here
# (48 against 33 us of CPU for a 32 KB all_gather forward on 2 gloo ranks, whose exchange is
# 14 us): it binds default arguments, unwraps dead functorch wrappers and checks for a
# setup_context. None of that applies to these Functions (no defaults, no setup_context, no
# functorch transform active: checked above), so the eager path calls the C apply directly, as
# distgrad.rpc's recv nodes do. torch.compile traces through the Python apply, as it must.
_C_APPLY: Any = torch._C._FunctionBase.__dict__["apply"]
_functorch_active: Any = torch._C._are_functorch_transforms_active


@functools.cache
def _c_apply(op: type[Collective]) -> Any:
    return _C_APPLY.__get__(None, op)


def partner(op: type[Collective], plan: Plan, grad: Tensor) -> Tensor:
    """A backward's partner op: differentiable when the backward itself is recorded (a double
    backward, ``create_graph=True``), else its forward's work alone (``op.run``): an
    ``autograd.Function`` call costs 10-20 us, a tenth of a small exchange."""
    if torch.is_grad_enabled():
        return apply(op, grad, plan)
    return op.run(grad, plan)
