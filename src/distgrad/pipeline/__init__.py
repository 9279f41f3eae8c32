"""Distributed autograd over c10d point-to-point: the transfers between pipeline stages,
recorded in the forward pass, and one backward across the ranks.

Usage, on every rank of a two-stage pipeline (group ranks; gloo or NCCL)::

    import distgrad.pipeline as dgp

    with dgp.context() as cid:
        if rank == 0:
            dgp.send(stage0(x), dst=1)
            dgp.backward(cid)                   # no loss here: driven by what arrives
        else:
            h = dgp.recv(src=0, shape=(batch, width), dtype=torch.float32)
            loss = loss_fn(stage1(h), y)
            dgp.backward(cid, [loss])           # the gradient of h goes back to rank 0

Each rank records its transfers in order in the context; ``backward`` takes them in reverse,
sends each received tensor's gradient to its sender once it is complete, and runs this rank's
graph from each send's gradient as it arrives (the design note's FAST mode, without RPC).
Microbatches are labelled (``microbatch=``) so a schedule runs their backwards in any order,
and a backward can be split into its input and weight halves (zero-bubble schedules). The
same context API as :mod:`distgrad.rpc`; see docs/pipeline.md.
"""

from __future__ import annotations

from distgrad.errors import PipelineError
from distgrad.pipeline import _records
from distgrad.pipeline.backward import backward, backward_weights, get_gradients
from distgrad.pipeline.transfer import Transfer, irecv, isend, recv, send

__all__ = [
    "Transfer",
    "backward",
    "backward_weights",
    "context",
    "get_gradients",
    "irecv",
    "isend",
    "recv",
    "send",
]


class context:  # lower case: a context manager used as a function, as torch's
    """Record this rank's transfers for one distributed backward; yields the context's id.

    Every rank enters its own context for the same step (ids are local to each rank; ranks
    pair transfers by their order, not by id). ``check=True`` (the same on every rank) has
    every message of the context carry its header, as the first 8 each way between two ranks
    do: for a step whose shapes differ from the earlier steps' (a smaller last batch), since
    after their checked calls transfers send only data in the shapes they announced.

    On leaving, the sends still in flight are waited for, and a context some of whose
    recorded transfers no backward ran raises :class:`~distgrad.errors.PipelineError` (their
    peers would wait for those gradients). Contexts do not nest on one thread.

    Args:
        check: every message of the context carries its header (the same on every rank).

    Returns:
        A context manager that yields the context's id, for ``backward`` and
        ``get_gradients``.

    Raises:
        PipelineError: entered inside another context on this thread, or left with recorded
            transfers that no backward ran.

    Example:
        >>> from distgrad._demo.pipeline import two_stages
        >>> dg.testing.run_on_ranks(two_stages, 2)  # `with dg.pipeline.context() as cid:`
        [True, True]
        >>> with dg.pipeline.context() as cid:  # one rank alone: a plain backward
        ...     x = torch.ones(2, requires_grad=True)
        ...     dg.pipeline.backward(cid, [(x * x).sum()])
        >>> x.grad
        tensor([2., 2.])
    """

    __slots__ = ("_ctx", "check")

    def __init__(self, *, check: bool = False) -> None:
        self.check = check
        self._ctx: _records.Context | None = None

    def __enter__(self) -> int:
        # A class, not a contextlib generator: 3 us less a step (the rpc scopes measured it).
        self._ctx = _records.open_context(self.check)
        return self._ctx.context_id

    def __exit__(self, kind: object, *rest: object) -> None:
        ctx, self._ctx = self._ctx, None
        assert ctx is not None
        try:
            if kind is None:
                _close(ctx)
        finally:
            _records.release(ctx)


def _close(ctx: _records.Context) -> None:
    """Wait for the sends still in flight; refuse a context with transfers no backward ran."""
    ctx.wait_in_flight()
    left = [r for r in ctx.records if r.state != "done"]
    if left or ctx.weight_steps:
        rank = left[0].group.rank if left else "?"
        names = "; ".join(r.describe() for r in left[:4])
        more = f" and {len(left) - 4} more" if len(left) > 4 else ""
        steps = sorted(map(str, ctx.weight_steps))
        pending = f"; weight steps never run: microbatch {', '.join(steps)}" if steps else ""
        raise PipelineError(
            f"rank {rank} leaves dg.pipeline context {ctx.context_id} with transfers no "
            f"backward ran: {names or 'none'}{more}{pending}; run dg.pipeline.backward (and "
            "backward_weights after a split one) for every microbatch before leaving the "
            "context"
        )
