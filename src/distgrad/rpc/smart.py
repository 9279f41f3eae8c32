"""SMART-mode distributed backward: only what reaches the roots runs, each node once.

Two steps per backward pass:

1. **Lineage.** The root worker finds the recv nodes its roots reach. Each recv names a send on
   another worker; the root asks that worker (one RPC per worker per round, all in parallel)
   which recv nodes its sends reach, and so on until no new send turns up. The result, per
   worker, is the set of sends that take part in this pass: the global lineage of the roots.
2. **Execution.** Gradient messages carry the lineage. A worker knows which of its sends will
   receive a gradient (its *pending* sends) and never runs a node that a pending send can still
   reach: the gradient flowing into such a node is kept, per graph edge, until every pending
   send above it has delivered. Then the node runs once with the summed gradient. Recv nodes
   are not run: the gradient flowing into them is captured and shipped, one message per recv
   in the lineage, so the receiving worker's count of pending sends is exact. As in FAST mode,
   a message bound for the worker whose message is being answered rides back in the answer
   instead, and that worker adds it to its pass when the answer arrives.

Why it terminates: a node waits only for sends recorded after it in the forward pass, and a
send's gradient depends only on computation recorded after that send; causality orders the
waits, so no cycle of waits exists. Workers outside the lineage receive no message at all.

Cost: ``depth`` rounds of lineage queries (one RPC per worker per round) before any gradient
moves, plus one gradient message per recv in the lineage except those that ride back in
answers (as FAST), and graph walks whose cost is linear in the size of the local graphs.
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor
from torch.autograd.graph import GradientEdge, get_gradient_edge
from torch.distributed import rpc as torch_rpc

from distgrad.errors import RpcAutogradError
from distgrad.rpc import _agent
from distgrad.rpc.context import DistAutogradContext, _Pass, counters, lookup
from distgrad.rpc.fast import (
    _HOP_MARGIN_S,
    Reply,
    _as_backward_error,
    _drain,
    ride_back,
    with_owned_gradients,
)
from distgrad.rpc.send_recv import SendRecord, edge_of, is_recv_node

__all__ = ["smart_backward"]

Lineage = dict[str, frozenset[int]]  # worker name -> ids of its sends that take part


@dataclass
class _SmartPass:
    """One worker's state for one SMART pass."""

    pending: set[int]  # sends in the lineage whose gradient has not arrived
    retain_graph: bool
    lineage: Lineage
    buffer: dict[tuple[int, int], tuple[GradientEdge, Tensor]] = field(default_factory=dict)
    shipped: set[int] = field(default_factory=set)  # recv ids already shipped


def _walk(starts: list[Any], blocked: dict[int, Any]) -> tuple[dict[int, Any], list[Any]]:
    """Nodes reachable from ``starts`` without entering ``blocked``; and the recv nodes met.

    Recv nodes are not descended into (below them lies only the context's anchor).
    """
    seen: dict[int, Any] = {}
    recvs: list[Any] = []
    stack = [n for n in starts if n is not None]
    while stack:
        node = stack.pop()
        if id(node) in seen or id(node) in blocked:
            continue
        seen[id(node)] = node
        if is_recv_node(node):
            recvs.append(node)
            continue
        stack.extend(n for n, _ in node.next_functions if n is not None)
    return seen, recvs


def _send_reach(ctx: DistAutogradContext, record: SendRecord) -> dict[int, Any]:
    if record.reach is None:
        starts = [edge_of(t).node for t in record.targets]
        record.reach, recvs = _walk(starts, {})
        record.recvs_reached = [(n.message_id, ctx.recvs[n.message_id].from_worker) for n in recvs]
    return record.reach


def _reach_of_sends(context_id: int, send_ids: list[int]) -> list[tuple[int, str]]:
    """RPC handler (lineage query): the recvs that these sends reach on this worker."""
    ctx = lookup(context_id)
    found: set[tuple[int, str]] = set()
    with ctx.lock:
        for send_id in send_ids:
            record = ctx.sends[send_id]
            _send_reach(ctx, record)
            assert record.recvs_reached is not None
            found.update(record.recvs_reached)
    return sorted(found)


def _lineage(ctx: DistAutogradContext, roots: list[Tensor], budget: float) -> Lineage:
    """Every send, on every worker, whose gradient can reach ``roots`` (breadth first)."""
    me = _agent.worker_name()
    _, recvs = _walk([r.grad_fn for r in roots], {})
    lineage: dict[str, set[int]] = {}
    frontier = _by_sender(ctx, [n.message_id for n in recvs], lineage)
    while frontier:
        futures = []
        for worker, ids in frontier.items():
            lineage.setdefault(worker, set()).update(ids)
            if worker == me:
                fut: Any = torch.futures.Future()
                fut.set_result(_reach_of_sends(ctx.context_id, sorted(ids)))
            else:
                counters["lineage_messages_sent"] += 1
                fut = torch_rpc.rpc_async(
                    worker, _reach_of_sends, args=(ctx.context_id, sorted(ids)), timeout=budget
                )
            futures.append((worker, fut))
        found: list[tuple[int, str]] = []
        _wait_all_collect(futures, found)
        frontier = {}
        for recv_id, sender in found:
            if recv_id not in lineage.get(sender, set()):
                frontier.setdefault(sender, set()).add(recv_id)
    return {w: frozenset(ids) for w, ids in lineage.items()}


def _by_sender(
    ctx: DistAutogradContext, recv_ids: list[int], lineage: dict[str, set[int]]
) -> dict[str, set[int]]:
    frontier: dict[str, set[int]] = {}
    for recv_id in recv_ids:
        sender = ctx.recvs[recv_id].from_worker
        frontier.setdefault(sender, set()).add(recv_id)
    return frontier


def _wait_all_collect(futures: list[tuple[str, Any]], into: list[tuple[int, str]]) -> None:
    for worker, fut in futures:
        try:
            into.extend(fut.wait())
        except Exception as exc:
            raise _as_backward_error(exc, worker, delivering=True) from None


def smart_backward(
    ctx: DistAutogradContext,
    pass_id: int,
    budget: float,
    roots: list[Tensor],
    grads: list[Tensor],
    retain_graph: bool,
) -> None:
    """The root's side of a SMART pass (see the module docstring)."""
    me = _agent.worker_name()
    deadline = time.monotonic() + budget
    try:
        lineage = _lineage(ctx, roots, budget)
    except RpcAutogradError:
        raise
    except Exception as exc:
        raise _as_backward_error(exc, me) from None
    state = _SmartPass(set(lineage.get(me, frozenset())), retain_graph, lineage)
    with ctx.lock:
        ctx.smart_passes[pass_id] = state
    edges = [(get_gradient_edge(r), g) for r, g in zip(roots, grads, strict=True)]
    try:
        _deliver(ctx, pass_id, deadline, state, edges)
    except Exception as exc:
        _abort(ctx.context_id, pass_id, lineage)
        if isinstance(exc, RpcAutogradError):
            raise
        raise _as_backward_error(exc, me) from None


def _deliver(
    ctx: DistAutogradContext,
    pass_id: int,
    deadline: float,
    state: _SmartPass,
    edges: list[tuple[GradientEdge, Tensor]],
    reply_to: str | None = None,
) -> list[Reply]:
    """Add gradients at ``edges``, run what is ready, then wait for what that shipped.

    Gradients bound for ``reply_to`` (the worker whose message this answers) are returned, to
    ride back in the answer, as in FAST mode.
    """
    active = _Pass(pass_id, deadline=deadline, reply_to=reply_to)
    with ctx.lock:
        ctx.passes_in_flight += 1
        try:
            for edge, grad in edges:
                _buffer(state, edge, grad)
            _progress_and_finish(ctx, state, active)
        except BaseException:
            ctx.smart_passes.pop(pass_id, None)
            ctx.passes_in_flight -= 1
            raise
    try:
        _drain(ctx, active, _take_reply)
    finally:
        with ctx.lock:
            ctx.passes_in_flight -= 1
    return active.replies


def _progress_and_finish(ctx: DistAutogradContext, state: _SmartPass, active: _Pass) -> None:
    """Run what is ready; drop the pass's state here once no send of it is pending."""
    _progress(ctx, state, active)
    if not state.pending:
        assert not state.buffer, "SMART: gradients left over with nothing pending"
        ctx.smart_passes.pop(active.pass_id, None)


def _accept(
    ctx: DistAutogradContext,
    state: _SmartPass,
    pass_id: int,
    message_id: int,
    grads: list[Tensor | None],
) -> list[tuple[GradientEdge, Tensor]]:
    """Mark ``sends[message_id]`` delivered; the edges where its gradients enter. Holds the lock."""
    if message_id not in state.pending:
        raise RpcAutogradError(
            f"send {message_id} is not pending in pass {pass_id} (delivered twice?)"
        )
    state.pending.discard(message_id)
    record = ctx.sends[message_id]
    return [(edge_of(t), g) for t, g in zip(record.targets, grads, strict=True) if g is not None]


def _take_reply(
    ctx: DistAutogradContext, active: _Pass, message_id: int, grads: list[Tensor | None]
) -> None:
    """The gradients for ``sends[message_id]`` came back in an answer: add them to the pass."""
    with ctx.lock:
        state = ctx.smart_passes.get(active.pass_id)
        if state is None:
            raise RpcAutogradError(f"backward pass {active.pass_id} is not running here")
        for edge, grad in _accept(ctx, state, active.pass_id, message_id, grads):
            _buffer(state, edge, grad)
        _progress_and_finish(ctx, state, active)


def _buffer(state: _SmartPass, edge: GradientEdge, grad: Tensor) -> None:
    key = (id(edge.node), edge.output_nr)
    held = state.buffer.get(key)
    state.buffer[key] = (edge, grad if held is None else held[1] + grad)


def _progress(ctx: DistAutogradContext, state: _SmartPass, active: _Pass) -> None:
    """Run every buffered gradient that no pending send can still add to (one engine call)."""
    blocked: dict[int, Any] = {}
    for send_id in state.pending:
        blocked.update(_send_reach(ctx, ctx.sends[send_id]))
    ready = [(e, g) for e, g in state.buffer.values() if id(e.node) not in blocked]
    if not ready:
        return
    for e, _ in ready:
        del state.buffer[(id(e.node), e.output_nr)]
    captured: dict[int, list[Tensor | None]] = {}  # recv id -> gradients of its outputs
    # Leaves and recv outputs go through the engine too, so their tensor hooks run.
    _run_engine(ctx, state, [e for e, _ in ready], [g for _, g in ready], blocked, captured)
    for recv_id, recv_grads in captured.items():
        _ship(ctx, state, active, recv_id, recv_grads)


def _capture(
    ctx: DistAutogradContext,
    captured: dict[int, list[Tensor | None]],
    node: Any,
    output_nr: int,
    grad: Tensor | None,
) -> None:
    slots = captured.setdefault(node.message_id, [None] * ctx.recvs[node.message_id].num_outputs)
    if grad is not None:
        held = slots[output_nr]
        slots[output_nr] = grad if held is None else held + grad


def _run_engine(
    ctx: DistAutogradContext,
    state: _SmartPass,
    outputs: list[GradientEdge],
    grads: list[Tensor],
    blocked: dict[int, Any],
    captured: dict[int, list[Tensor | None]],
) -> None:
    """One local engine call from ``outputs``, stopping at recv nodes and blocked nodes."""
    seen, recvs = _walk([e.node for e in outputs], blocked)
    leaves: list[Tensor] = []
    boundary: list[GradientEdge] = []
    boundary_keys: set[tuple[int, int]] = set()
    for node in seen.values():
        variable = getattr(node, "variable", None)
        if isinstance(variable, Tensor):
            leaves.append(variable)
            continue
        if is_recv_node(node):
            continue
        for nxt, nr in node.next_functions:
            if nxt is not None and id(nxt) in blocked and (id(nxt), nr) not in boundary_keys:
                boundary_keys.add((id(nxt), nr))
                boundary.append(GradientEdge(nxt, nr))
    recv_edges = [
        (node, k) for node in recvs for k in range(ctx.recvs[node.message_id].num_outputs)
    ]
    inputs: list[Any] = [
        *leaves,
        *(GradientEdge(node, k) for node, k in recv_edges),
        *boundary,
    ]
    counters["engine_runs"] += 1
    found = torch.autograd.grad(
        outputs, inputs, grads, retain_graph=state.retain_graph, allow_unused=True
    )
    given = {id(g) for g in grads}
    it = iter(found)
    for leaf in leaves:
        grad = next(it)
        if grad is not None:
            ctx.accumulate(leaf, grad.clone() if id(grad) in given else grad)
    for node, k in recv_edges:
        _capture(ctx, captured, node, k, next(it))
    for edge in boundary:
        grad = next(it)
        if grad is not None:
            _buffer(state, edge, grad)


def _ship(
    ctx: DistAutogradContext,
    state: _SmartPass,
    active: _Pass,
    recv_id: int,
    grads: list[Tensor | None],
) -> None:
    assert recv_id not in state.shipped, f"SMART: recv {recv_id} shipped twice in one pass"
    state.shipped.add(recv_id)
    record = ctx.recvs[recv_id]
    if ride_back(active, record, grads):
        return
    budget = max(active.deadline - time.monotonic() - _HOP_MARGIN_S, 0.1)
    fut = torch_rpc.rpc_async(
        record.from_worker,
        _receive_smart,
        args=(
            ctx.context_id,
            recv_id,
            grads,
            active.pass_id,
            budget,
            state.lineage,
            state.retain_graph,
            _agent.worker_name(),
        ),
        timeout=budget,
    )
    active.outgoing.append((record.from_worker, fut.then(with_owned_gradients)))
    counters["gradient_messages_sent"] += 1


def _receive_smart(
    context_id: int,
    message_id: int,
    grads: list[Tensor | None],
    pass_id: int,
    budget: float,
    lineage: Lineage,
    retain_graph: bool,
    sender: str,
) -> list[Reply]:
    """RPC handler: the gradient for one of this worker's sends in a SMART pass.

    Returns the gradients this worker's part produced for ``sender``'s own sends.
    """
    me = _agent.worker_name()
    counters["gradient_messages_received"] += 1
    try:
        ctx = lookup(context_id)
        with ctx.lock:
            state = ctx.smart_passes.get(pass_id)
            if state is None:
                if pass_id in ctx.aborted_passes:
                    raise RpcAutogradError(f"backward pass {pass_id} was aborted")
                state = ctx.smart_passes[pass_id] = _SmartPass(
                    set(lineage.get(me, frozenset())), retain_graph, lineage
                )
            edges = _accept(ctx, state, pass_id, message_id, grads)
        return _deliver(ctx, pass_id, time.monotonic() + budget, state, edges, reply_to=sender)
    except Exception as exc:
        raise _as_backward_error(exc, me) from None


def _abort_here(context_id: int, pass_id: int) -> None:
    try:
        ctx = lookup(context_id)
    except RpcAutogradError:
        return
    with ctx.lock:
        ctx.smart_passes.pop(pass_id, None)
        ctx.aborted_passes.add(pass_id)


def _abort(context_id: int, pass_id: int, lineage: Lineage) -> None:
    """After a failure, drop the pass's state on every worker of the lineage (best effort)."""
    me = _agent.worker_name()
    _abort_here(context_id, pass_id)
    futures = [
        torch_rpc.rpc_async(w, _abort_here, args=(context_id, pass_id), timeout=5.0)
        for w in lineage
        if w != me
    ]
    for fut in futures:
        with contextlib.suppress(Exception):  # a dead worker has no state left to drop
            fut.wait()
