"""all_reduce: sum is its own adjoint; avg, prod, max and min are derived from primitives.

* avg is sum, then a division by the group size (autograd divides the gradient too);
* prod, max and min are a reduce_scatter with that op followed by an all_gather: the forward
  moves what a ring all_reduce moves, and the gradient is the composition of the two adjoints,
  with the local reduction's own rule in the middle (``_extremes``).
"""

from __future__ import annotations

from torch import Tensor

from distgrad._exchange import ops
from distgrad._exchange.async_op import offers_async_op
from distgrad._exchange.group import Group
from distgrad._mesh import GroupLike
from distgrad.collectives import _common as c
from distgrad.collectives._differentiable import Adjoint, Collective, Plan, apply
from distgrad.collectives._fields import Choice, Reduction
from distgrad.collectives._signature import Signature
from distgrad.collectives.all_gather import apply_all_gather, apply_reduce_scatter

__all__ = ["all_reduce", "apply_all_reduce"]

SIGNATURE = Signature("all_reduce", fields=(Reduction(), Choice("objective", c.OBJECTIVES)))


class _AllReduceSum(Collective):
    name = "all_reduce"

    @staticmethod
    def run(x: Tensor, plan: Plan) -> Tensor:
        exchange = ops.all_reduce.in_flight if plan.async_op else ops.all_reduce
        return c.output(exchange(x, "sum", group=plan.group))

    @staticmethod
    def adjoint(plan: Plan) -> Adjoint:
        return _AllReduceSum, plan

    @staticmethod
    def replicated(grad: Tensor, plan: Plan) -> Tensor:
        return grad  # one shared loss: d loss / d x_r is the incoming gradient itself


def apply_all_reduce(
    x: Tensor, group: Group, op: str, objective: c.Objective = "sum", async_op: bool = False
) -> Tensor:
    """all_reduce without the checks, for ops built on it (their arguments are checked)."""
    if group.size == 1:
        return x.clone()
    if op == "avg":
        return apply_all_reduce(x, group, "sum", objective, async_op) / group.size
    if op == "sum":
        return apply(_AllReduceSum, x, Plan(group, objective=objective), async_op=async_op)
    flat = x.reshape(-1)
    sizes = tuple(c.near_even(flat.numel(), group.size))
    part = apply_reduce_scatter(flat, group, sizes, 0, op, async_op)
    return apply_all_gather(part, group, sizes, 0, objective, async_op).view(x.shape)


@offers_async_op
def all_reduce(
    x: Tensor,
    op: c.ReduceOp = "sum",
    group: GroupLike = None,
    *,
    objective: c.Objective = "sum",
    async_op: bool = False,
) -> Tensor:
    """Reduce ``x`` elementwise over the ranks of ``group`` with ``op``; every rank gets the result.

    ``op`` is one of "sum", "avg", "prod", "max", "min", or the matching
    ``torch.distributed.ReduceOp``. Every rank passes a tensor of the same shape, dtype and
    device type. ``x`` is not modified.

    Gradient with ``objective="sum"`` (the objective is the sum over ranks of each rank's loss):

    * sum: ``all_reduce(grad, "sum")``; avg: the same divided by the group size;
    * prod: the summed incoming gradient times the product of the *other* ranks' entries,
      computed as prefix and suffix products, never by division, so it is exact when entries
      are zero, infinite, or when the full product over- or underflows;
    * max, min: the summed incoming gradient goes to the ranks that hold the extreme value,
      split evenly among ties, exactly as autograd of ``torch.stack(inputs).amax(0)`` does.

    With ``objective="replicated"`` every rank computes the same loss from the result, and it
    counts once: the incoming gradient is not summed over ranks (sum: the gradient passes through
    unchanged, with no communication).

    Communication: forward 1 all_reduce of x (sum, avg) or 1 all_to_all plus 1 all_gather of x
    (prod, max, min); backward 1 all_reduce (sum, avg; none when replicated) or 1 all_to_all
    plus 1 all_to_all-based reduce-scatter (prod, max, min). No metadata once the first calls
    on the group are checked (docs/semantics.md).

    ``async_op=True``: return at once an :class:`~distgrad.AsyncTensor`, which waits for the
    data on first use; the backward's exchange is started the same way (docs/semantics.md,
    "Overlap: async_op").

    Args:
        x: this rank's tensor, the same shape on every rank; not modified.
        op: ``"sum"``, ``"avg"``, ``"prod"``, ``"max"``, ``"min"`` or the matching
            ``torch.distributed.ReduceOp``.
        group: the process group (default: the default group), a DeviceMesh dimension
            (``mesh["tp"]``, ``(mesh, "tp")``, ``(mesh, 1)``); a DTensor input is refused.
        objective: ``"sum"`` (the losses of every rank add up) or ``"replicated"`` (every rank
            computes the same loss, counted once).
        async_op: return at once an ``AsyncTensor`` that waits for its data on first use.

    Returns:
        The elementwise reduction of every rank's ``x``, on every rank.

    Raises:
        CollectiveArgumentError: an argument is invalid on some rank (an unknown ``op`` or
            ``objective``); raised on every rank of the group, before any data moves, naming the
            rank, the argument and what was expected.
        CollectiveMismatchError: the ranks' arguments do not fit together (shapes, dtypes or ops
            that differ), found while the group's first calls are checked across ranks, in debug
            mode (``set_debug``) and, after them, by the data guard (``set_guard``).
        torch.distributed.DistBackendError: a peer's process died while this rank waited
            (``PeerGoneError``, a subclass, when distgrad's liveness check saw it first); the
            message names the op, the pass and the peer (docs/faults.md).
        RuntimeError: a peer never came within the group's timeout (the backend's timeout error,
            with distgrad's account of who waited where first).

    Example:
        >>> def largest(rank, world_size):
        ...     x = torch.tensor([1.0, 5.0]) * (1 - rank) + torch.tensor([4.0, 2.0]) * rank
        ...     return dg.all_reduce(x, "max")  # rank 0 holds [1, 5], rank 1 [4, 2]
        >>> dg.testing.run_on_ranks(largest, 2, simulate=True)
        [tensor([4., 5.]), tensor([4., 5.])]
    """
    call = SIGNATURE.bind(group, x, op=op, objective=objective)
    return apply_all_reduce(x, call.group, call["op"], objective, async_op)
