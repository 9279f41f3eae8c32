"""Distributed backward: chains, failures, hooks, retain_graph, message accounting, leaks.

Gradients are compared with local autograd of the same computation in float64 with random
cotangents (see test_gradients.py for the conformance cases).
"""

from __future__ import annotations

import pytest
import torch
from torch import Tensor

import distgrad.rpc as dgrpc
from distgrad.errors import RankFailedError, RpcAutogradError, UnknownContextError
from distgrad.rpc._release import wait_for_releases
from distgrad.testing import run_on_ranks
from tests.rpc import _funcs as F
from tests.rpc import _helpers as H

MODES = ("fast", "smart")


def _x(seed: int, *shape: int) -> Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, dtype=torch.float64, generator=g, requires_grad=True)


def _v(seed: int, like: Tensor) -> Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(like.shape, dtype=like.dtype, generator=g)


def _states(world_size: int) -> list[dict[str, int]]:
    return H.states(world_size)


def _no_state_left(world_size: int) -> None:
    wait_for_releases()
    for w, state in enumerate(_states(world_size)):
        for key in ("contexts", "passes_in_flight", "smart_passes", "sends", "recvs"):
            assert state[key] == 0, f"worker{w} still holds {state[key]} {key}: {state}"


def _chain4(rank: int, world_size: int) -> None:
    if rank != 0:
        return
    hops = ["worker1", "worker2", "worker3"]
    for mode in MODES:
        x = _x(0, 4)
        v = _v(1, x)
        (ref,) = torch.autograd.grad((F.chain(x, hops, local=True) * v).sum(), x)
        with dgrpc.context() as cid:
            out = F.chain(x, hops, local=False)
            dgrpc.backward(cid, [out], grad_tensors=[v], mode=mode)
            torch.testing.assert_close(dgrpc.get_gradients(cid)[x], ref)
        # An exception in a backward function three hops away reaches the root, naming worker3;
        # the same context then runs another backward correctly.
        with dgrpc.context() as cid:
            bad = F.chain_boom(x, hops)
            good = F.chain(x, hops, local=False)
            with pytest.raises(RpcAutogradError, match=r"failed on worker3: ValueError: boom"):
                dgrpc.backward(cid, [bad.sum()], mode=mode)
            for w, state in enumerate(_states(world_size)):
                assert state["passes_in_flight"] == state["smart_passes"] == 0, (w, state)
            dgrpc.backward(cid, [good], grad_tensors=[v], mode=mode)
            torch.testing.assert_close(dgrpc.get_gradients(cid)[x], ref)
    _no_state_left(world_size)


def test_chain_of_four_workers_and_an_error_three_hops_away() -> None:
    """A -> B -> C -> D; the error's message names D; afterwards no worker holds any state."""
    run_on_ranks(_chain4, 4, init="rpc")


def _api(rank: int, world_size: int) -> None:
    if rank != 0:
        return
    for mode in MODES:
        a, b = _x(2, 3, 3), _x(3, 3, 3)
        v = _v(4, a)
        # Tensor hooks run on the distributed backward as on the local one (a linear hook).
        ref_a, ref_b = torch.autograd.grad((torch.mul(a, b) * v).sum(), (a, b))
        with dgrpc.context() as cid:
            handle = a.register_hook(lambda g: g * 3.0)
            out = dgrpc.rpc_sync("worker1", torch.mul, args=(a, b))
            out.register_hook(lambda g: g + 1.0)
            dgrpc.backward(cid, [out], grad_tensors=[v], retain_graph=True, mode=mode)
            grads = dgrpc.get_gradients(cid)
            torch.testing.assert_close(grads[a], 3.0 * (v + 1.0) * b)
            torch.testing.assert_close(grads[b], (v + 1.0) * a)
            handle.remove()
        # A second backward with retain_graph=True accumulates; after retain_graph=False the
        # context's graph may not be used again.
        with dgrpc.context() as cid:
            out = dgrpc.rpc_sync("worker1", torch.mul, args=(a, b))
            dgrpc.backward(cid, [out], grad_tensors=[v], retain_graph=True, mode=mode)
            dgrpc.backward(cid, [out], grad_tensors=[v], mode=mode)
            grads = dgrpc.get_gradients(cid)
            torch.testing.assert_close(grads[a], 2 * ref_a)
            torch.testing.assert_close(grads[b], 2 * ref_b)
            with pytest.raises(RpcAutogradError, match="retain_graph=True"):
                dgrpc.backward(cid, [out], grad_tensors=[v], mode=mode)
            # Non-scalar roots need grad_tensors; roots must require grad.
            with pytest.raises(RpcAutogradError, match=r"shape \(3, 3\), not a scalar"):
                dgrpc.backward(cid, [out], mode=mode)
            with pytest.raises(RpcAutogradError, match="requires_grad not set"):
                dgrpc.backward(cid, [torch.ones(1)], mode=mode)
        assert a.grad is None and b.grad is None
        with pytest.raises(UnknownContextError, match=r"id [0-9]* on worker0"):
            dgrpc.backward(cid, [out], grad_tensors=[v], mode=mode)
        # No zeros are shipped for an output that received no gradient: of three slices that
        # come back, one is unused, so two tensors travel back (and one to the caller's caller).
        with dgrpc.context() as cid:
            parts = dgrpc.rpc_sync("worker1", torch.split, args=(a * b, 1))
            before, before1 = dgrpc.debug_state(), _states(2)[1]
            dgrpc.backward(cid, [(parts[0] * 2 + parts[2]).sum()], mode=mode)
            after, after1 = dgrpc.debug_state(), _states(2)[1]
        assert after["gradient_messages_sent"] - before["gradient_messages_sent"] == 1
        assert after["gradient_tensors_sent"] - before["gradient_tensors_sent"] == 2
        # In both modes the gradient of a * b goes back to worker0 inside the answer to
        # worker0's message, not as a message of its own.
        sent = after1["gradient_messages_sent"] - before1["gradient_messages_sent"]
        replied = after1["gradient_replies_sent"] - before1["gradient_replies_sent"]
        got = after["gradient_replies_received"] - before["gradient_replies_received"]
        assert (sent, replied, got) == (0, 1, 1), (mode, sent, replied, got)
    # Nothing leaks over 1000 contexts, half of them with a backward, in both modes.
    x = _x(5, 2)
    for i in range(1000):
        with dgrpc.context() as cid:
            y = dgrpc.rpc_sync("worker1", torch.mul, args=(x, x))
            if i % 2:
                dgrpc.backward(cid, [y.sum()], mode=MODES[i % 4 // 2])
    _no_state_left(world_size)


def test_hooks_retain_graph_errors_no_zero_gradients_and_no_leaks() -> None:
    run_on_ranks(_api, 2, init="rpc", timeout=90.0)


def _sent_results_are_not_kept(rank: int, world_size: int) -> None:
    if rank != 0:
        return
    for mode in MODES:
        a, b = _x(7, 64, 64), _x(8, 64, 64)
        with dgrpc.context() as cid:
            y = dgrpc.rpc_sync("worker1", F.add_and_watch, args=(a, b))
            # worker1 keeps the graph behind the result it sent, not the result's data.
            assert not H.query("worker1", F.last_result_alive)
            dgrpc.backward(cid, [(y * y).sum()], mode=mode)
            grads = dgrpc.get_gradients(cid)
        torch.testing.assert_close(grads[a], 2 * (a + b).detach())
        torch.testing.assert_close(grads[b], 2 * (a + b).detach())


def test_a_worker_does_not_keep_the_data_of_tensors_it_sent() -> None:
    run_on_ranks(_sent_results_are_not_kept, 2, init="rpc", timeout=60.0)


def _dead_worker(rank: int, world_size: int) -> None:
    if rank != 0:
        return
    x = _x(6, 3)
    with dgrpc.context() as cid:
        y = dgrpc.rpc_sync("worker1", torch.exp, args=(x,))
        H.query("worker1", F.die_soon)
        import time

        time.sleep(0.5)
        try:
            dgrpc.backward(cid, [y.sum()])
        except RpcAutogradError as exc:
            assert "worker1" in str(exc), exc
            raise SystemExit(f"expected: {exc}") from None
    raise AssertionError("backward returned although worker1 is dead")


def test_a_dead_worker_makes_backward_raise_naming_it() -> None:
    with pytest.raises(RankFailedError) as info:
        run_on_ranks(_dead_worker, 2, init="rpc", timeout=30.0, collective_timeout=5.0)
    text = str(info.value)
    assert "rank 0: SystemExit: expected: distributed backward failed on worker1" in text, text
