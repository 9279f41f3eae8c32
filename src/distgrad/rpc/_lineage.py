"""SMART's lineage: every send, on every worker, whose gradient can reach a pass's roots.

Most sends carry their own lineage, found when they were sent (``send_recv``): the sends their
gradients reach, on every worker. The root then has the lineage from the recvs its roots reach
without asking anyone. Where a lineage was too large to carry, the root asks the send's worker
which recvs the send reaches (one query per worker per round, all in parallel), and so on
until no new send turns up. What a send reaches is found by walking that worker's graph from
the send's tensors once, and kept in the send record.
"""

from __future__ import annotations

import torch
from torch import Tensor
from torch.autograd.graph import Node
from torch.futures import Future

from distgrad.rpc import _identity, _local, _transport
from distgrad.rpc._context import DistAutogradContext, counters, lookup
from distgrad.rpc._pass import as_backward_error
from distgrad.rpc._records import Lineage, SendRecord, node_of
from distgrad.rpc._wire import LineageQuery
from distgrad.rpc.send_recv import message_id_of

__all__ = ["find", "receive", "send_reach"]


Found = tuple[int, str, "Lineage | None"]  # a recv reached: its id, its sender, their lineage


def send_reach(ctx: DistAutogradContext, record: SendRecord) -> dict[int, Node]:
    """Every node of this worker that ``record``'s gradients can reach (id -> node)."""
    if record.reach is None:
        found = _local.walk(node_of(t) for t in record.targets)
        record.reach = found.nodes
        record.recvs_reached = [
            (mid, ctx.recvs[mid].from_worker) for mid in map(message_id_of, found.recvs)
        ]
    return record.reach


def _recvs_reached(ctx: DistAutogradContext, send_ids: list[int]) -> list[Found]:
    found: dict[int, Found] = {}
    with ctx.lock:
        for send_id in send_ids:
            record = ctx.sends[send_id]
            send_reach(ctx, record)
            assert record.recvs_reached is not None
            for recv_id, sender in record.recvs_reached:
                found[recv_id] = (recv_id, sender, ctx.recvs[recv_id].lineage)
    return list(found.values())


def receive(query: LineageQuery) -> list[Found]:
    """RPC handler: the recvs that these sends reach on this worker, with their lineage."""
    return _recvs_reached(lookup(query.context_id), query.send_ids)


def find(ctx: DistAutogradContext, roots: list[Tensor], budget: float) -> Lineage:
    """The lineage of ``roots``: from what the recvs they reach carry, asking where needed."""
    me = _identity.worker_name()
    lineage: dict[str, set[int]] = {}
    frontier: dict[str, set[int]] = {}  # sends whose lineage must be asked for

    def add(recv_id: int, sender: str, carried: Lineage | None) -> None:
        if recv_id in lineage.get(sender, ()):
            return
        lineage.setdefault(sender, set()).add(recv_id)
        if carried is None:
            frontier.setdefault(sender, set()).add(recv_id)
            return
        for worker, ids in carried.items():  # complete: no need to follow these
            lineage.setdefault(worker, set()).update(ids)

    with ctx.lock:
        for node in _local.walk(r.grad_fn for r in roots).recvs:
            record = ctx.recvs[message_id_of(node)]
            add(record.message_id, record.from_worker, record.lineage)
    while frontier:
        asked, frontier = frontier, {}
        futures = [(w, _query(ctx, w, me, sorted(ids), budget)) for w, ids in asked.items()]
        for worker, fut in futures:
            try:
                for recv_id, sender, carried in fut.wait():
                    add(recv_id, sender, carried)
            except Exception as exc:
                raise as_backward_error(exc, worker, delivering=True) from None
    return {w: frozenset(ids) for w, ids in lineage.items()}


def _query(
    ctx: DistAutogradContext, worker: str, me: str, ids: list[int], budget: float
) -> Future[list[Found]]:
    if worker == me:
        fut: Future[list[Found]] = torch.futures.Future()
        fut.set_result(_recvs_reached(ctx, ids))
        return fut
    counters["lineage_messages_sent"] += 1
    return _transport.call_async(worker, receive, (LineageQuery(ctx.context_id, ids),), budget)
