"""Running torch's local autograd engine for one backward phase, and walking local graphs.

A phase is one call of the engine in torch's ``backward`` mode: a node runs when it lies on a
path to a requested input (a leaf, the context's anchor below every recv node, or a recv
node's edge). The call goes to the engine directly: ``torch.autograd.grad``'s Python wrapper
re-checks every gradient's shape, about 65 us per call measured here, against 25 us for the
engine call itself; the shapes of gradients that distgrad passes are right by construction.

Leaves: their AccumulateGrad nodes run as in local autograd, so tensor hooks and the node's
own pre- and post-hooks run, but a pre-hook registered for the duration of the call takes the
gradient for the context and hands the node ``None`` instead, so ``.grad`` is never written
(torch's distributed engine does the same in C++ with a capture hook). The hooks act only on
the calling thread, which is where torch runs CPU nodes: a local backward that another thread
runs through the same leaf at the same moment is left alone.

Intra-op threads: every engine call, and every user function or optimizer step that distgrad
serves on an RPC thread, first applies the process's ``torch.set_num_threads`` setting to the
calling thread (:func:`use_process_threads`: ``torch._C.init_num_threads``, 0.07 us). The
count is kept per thread, and a thread takes the process's setting only when it first asks
for it (any op that may run in parallel does); until then BLAS uses its default count, and a
matrix product alone does not ask. So without this, the bits an RPC thread computes depend on
what that thread ran before: under ``torch.set_num_threads(1)`` on 2 cores, ``F.linear`` on a
(2, 5, 8) input differs in the last bit between a thread that has asked and one that has not,
and which of the agent's 16 threads serves a call depends on timing. The RNN program's
decoder output, so its LSTM update, differed between launches in 4 of 5. Earlier, an RPC
thread that ran a forward before the program called ``torch.set_num_threads(1)`` kept 2
threads, and a convolution's weight gradient differed from torch's engine's. torch's own agent
threads serve user functions as they are (docs/rpc.md, "Threads").

SMART also needs to stop the engine at chosen nodes, which torch's engine can only do in its
``grad`` mode (:func:`capture`): a node whose input is captured does not run unless another
captured node lies below it, and the node above it computes the gradient along the edge only
because the node is captured. Cuts, post-hooks on the nodes above, take those gradients and
send ``None`` on, so that a captured node that must run anyway (one with another captured
node below it) runs with nothing. In ``grad`` mode leaves are captured too, so their
AccumulateGrad nodes do not run (their post-hooks do not fire), and a captured node's tensor
hooks are called with what reaches it: ``None`` where a cut took the gradient.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Container, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor
from torch.autograd.graph import GradientEdge, Node
from torch.autograd.variable import Variable

from distgrad.rpc import _context
from distgrad.rpc._records import Leaf, Target
from distgrad.rpc._reductions import Reductions
from distgrad.rpc.send_recv import is_recv_node

__all__ = ["Cut", "Walk", "capture", "run", "use_process_threads", "walk"]

_engine: Any = Variable._execution_engine  # type: ignore[attr-defined]  # torch's C++ engine
_init_num_threads: Callable[[], None] = torch._C.init_num_threads  # type: ignore[attr-defined]

# (node, the positions of its next edges to cut, called with (node, position, gradient))
Cut = tuple[Node, Sequence[int], Callable[[Node, int, Tensor], None]]


def use_process_threads() -> None:
    """Give the calling thread the process's intra-op thread count (see the module docstring):
    called first by everything distgrad runs on an RPC thread."""
    _init_num_threads()


@dataclass
class Walk:
    """What lies below some nodes: every node met, the leaves, and the recv nodes.

    Recv nodes are not descended into (below them lies only the context's anchor)."""

    nodes: dict[int, Node] = field(default_factory=dict)
    leaves: list[Leaf] = field(default_factory=list)
    recvs: list[Node] = field(default_factory=list)


def walk(starts: Iterable[Node | None], blocked: Container[int] = ()) -> Walk:
    """Every node reachable from ``starts`` without entering a node whose id is ``blocked``."""
    found = Walk()
    stack = [n for n in starts if n is not None]
    while stack:
        node = stack.pop()
        key = id(node)
        if key in found.nodes or key in blocked:
            continue
        found.nodes[key] = node
        if is_recv_node(node):
            found.recvs.append(node)
            continue
        variable = getattr(node, "variable", None)
        if isinstance(variable, Tensor):
            found.leaves.append((variable, node))
            continue
        stack.extend(n for n, _ in node.next_functions if n is not None)
    return found


def run(
    starts: Sequence[Target],
    grads: Sequence[Tensor],
    leaves: Sequence[Leaf],
    more_inputs: Sequence[Tensor | GradientEdge] = (),
    *,
    keep_graph: bool = True,
    ddp: Reductions | None = None,
) -> list[tuple[Tensor, Tensor]]:
    """One engine call in ``backward`` mode from ``starts`` (given ``grads``); returns the
    leaves' gradients. The nodes that run are those on a path to one of ``leaves`` or
    ``more_inputs``. ``ddp``: the context's DDP modules; the parameters of those this call
    reaches get DDP's averaged gradients (see ``_ddp``).
    """
    me = threading.get_ident()
    taken: list[tuple[Tensor, Tensor]] = []
    reduction = ddp.begin(leaves, capturing=False) if ddp is not None else None
    through = reduction.through if reduction is not None else set()
    handles = [
        node.register_prehook(_taker(leaf, taken, me))
        for leaf, node in leaves
        if id(leaf) not in through
    ]
    inputs = (*(leaf for leaf, _ in leaves), *more_inputs)
    _context.counters["engine_runs"] += 1
    use_process_threads()
    try:
        if reduction is not None:
            reduction.__enter__()
        # (outputs, their gradients, keep_graph, create_graph, inputs, allow_unreachable,
        # accumulate_grad): torch's own torch.autograd.backward(..., inputs=...) call.
        _engine.run_backward(tuple(starts), tuple(grads), keep_graph, False, inputs, True, True)
        if reduction is not None:
            taken += reduction.finish()
    except BaseException:
        if reduction is not None:
            reduction.abort()
        raise
    finally:
        for handle in handles:
            handle.remove()
    return taken


def capture(
    starts: Sequence[Target],
    grads: Sequence[Tensor],
    inputs: Sequence[Tensor | GradientEdge],
    cuts: Sequence[Cut],
    leaves: Sequence[Leaf] = (),
    ddp: Reductions | None = None,
) -> tuple[Tensor | None, ...]:
    """One engine call in ``grad`` mode: the gradients reaching ``inputs`` (leaves or edges).

    The graph is kept: a captured node with another captured node below it runs (with the
    ``None`` its cuts leave it), and must run again later with its real gradient. DDP's hooks
    do not run here: ``leaves`` reaching a DDP module of ``ddp`` raise (see ``_ddp``).
    """
    if ddp is not None:
        ddp.begin(leaves, capturing=True)
    me = threading.get_ident()
    handles = [node.register_hook(_cutter(node, at, call, me)) for node, at, call in cuts]
    _context.counters["engine_runs"] += 1
    use_process_threads()
    try:
        found: tuple[Tensor | None, ...] = _engine.run_backward(
            tuple(starts), tuple(grads), True, False, tuple(inputs), True, False
        )
    finally:
        for handle in handles:
            handle.remove()
    return found


def _taker(
    leaf: Tensor, taken: list[tuple[Tensor, Tensor]], me: int
) -> Callable[[tuple[Tensor | None, ...]], tuple[None] | None]:
    def take(grad_outputs: tuple[Tensor | None, ...]) -> tuple[None] | None:
        if threading.get_ident() != me:
            return None  # another thread's backward: not ours
        if grad_outputs[0] is not None:
            taken.append((leaf, grad_outputs[0]))
        return (None,)

    return take


# A node's post-hook: (its gradients in, its gradients out) -> replaced gradients in, or None.
_Hook = Callable[[tuple[Tensor | None, ...], tuple[Tensor | None, ...]], object]


def _cutter(
    node: Node, at: Sequence[int], call: Callable[[Node, int, Tensor], None], me: int
) -> _Hook:
    def cut(
        grad_inputs: tuple[Tensor | None, ...], grad_outputs: tuple[Tensor | None, ...]
    ) -> tuple[Tensor | None, ...] | None:
        if threading.get_ident() != me:
            return None
        out = list(grad_inputs)
        for i in at:
            grad = out[i]
            if grad is not None:
                call(node, i, grad)
            out[i] = None
        return tuple(out)

    return cut
