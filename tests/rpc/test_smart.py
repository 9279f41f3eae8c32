"""SMART mode: only what reaches the roots runs, each worker's graph once per pass.

Each case is checked against local autograd of the same computation (float64, random
cotangents), and message counters show which workers took part.
"""

from __future__ import annotations

import torch

import distgrad.rpc as dgrpc
from distgrad.testing import run_on_ranks
from tests import _support as support
from tests.rpc import _funcs as F
from tests.rpc import _helpers as H


def _received(worker: str) -> int:
    return int(H.query(worker, F.state).get("gradient_messages_received", 0))


def _lineage_sent() -> int:
    return dgrpc.debug_state().get("lineage_messages_sent", 0)


def _smart(rank: int, world_size: int) -> None:
    if rank != 0:
        return
    x, y = support.leaf(0, 3), support.leaf(1, 3)
    v = support.leaf(2, 3, requires_grad=False)

    # Unused outputs and a worker that no path from the root reaches: worker2 gets nothing.
    ref_x, ref_y = torch.autograd.grad((torch.mul(x, y) * v).sum(), (x, y))
    for mode in ("smart", "fast"):
        before = [_received("worker1"), _received("worker2")]
        with dgrpc.context() as cid:
            used = dgrpc.rpc_sync("worker1", torch.mul, args=(x, y))
            dgrpc.rpc_sync("worker1", torch.add, args=(x, y))  # unused
            dgrpc.rpc_sync("worker2", torch.sub, args=(x, y))  # unused, on another worker
            dgrpc.backward(cid, [used], grad_tensors=[v], mode=mode)
            grads = dgrpc.get_gradients(cid)
        torch.testing.assert_close(grads[x], ref_x)
        torch.testing.assert_close(grads[y], ref_y)
        after = [_received("worker1"), _received("worker2")]
        assert after[0] - before[0] == 1, (mode, before, after)
        assert after[1] == before[1], f"{mode}: worker2 was sent gradients"

    # Outputs used only by a different root: two passes in one context, each its own lineage;
    # the first pass sends nothing to worker2, the second nothing to worker1.
    a_ref = torch.autograd.grad((torch.exp(x) * v).sum(), x)[0]
    b_ref = torch.autograd.grad((torch.sin(x) * v).sum(), x)[0]
    with dgrpc.context() as cid:
        a = dgrpc.rpc_sync("worker1", torch.exp, args=(x,))
        b = dgrpc.rpc_sync("worker2", torch.sin, args=(x,))
        seen = [_received("worker1"), _received("worker2")]
        dgrpc.backward(cid, [a], grad_tensors=[v], retain_graph=True, mode="smart")
        torch.testing.assert_close(dgrpc.get_gradients(cid)[x], a_ref)
        assert [_received("worker1"), _received("worker2")] == [seen[0] + 1, seen[1]]
        lineage_before = _lineage_sent()
        dgrpc.backward(cid, [b], grad_tensors=[v], mode="smart")
        assert _lineage_sent() - lineage_before == 0  # the result carried its lineage
        torch.testing.assert_close(dgrpc.get_gradients(cid)[x], a_ref + b_ref)
        assert [_received("worker1"), _received("worker2")] == [seen[0] + 1, seen[1] + 1]

    # Fan-out on worker1: h = 2x goes to worker2 twice. SMART runs h's part of worker1's graph
    # once, with both gradients summed (its hook fires once, no retain_graph needed); FAST runs
    # it once per arriving gradient.
    (ref,) = torch.autograd.grad((F.fan_out_local(x) * v).sum(), x)
    for mode, hook_runs in (("smart", 1), ("fast", 2)):
        calls = H.query("worker1", F.hook_calls)
        with dgrpc.context() as cid:
            out = dgrpc.rpc_sync("worker1", F.fan_out_and_back, args=(x, "worker2"))
            dgrpc.backward(cid, [out], grad_tensors=[v], mode=mode)
            torch.testing.assert_close(dgrpc.get_gradients(cid)[x], ref)
        assert H.query("worker1", F.hook_calls) - calls == hook_runs, mode

    # Cycles in both directions: rooted here (0 -> 1 -> 0) and rooted on worker1 (1 -> 0 -> 1).
    for mode in ("smart", "fast"):
        assert F.drive_loop(mode, "worker1") < 1e-12
        assert H.query("worker1", F.drive_loop, mode, "worker0") < 1e-12


def _lineage_carried_or_asked(rank: int, world_size: int) -> None:
    if rank != 0:
        return
    x = support.leaf(3, 3)
    for ops, queries in ((3, 0), (100, 1)):  # a lineage too large to carry is asked for
        (ref,) = torch.autograd.grad(F.deep(x * 2.0, ops).sum(), x)
        before = _lineage_sent()
        with dgrpc.context() as cid:
            y = dgrpc.rpc_sync("worker1", F.deep, args=(x * 2.0, ops))
            dgrpc.backward(cid, [y.sum()], mode="smart")
            torch.testing.assert_close(dgrpc.get_gradients(cid)[x], ref)
        assert _lineage_sent() - before == queries, (ops, _lineage_sent() - before)


def test_a_send_carries_its_lineage_unless_it_is_too_large_to() -> None:
    """A result computed in 3 ops carries its lineage (no query); one computed in 100 ops is
    past the walk's 64 nodes, and SMART asks worker1 for it (one query)."""
    run_on_ranks(_lineage_carried_or_asked, 2, init="rpc")


def test_smart_mode_runs_only_what_reaches_the_roots() -> None:
    run_on_ranks(_smart, 3, init="rpc")
