"""SMART mode: only what reaches the roots runs, and every node runs once per pass.

Two steps per backward pass:

1. **Lineage** (``_lineage``): every send, on every worker, whose gradient can reach the roots.
2. **Execution.** Gradient messages carry the lineage, so a worker knows which of its sends
   will still receive a gradient in this pass (its *pending* sends). Every node that a pending
   send can reach is *blocked*: a gradient flowing into it is cut off (a post-hook on the node
   it comes from takes it and sends ``None`` on) and kept, summed per graph edge, until every
   pending send above it has delivered. A node none of whose paths leads to a leaf or a recv
   except through blocked nodes waits the same way. Everything else runs, in one engine call
   per arrival; a recv node runs once, with its whole gradient, and ships it (one message per
   recv in the lineage; after a worker's last pending send has delivered, a recv of the
   lineage that got no gradient ships ``None``s, so every worker's count of pending sends is
   exact). As in FAST, a message bound for the worker whose message is being answered rides
   back in the answer.

Why it terminates: a node waits only for sends recorded after it in the forward pass, and a
send's gradient depends only on computation recorded after that send; causality orders the
waits, so no cycle of waits exists. Workers outside the lineage receive no message at all.
"""

from __future__ import annotations

import contextlib

from torch import Tensor
from torch.autograd.graph import GradientEdge, Node

from distgrad.errors import RpcAutogradError
from distgrad.rpc import _identity, _lineage, _local, _transport
from distgrad.rpc._context import DistAutogradContext, PassState, counters, lookup
from distgrad.rpc._local import Cut, Walk
from distgrad.rpc._pass import Pass, deadline_after, drain, in_flight, pass_error, phase, ship
from distgrad.rpc._records import Lineage, RecvRecord, edge_of, node_of
from distgrad.rpc._wire import AbortPass, GradientMessage, Reply
from distgrad.rpc.send_recv import is_recv_node, message_id_of

__all__ = ["receive", "run_from_roots"]

Key = tuple[int, int]  # (id(node), input number): one graph edge into a node
Entry = tuple[Node, int, Tensor]  # a gradient entering a node along its input ``nr``


class SmartState(PassState):
    """One worker's state for one SMART pass (kept in the context until nothing is pending)."""

    def __init__(self, pass_id: int, me: str, lineage: Lineage, retain_graph: bool) -> None:
        super().__init__(pass_id)
        self.lineage = lineage
        self.retain_graph = retain_graph
        self.pending = set(lineage.get(me, frozenset()))  # sends whose gradient has not come
        self.held: dict[Key, Entry] = {}  # gradients waiting at an edge
        self.shipped: set[int] = set()  # recv ids already shipped in this pass
        self.foreign: frozenset[int] = frozenset()  # memory of gradients the user passed in
        self.recvs_here: list[RecvRecord] | None = None

    def hold_below(self, parent: Node, position: int, grad: Tensor) -> None:
        """Hold the gradient ``parent`` sends along its ``position``-th edge."""
        node, nr = parent.next_functions[position]
        assert node is not None  # only edges into a node are cut (see _run)
        self.hold(node, nr, grad)

    def hold(self, node: Node, nr: int, grad: Tensor) -> None:
        key = (id(node), nr)
        kept = self.held.get(key)
        self.held[key] = (node, nr, grad if kept is None else kept[2] + grad)


class SmartPass(Pass):
    """A SMART worker part: ships each recv of the lineage exactly once."""

    def __init__(
        self,
        state: SmartState,
        ctx: DistAutogradContext,
        deadline: float,
        reply_to: str | None = None,
    ) -> None:
        super().__init__(
            ctx, state.pass_id, deadline, receive, reply_to, state.lineage, state.retain_graph
        )
        self.state = state

    def take(self, record: RecvRecord, grads: list[Tensor | None]) -> None:
        sent = self.state.lineage.get(record.from_worker, frozenset())
        assert record.message_id in sent, f"SMART: recv {record.message_id} is not in the lineage"
        assert record.message_id not in self.state.shipped, "SMART: a recv shipped twice"
        self.state.shipped.add(record.message_id)
        ship(self, record, grads)


def run_from_roots(
    ctx: DistAutogradContext,
    pass_id: int,
    budget: float,
    roots: list[Tensor],
    grads: list[Tensor],
    retain_graph: bool,
    foreign: frozenset[int],
) -> None:
    """The root's side of a SMART pass; ``foreign``: memory of gradients the user passed in."""
    me = _identity.worker_name()
    deadline = deadline_after(budget)
    try:
        lineage = _lineage.find(ctx, roots, budget)
    except Exception as exc:
        raise pass_error(exc, me) from None
    state = SmartState(pass_id, me, lineage, retain_graph)
    state.foreign = foreign
    with ctx.lock:
        ctx.pass_states[pass_id] = state
    active = SmartPass(state, ctx, deadline)
    try:
        starts = [(node_of(r), r.output_nr, g) for r, g in zip(roots, grads, strict=True)]
        _deliver(ctx, state, active, starts)
        if state.pending:  # every part of the pass has answered: nothing can arrive any more
            raise RpcAutogradError(
                f"SMART pass {pass_id} ended with sends {sorted(state.pending)} of {me} still "
                "waiting for gradients (a distgrad bug: please report it)"
            )
    except Exception as exc:
        _abort(ctx.context_id, pass_id, lineage)
        raise pass_error(exc, me) from None


def receive(message: GradientMessage) -> list[Reply]:
    """RPC handler: the gradient for one of this worker's sends in a SMART pass.

    Returns the gradients this worker's part produced for the sender's own sends.
    """
    me = _identity.worker_name()
    counters["gradient_messages_received"] += 1
    try:
        ctx = lookup(message.context_id)
        assert message.lineage is not None
        with ctx.lock:
            state = ctx.pass_states.get(message.pass_id)
            if state is None:
                if message.pass_id in ctx.aborted_passes:
                    raise RpcAutogradError(f"backward pass {message.pass_id} was aborted")
                state = SmartState(message.pass_id, me, message.lineage, message.retain_graph)
                ctx.pass_states[message.pass_id] = state
            assert isinstance(state, SmartState)
            _accept(ctx, state, Reply(message.message_id, message.grads))
        active = SmartPass(state, ctx, deadline_after(message.budget), message.sender)
        _deliver(ctx, state, active, [])
        return active.replies
    except Exception as exc:
        raise pass_error(exc, me) from None


def _accept(ctx: DistAutogradContext, state: SmartState, reply: Reply) -> None:
    """Mark ``sends[reply.message_id]`` delivered and hold its gradients where they enter.

    One step under the context's lock: a send that is no longer pending must have its
    gradients held, or another part's progress would run the nodes below it without them.
    """
    if reply.message_id not in state.pending:
        raise RpcAutogradError(
            f"send {reply.message_id} is not pending in pass {state.pass_id} (delivered twice?)"
        )
    state.pending.discard(reply.message_id)
    record = ctx.sends[reply.message_id]
    for target, grad in zip(record.targets, reply.grads, strict=True):
        if grad is not None:
            edge = edge_of(target)
            state.hold(edge.node, edge.output_nr, grad)


def _deliver(
    ctx: DistAutogradContext,
    state: SmartState,
    active: SmartPass,
    entries: list[Entry],
) -> None:
    """Hold the gradients at ``entries``, run what is ready, then wait for what that shipped."""
    with in_flight(ctx):
        with phase(ctx, active):
            try:
                for node, nr, grad in entries:
                    state.hold(node, nr, grad)
                _progress(ctx, state, active)
            except BaseException:
                ctx.pass_states.pop(state.pass_id, None)
                raise
        drain(ctx, active, _take_reply)


def _take_reply(ctx: DistAutogradContext, active: Pass, reply: Reply) -> None:
    """The gradients for ``sends[reply.message_id]`` came back in an answer: add them."""
    assert isinstance(active, SmartPass)
    state = active.state
    with phase(ctx, active):
        if ctx.pass_states.get(state.pass_id) is not state:
            raise RpcAutogradError(f"backward pass {state.pass_id} is not running here")
        _accept(ctx, state, reply)
        _progress(ctx, state, active)


def _progress(ctx: DistAutogradContext, state: SmartState, active: SmartPass) -> None:
    """Run every held gradient that no pending send can still add to (one engine call), then
    ship ``None``s for the lineage's recvs here that no gradient can reach any more; once
    nothing is pending, drop the pass's state. Holds the context's lock."""
    blocked: dict[int, Node] = {}
    blocked_recvs: set[int] = set()
    for send_id in state.pending:
        record = ctx.sends[send_id]
        blocked.update(_lineage.send_reach(ctx, record))
        blocked_recvs.update(mid for mid, _ in record.recvs_reached or ())
    ready = [k for k, (node, _, _) in state.held.items() if id(node) not in blocked]
    if ready:
        found = _local.walk((state.held[k][0] for k in ready), blocked)
        live = _live(found)
        starts = [k for k in ready if id(state.held[k][0]) in live]
        if starts:
            _run(ctx, state, active, found, live, [state.held.pop(k) for k in starts])
    # What is still held waits at nodes that only lead to blocked ones, so a recv that is not
    # blocked and has not shipped gets nothing in this pass: its sender must not wait for it.
    for recv in _recvs_here(ctx, state):
        if recv.message_id not in state.shipped and recv.message_id not in blocked_recvs:
            active.take(recv, [None] * recv.num_outputs)
    if not state.pending:
        state.held.clear()  # gradients into nodes that lead nowhere
        ctx.pass_states.pop(state.pass_id, None)


def _recvs_here(ctx: DistAutogradContext, state: SmartState) -> list[RecvRecord]:
    """The recvs of this worker whose sends take part in the pass (found once per pass)."""
    if state.recvs_here is None:
        state.recvs_here = [
            r
            for r in ctx.recvs.values()
            if r.message_id in state.lineage.get(r.from_worker, frozenset())
        ]
    return state.recvs_here


def _run(
    ctx: DistAutogradContext,
    state: SmartState,
    active: SmartPass,
    found: Walk,
    live: set[int],
    starts: list[Entry],
) -> None:
    """Run the live nodes once. Without held edges below them this is an ordinary engine call
    (recv nodes run and ship; leaves' AccumulateGrad nodes and their hooks run); otherwise
    the engine stops at the held edges (``_local.capture``) and the recvs' gradients are
    shipped from what it captured."""
    cuts: list[Cut] = []
    held: dict[Key, GradientEdge] = {}
    for key in live:
        node = found.nodes[key]
        if is_recv_node(node):
            continue  # it leads only to the anchor, which gets nothing
        at = [i for i, (n, _) in enumerate(node.next_functions) if n and id(n) not in live]
        if at:
            cuts.append((node, at, state.hold_below))
            for i in at:
                below, nr = node.next_functions[i]
                assert below is not None  # ``at`` holds only edges into a node
                held[(id(below), nr)] = GradientEdge(below, nr)
    edges = [GradientEdge(node, nr) for node, nr, _ in starts]
    grads = [grad for _, _, grad in starts]
    if not cuts:
        recvs = [GradientEdge(node, 0) for node in found.recvs]
        taken = _local.run(
            edges, grads, found.leaves, recvs, keep_graph=state.retain_graph, ddp=ctx.ddp
        )
        ctx.store(taken, state.foreign)
        return
    slots = [(n, k) for n in found.recvs for k in range(ctx.recvs[message_id_of(n)].num_outputs)]
    inputs: list[Tensor | GradientEdge] = [leaf for leaf, _ in found.leaves]
    inputs += [GradientEdge(node, k) for node, k in slots]
    inputs += held.values()
    got = _local.capture(edges, grads, inputs, cuts, found.leaves, ctx.ddp)
    n_leaves = len(found.leaves)
    pairs = zip(found.leaves, got[:n_leaves], strict=True)
    ctx.store([(leaf, g) for (leaf, _), g in pairs if g is not None], state.foreign)
    shipped: dict[int, list[Tensor | None]] = {}
    for (node, _), grad in zip(slots, got[n_leaves:], strict=False):  # then the held edges
        shipped.setdefault(message_id_of(node), []).append(grad)
    for message_id, recv_grads in shipped.items():
        active.take(ctx.recvs[message_id], recv_grads)


def _live(found: Walk) -> set[int]:
    """The nodes of ``found`` with a path to one of its leaves or recvs (those that can run)."""
    live = {id(node) for _, node in found.leaves} | {id(node) for node in found.recvs}
    # Children before parents: a node is live when one of its children is.
    order: list[Node] = []
    seen: set[int] = set()
    for root in found.nodes.values():
        stack: list[tuple[Node, bool]] = [(root, False)]
        while stack:
            node, done = stack.pop()
            if done:
                order.append(node)
                continue
            if id(node) in seen:
                continue
            seen.add(id(node))
            stack.append((node, True))
            if id(node) not in live:
                stack.extend(
                    (n, False) for n, _ in node.next_functions if n and id(n) in found.nodes
                )
    for node in order:
        if id(node) not in live and any(id(n) in live for n, _ in node.next_functions if n):
            live.add(id(node))
    return live


def _abort_here(message: AbortPass) -> None:
    try:
        ctx = lookup(message.context_id)
    except RpcAutogradError:
        return
    with ctx.lock:
        ctx.pass_states.pop(message.pass_id, None)
        ctx.aborted_passes.add(message.pass_id)


def _abort(context_id: int, pass_id: int, lineage: Lineage) -> None:
    """After a failure, drop the pass's state on every worker of the lineage (best effort)."""
    me = _identity.worker_name()
    message = AbortPass(context_id, pass_id)
    _abort_here(message)
    futures = [_transport.call_async(w, _abort_here, (message,), 5.0) for w in lineage if w != me]
    for fut in futures:
        with contextlib.suppress(Exception):  # a dead worker has no state left to drop
            fut.wait()
