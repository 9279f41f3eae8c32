"""SMART's lineage: every send, on every worker, whose gradient can reach a pass's roots.

The root finds the recv nodes its roots reach. Each recv names a send on another worker; the
root asks that worker (one query per worker per round, all in parallel) which recv nodes its
sends reach, and so on until no new send turns up. What each send reaches is found by walking
that worker's graph from the send's tensors once, and kept in the send record.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from distgrad.rpc import _identity, _local, _transport
from distgrad.rpc._context import DistAutogradContext, counters, lookup
from distgrad.rpc._pass import as_backward_error
from distgrad.rpc._records import SendRecord, node_of
from distgrad.rpc._wire import Lineage, LineageQuery

__all__ = ["find", "receive", "send_reach"]


def send_reach(ctx: DistAutogradContext, record: SendRecord) -> dict[int, Any]:
    """Every node of this worker that ``record``'s gradients can reach (id -> node)."""
    if record.reach is None:
        found = _local.walk(node_of(t) for t in record.targets)
        record.reach = found.nodes
        record.recvs_reached = [
            (n.message_id, ctx.recvs[n.message_id].from_worker) for n in found.recvs
        ]
    return record.reach


def _recvs_reached(ctx: DistAutogradContext, send_ids: list[int]) -> list[tuple[int, str]]:
    found: set[tuple[int, str]] = set()
    with ctx.lock:
        for send_id in send_ids:
            record = ctx.sends[send_id]
            send_reach(ctx, record)
            assert record.recvs_reached is not None
            found.update(record.recvs_reached)
    return sorted(found)


def receive(query: LineageQuery) -> list[tuple[int, str]]:
    """RPC handler: the ``(recv id, sender)`` pairs that these sends reach on this worker."""
    return _recvs_reached(lookup(query.context_id), query.send_ids)


def find(ctx: DistAutogradContext, roots: list[Tensor], budget: float) -> Lineage:
    """The lineage of ``roots`` (breadth first over workers)."""
    me = _identity.worker_name()
    recvs = _local.walk(r.grad_fn for r in roots).recvs
    lineage: dict[str, set[int]] = {}
    frontier: dict[str, set[int]] = {}
    for node in recvs:
        frontier.setdefault(ctx.recvs[node.message_id].from_worker, set()).add(node.message_id)
    while frontier:
        futures = []
        for worker, ids in frontier.items():
            lineage.setdefault(worker, set()).update(ids)
            futures.append((worker, _query(ctx, worker, me, sorted(ids), budget)))
        found: list[tuple[int, str]] = []
        for worker, fut in futures:
            try:
                found.extend(fut.wait())
            except Exception as exc:
                raise as_backward_error(exc, worker, delivering=True) from None
        frontier = {}
        for recv_id, sender in found:
            if recv_id not in lineage.get(sender, set()):
                frontier.setdefault(sender, set()).add(recv_id)
    return {w: frozenset(ids) for w, ids in lineage.items()}


def _query(ctx: DistAutogradContext, worker: str, me: str, ids: list[int], budget: float) -> Any:
    if worker == me:
        fut: Any = torch.futures.Future()
        fut.set_result(_recvs_reached(ctx, ids))
        return fut
    counters["lineage_messages_sent"] += 1
    return _transport.call_async(worker, receive, (LineageQuery(ctx.context_id, ids),), budget)
