"""The distributed backward over c10d point-to-point: FAST semantics, run without RPC.

Every rank calls :func:`backward` (a rank without a loss passes no roots). A rank takes the
transfers the call covers (one microbatch's, or all not yet run) in **reverse program order**:

* a **send** waits for its gradient from the receiver (every such receive is posted when the
  call starts, so gradients land while this rank computes) and becomes a start of the local
  engine; consecutive sends run as one phase, so a subgraph they share runs once;
* a **receive** first runs the phase gathered so far (the roots, then the sends after it),
  which accumulates into the received tensor's ``.grad`` (it is a leaf, as torch's
  ``PipelineStage`` makes it); its gradient is then complete (everything that used the
  received tensor came after it) and is sent to its sender at once, left in flight.

Why the order cannot deadlock: a rank waits at a send only when every transfer after it is done.
If rank A waited at send s to rank B forever, B would be waiting at a send made after its
receive of s, which in the forward came after s; following the waits from rank to rank would
climb the forward's happens-before order forever, which a finite forward cannot do. Each
forward transfer carries exactly one gradient message back (zeros for a received tensor that
never reached a root), so a backward always completes on every rank, also where some transfer's
output never reaches the loss.

``weights=False`` runs the input-gradient half only (what a zero-bubble schedule's ``I`` step
does): the engine runs from the starts to the received tensors, no parameter's gradient is
touched,
and :func:`backward_weights` later runs the same starts again for the parameters' gradients.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal

import torch
from torch import Tensor

from distgrad._exchange.pairs import Pairs, start_pairs
from distgrad.errors import CollectiveMismatchError, PipelineError
from distgrad.pipeline import _wire
from distgrad.pipeline._records import Context, Record, lookup

__all__ = ["backward", "backward_weights", "get_gradients"]

_ENGINE: Any = torch.autograd.Variable._execution_engine  # type: ignore[attr-defined]

Accumulate = Literal["grad", "context"]


def backward(
    context_id: int,
    roots: Sequence[Tensor] = (),
    grad_tensors: Sequence[Tensor | None] | None = None,
    *,
    microbatch: int | None = None,
    weights: bool = True,
    accumulate: Accumulate = "grad",
) -> None:
    """Run this rank's part of the distributed backward of context ``context_id``.

    Every rank that took part in the forward calls it, with the same ``microbatch`` in the
    same order of calls: ``roots`` are this rank's losses (or outputs, with ``grad_tensors``
    as for ``torch.autograd.backward``); a rank without one passes none and is driven by the
    gradients that arrive for its sends. ``microbatch`` runs only the transfers labelled with
    it (a pipeline schedule's backward of one microbatch); ``None`` runs every transfer not yet
    run. Each transfer is run once.

    Gradients go where ``accumulate`` says: ``"grad"`` into the leaves' ``.grad`` (through
    autograd's own accumulation, so DDP's and FSDP2's hooks fire), ``"context"`` into the
    context (:func:`get_gradients`), ``.grad`` untouched. ``weights=False`` computes only the
    gradients the other ranks need (the received tensors'); :func:`backward_weights` then
    computes the parameters'. Semantics: the objective is the sum over ranks of the roots each
    rank passes (docs/pipeline.md).

    Communication: 1 message per transfer covered, the gradient, the opposite way to its
    forward message (a header of 16 int64 before it on the first 8 each way between two ranks).

    Args:
        context_id: the id :func:`~distgrad.pipeline.context` yielded on this rank.
        roots: this rank's losses (or outputs); none on a rank without a loss.
        grad_tensors: a gradient per root (``None``: 1, for a one-element root).
        microbatch: the transfers' label to run (``None``: every transfer not yet run).
        weights: ``False`` runs the input half only (the received tensors' gradients, sent
            on); :func:`backward_weights` runs the rest.
        accumulate: ``"grad"`` (into ``.grad``) or ``"context"`` (:func:`get_gradients`).

    Returns:
        None; the gradients are in ``.grad`` or in the context.

    Raises:
        PipelineError: no such context on this rank, roots and ``grad_tensors`` that do not
            pair up, or an input half whose weight half has not run.
        CollectiveMismatchError: two ranks' backwards cover different transfers (checked
            calls), naming both counts and the transfer.
        torch.distributed.DistBackendError: a peer's process died while this rank waited for
            a gradient, naming the rank and the transfer.
        RuntimeError: a gradient never came within the group's timeout.

    Example:
        >>> from distgrad._demo.pipeline import two_stages, microbatches
        >>> dg.testing.run_on_ranks(two_stages, 2)  # rank 0: backward(cid), no loss there
        [True, True]
        >>> dg.testing.run_on_ranks(microbatches, 2)  # backward(cid, ..., microbatch=m)
        [True, True]
    """
    ctx = lookup(context_id)
    starts, grads = _roots(roots, grad_tensors)
    records = ctx.pending(microbatch, everything=microbatch is None)
    if weights is False and microbatch in ctx.weight_steps:
        raise PipelineError(
            f"dg.pipeline.backward(microbatch={microbatch}, weights=False): the weight step "
            "of that microbatch's earlier input step has not run yet; call "
            "dg.pipeline.backward_weights first"
        )
    incoming = _post_gradient_receives(ctx, records)
    received = [r.tensor for r in records if r.kind == "recv" and r.tensor is not None]
    phase = _Phase(ctx, accumulate, weights, microbatch, received)
    phase.add(starts, grads)
    for rec in reversed(records):
        if rec.kind == "recv":
            phase.run()
            _send_gradient(ctx, rec, records)
        else:
            grad = incoming[rec]()
            assert rec.tensor is not None
            phase.add([rec.tensor], [grad])
        rec.state = "done"
        if rec.kind == "send" and weights:
            rec.tensor = None  # the graph goes with the last reference to its start
    phase.run(last=True)


def backward_weights(
    context_id: int, *, microbatch: int | None = None, accumulate: Accumulate = "grad"
) -> None:
    """The weight half of a split backward: the parameters' gradients of ``microbatch``,
    whose input half ran as ``backward(..., weights=False)``. Local: it sends nothing.

    Cost: the engine runs from the same starts again (the input half's nodes run twice; torch's
    ``stage_backward_weight`` keeps the intermediate gradients instead).

    Args:
        context_id: the id :func:`~distgrad.pipeline.context` yielded on this rank.
        microbatch: the microbatch whose input half ran.
        accumulate: ``"grad"`` (into ``.grad``) or ``"context"`` (:func:`get_gradients`).

    Returns:
        None; the parameters' gradients are in ``.grad`` or in the context.

    Raises:
        PipelineError: no such context, or no input half of that microbatch waiting.

    Example:
        >>> from distgrad._demo.pipeline import split_backward
        >>> dg.testing.run_on_ranks(split_backward, 2)  # weights=False, then the weights
        [True, True]
    """
    ctx = lookup(context_id)
    steps = ctx.weight_steps.pop(microbatch, None)
    if steps is None:
        raise PipelineError(
            f"dg.pipeline.backward_weights(microbatch={microbatch}): no input step of that "
            "microbatch is waiting for its weight step in this context (run "
            "dg.pipeline.backward(..., weights=False) for it first)"
        )
    for i, (starts, grads, received) in enumerate(steps):
        retain = i < len(steps) - 1
        _engine(ctx, starts, grads, accumulate, retain, inputs_only=False, received=received)
        for t in received:  # sent already, by the input half
            t.grad = None


def get_gradients(context_id: int) -> dict[Tensor, Tensor]:
    """The gradients a ``backward(..., accumulate="context")`` of the context put there, by
    leaf (``{parameter: gradient}``), as ``torch.distributed.autograd.get_gradients``.

    Args:
        context_id: the id :func:`~distgrad.pipeline.context` yielded on this rank.

    Returns:
        A new dict from each leaf to its gradient; ``.grad`` is left untouched.

    Raises:
        PipelineError: no such context on this rank (read it inside the ``with`` block).

    Example:
        >>> w = torch.ones(2, requires_grad=True)
        >>> with dg.pipeline.context() as cid:  # a rank's part; here, all of it
        ...     dg.pipeline.backward(cid, [(w * 3).sum()], accumulate="context")
        ...     dg.pipeline.get_gradients(cid)[w]
        tensor([3., 3.])
    """
    ctx = lookup(context_id)
    return {leaf: grad for leaf, grad in ctx.gradients.values()}


class _Phase:
    """Starts gathered between two receives, run by the local engine as one call."""

    def __init__(
        self,
        ctx: Context,
        accumulate: Accumulate,
        weights: bool,
        microbatch: int | None,
        received: list[Tensor],
    ) -> None:
        self.ctx = ctx
        self.accumulate = accumulate
        self.weights = weights
        self.microbatch = microbatch
        self.received = received  # the received tensors (leaves) of the transfers covered
        self.starts: list[Tensor] = []
        self.grads: list[Tensor] = []

    def add(self, starts: Sequence[Tensor], grads: Sequence[Tensor]) -> None:
        for t, g in zip(starts, grads, strict=True):
            if t.requires_grad:
                self.starts.append(t)
                self.grads.append(g)

    def run(self, last: bool = False) -> None:
        if not self.starts:
            return
        starts, grads, self.starts, self.grads = self.starts, self.grads, [], []
        if not self.weights:  # the input half: keep the starts for the weight half
            step = (starts, grads, self.received)
            self.ctx.weight_steps.setdefault(self.microbatch, []).append(step)
        # A later phase of this call may reach the same nodes (a tensor sent twice, with a
        # receive between the sends); the weight half runs them again. Otherwise the last
        # phase frees the graph's buffers as plain autograd does.
        retain = not (last and self.weights)
        inputs_only = not self.weights
        _engine(self.ctx, starts, grads, self.accumulate, retain, inputs_only, self.received)


def _engine(
    ctx: Context,
    starts: list[Tensor],
    grads: list[Tensor],
    accumulate: Accumulate,
    retain: bool,
    inputs_only: bool,
    received: list[Tensor],
) -> None:
    """Run the local engine from ``starts``: the received tensors' gradients always go to
    their ``.grad`` (the backward sends them from there); the other leaves' to ``.grad`` or
    to the context; ``inputs_only``: only the nodes between the starts and the received
    tensors run (no parameter's gradient)."""
    if accumulate == "grad" and not inputs_only:
        # (outputs, their gradients, keep_graph, create_graph, inputs, allow_unreachable,
        # accumulate_grad): torch.autograd.backward's own call, without its checks of the
        # gradients' shapes, which ours have by construction (12 us a phase, measured).
        _ENGINE.run_backward(tuple(starts), tuple(grads), retain, False, (), True, True)
        return
    own = {id(t) for t in received}
    leaves = [] if inputs_only else [t for t in _leaves(starts) if id(t) not in own]
    wanted = [*received, *leaves]
    if not wanted:
        return
    retain = retain or inputs_only
    found = _ENGINE.run_backward(
        tuple(starts), tuple(grads), retain, False, tuple(wanted), True, False
    )
    for t, grad in zip(received, found, strict=False):
        if grad is not None:
            t.grad = grad if t.grad is None else t.grad + grad
    for leaf, grad in zip(leaves, found[len(received) :], strict=True):
        if grad is not None:
            ctx.accumulate(leaf, grad)


def _leaves(starts: Sequence[Tensor]) -> list[Tensor]:
    """The leaves that require grad below ``starts``."""
    seen: set[object] = set()
    leaves: list[Tensor] = []
    stack: list[object] = [t.grad_fn for t in starts if t.grad_fn is not None]
    for t in starts:
        if t.grad_fn is None and t.requires_grad:
            leaves.append(t)  # a start that is itself a leaf
    while stack:
        node = stack.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        variable = getattr(node, "variable", None)
        if variable is not None:
            leaves.append(variable)
        stack.extend(n for n, _ in getattr(node, "next_functions", ()))
    return leaves


def _roots(
    roots: Sequence[Tensor], grad_tensors: Sequence[Tensor | None] | None
) -> tuple[list[Tensor], list[Tensor]]:
    if not roots:
        return [], []
    if isinstance(roots, Tensor):
        roots = [roots]
    if grad_tensors is None:
        grad_tensors = [None] * len(roots)
    elif isinstance(grad_tensors, Tensor):
        grad_tensors = [grad_tensors]
    if len(grad_tensors) != len(roots):
        raise PipelineError(
            f"dg.pipeline.backward: {len(roots)} roots but {len(grad_tensors)} grad_tensors; "
            "pass one gradient per root (None for a scalar root)"
        )
    grads: list[Tensor] = []
    for root, grad in zip(roots, grad_tensors, strict=True):
        if grad is None:
            if root.numel() != 1:
                raise PipelineError(
                    f"dg.pipeline.backward: a root of shape {tuple(root.shape)} needs its "
                    "gradient in grad_tensors (only a one-element root gets 1 by default)"
                )
            grad = torch.ones_like(root)
        grads.append(grad)
    return list(roots), grads


def _counts(records: Sequence[Record], kind: str) -> dict[tuple[tuple[int, str], int], int]:
    counts: dict[tuple[tuple[int, str], int], int] = {}
    for r in records:
        if r.kind == kind:
            key = (r.group.key, r.peer)
            counts[key] = counts.get(key, 0) + 1
    return counts


class _Described:
    """A backward transfer's name in errors, worded only when one needs it."""

    __slots__ = ("ctx", "rec")

    def __init__(self, ctx: Context, rec: Record) -> None:
        self.ctx, self.rec = ctx, rec

    def __str__(self) -> str:
        return f"the backward of dg.pipeline {self.rec.describe()} in context {self.ctx.context_id}"


def _post_gradient_receives(ctx: Context, records: Sequence[Record]) -> dict[Record, _GradientWait]:
    """Post, in reverse program order, a receive for the gradient of every send covered."""
    expected = _counts(records, "send")
    incoming: dict[Record, _GradientWait] = {}
    for rec in reversed(records):
        if rec.kind != "send":
            continue
        assert rec.tensor is not None
        g, what = rec.group, _Described(ctx, rec)
        buffer = torch.empty_like(rec.tensor, memory_format=torch.contiguous_format)
        checked = _wire.checked(g, rec.peer, "bwd-in", ctx.check)
        tag = _wire.tag(True, rec.slot)
        # Checked: the header alone now, the data once it matches (gloo aborts the process
        # when a message is larger than its buffer); otherwise the data at once.
        header = _wire.empty_header(buffer.device) if checked else None
        first = [(header, rec.peer)] if header is not None else []
        if header is None and buffer.numel():
            first = [(buffer, rec.peer)]
        pairs = start_pairs([], first, g, tag, what) if first else None
        count = expected[(g.key, rec.peer)]
        incoming[rec] = _GradientWait(pairs, buffer, header, rec, count, what)
    return incoming


@dataclass(slots=True)
class _GradientWait:
    """A send's gradient on its way: calling it waits, checks its header, returns it."""

    pairs: Pairs | None
    buffer: Tensor
    header: Tensor | None
    rec: Record
    count: int
    what: _Described

    def __call__(self) -> Tensor:
        if self.pairs is not None:
            self.pairs.wait()
        if self.header is not None:
            self._check()
            if self.buffer.numel():
                rec = self.rec
                tag = _wire.tag(True, rec.slot)
                start_pairs([], [(self.buffer, rec.peer)], rec.group, tag, self.what).wait()
        return self.buffer

    def _check(self) -> None:
        rec, g = self.rec, self.rec.group
        assert self.header is not None
        got = _wire.decode(self.header, op=self.what, group=g, peer=rec.peer)
        problem = None
        if got.count != self.count:
            problem = (
                f"rank {rec.peer}'s backward sends {got.count} gradient(s) to this rank, "
                f"where this rank's backward covers {self.count} transfer(s) to rank {rec.peer}"
            )
        elif got.slot != rec.slot or got.microbatch != rec.microbatch:
            problem = (
                f"rank {rec.peer}'s backward sends the gradient of its transfer {got.slot} "
                f"(microbatch {got.microbatch}) where this rank waits for transfer {rec.slot} "
                f"(microbatch {rec.microbatch})"
            )
        elif got.shape != tuple(self.buffer.shape):
            problem = f"the gradient from rank {rec.peer} has shape {got.shape}"
        if problem is not None:
            raise CollectiveMismatchError(
                f"{self.what} on rank {g.rank}: {problem}; the two ranks' backward calls do "
                "not cover the same transfers (same microbatch= labels, the same calls in "
                "the same order on both ranks)"
            )


def _send_gradient(ctx: Context, rec: Record, records: Sequence[Record]) -> None:
    """Send a received tensor's gradient, now complete, to its sender; left in flight."""
    assert rec.tensor is not None
    g, what = rec.group, _Described(ctx, rec)
    grad, rec.tensor.grad = rec.tensor.grad, None
    if grad is None:  # it reached no root: the sender still waits for one message
        grad = torch.zeros_like(rec.tensor, memory_format=torch.contiguous_format)
    else:
        grad = grad.contiguous()
    sends: list[tuple[Tensor, int]] = []
    if _wire.checked(g, rec.peer, "bwd-out", ctx.check):
        count = sum(
            r.kind == "recv" and r.group.key == g.key and r.peer == rec.peer for r in records
        )
        header = _wire.encode(
            grad.shape, grad.dtype, False, rec.slot, rec.microbatch, count, op=what, group=g
        )
        sends.append((header.to(grad.device), rec.peer))
    if grad.numel():
        sends.append((grad, rec.peer))
    rec.tensor = None
    if sends:
        ctx.keep(start_pairs(sends, [], g, _wire.tag(True, rec.slot), what))
