"""Distributed backward: long chains, errors far away, hooks, retain_graph, what travels.

Gradients are compared with local autograd of the same computation (float64, random
cotangents). Message counts pin what a backward sends: torch sends two messages on a round
trip's backward, one nested in the other; distgrad's FAST sends one.
"""

from __future__ import annotations

import pytest
import torch

import distgrad.rpc as dgrpc
from distgrad.errors import RpcAutogradError
from distgrad.testing import run_on_ranks
from tests import _support as support
from tests.rpc import _funcs as F
from tests.rpc import _helpers as H


def _chain4(rank: int, world_size: int) -> None:
    if rank != 0:
        return
    hops = ["worker1", "worker2", "worker3"]
    for mode in H.MODES:
        x = support.leaf(0, 4)
        v = support.cotangent(1, x)
        (ref,) = torch.autograd.grad((F.chain(x, hops, local=True) * v).sum(), x)
        with dgrpc.context() as cid:
            out = F.chain(x, hops, local=False)
            dgrpc.backward(cid, [out], grad_tensors=[v], mode=mode)
            H.assert_close(dgrpc.get_gradients(cid)[x], ref, f"{mode}: chain")
        # An exception in a backward function three hops away reaches the root, naming worker3;
        # the same context then runs another backward correctly.
        with dgrpc.context() as cid:
            bad = F.chain_boom(x, hops)
            good = F.chain(x, hops, local=False)
            with pytest.raises(
                RpcAutogradError,
                match=r"^Error on Node 3: ValueError: boom"
                r".*\(distributed backward failed on worker3\)",
            ):
                dgrpc.backward(cid, [bad.sum()], mode=mode)
            for w, state in enumerate(H.states(world_size)):
                assert state["passes_in_flight"] == state["smart_passes"] == 0, (w, state)
            dgrpc.backward(cid, [good], grad_tensors=[v], mode=mode)
            H.assert_close(dgrpc.get_gradients(cid)[x], ref, f"{mode}: chain after an error")
    H.no_state_left(world_size)


def test_chain_of_four_workers_and_an_error_three_hops_away() -> None:
    """A -> B -> C -> D; the error's message names D; afterwards no worker holds any state."""
    run_on_ranks(_chain4, 4, init="rpc")


def _messages(before: list[dict[str, int]], after: list[dict[str, int]], key: str) -> int:
    return sum(a[key] - b[key] for a, b in zip(after, before, strict=True))


def _hooks_and_messages(rank: int, world_size: int) -> None:
    if rank != 0:
        return
    for mode in H.MODES:
        a, b = support.leaf(2, 3, 3), support.leaf(3, 3, 3)
        v = support.cotangent(4, a)
        # Tensor hooks run on the distributed backward as on the local one (a linear hook).
        with dgrpc.context() as cid:
            handle = a.register_hook(lambda g: g * 3.0)
            out = dgrpc.rpc_sync("worker1", torch.mul, args=(a, b))
            out.register_hook(lambda g: g + 1.0)
            dgrpc.backward(cid, [out], grad_tensors=[v], mode=mode)
            grads = dgrpc.get_gradients(cid)
            H.assert_close(grads[a], 3.0 * (v + 1.0) * b, f"{mode}: hooked a")
            H.assert_close(grads[b], (v + 1.0) * a, f"{mode}: b")
            handle.remove()
            with pytest.raises(RpcAutogradError, match="retain_graph=True"):
                dgrpc.backward(cid, [out], grad_tensors=[v], mode=mode)
        # What one round trip's backward sends, summed over both workers: one message, and
        # worker1's gradient for worker0 rides back in the answer; SMART needs no lineage
        # query (the result carried its send's lineage). No zeros are shipped for an output
        # that received no gradient: of three slices that come back, one is unused, so two
        # tensors travel back.
        with dgrpc.context() as cid:
            parts = dgrpc.rpc_sync("worker1", torch.split, args=(a * b, 1))
            before = H.states(world_size)
            dgrpc.backward(cid, [(parts[0] * 2 + parts[2]).sum()], mode=mode)
            after = H.states(world_size)
        sent = _messages(before, after, "gradient_messages_sent")
        lineage = _messages(before, after, "lineage_messages_sent")
        replies = _messages(before, after, "gradient_replies_sent")
        tensors = after[0]["gradient_tensors_sent"] - before[0]["gradient_tensors_sent"]
        expected = {"fast": (1, 0, 1), "smart": (1, 0, 1)}[mode]
        assert (sent, lineage, replies) == expected, (mode, sent, lineage, replies)
        assert tensors == 2, (mode, tensors)


def test_hooks_and_the_messages_a_round_trip_s_backward_sends() -> None:
    """Pins messages per backward: 1 message + 1 reply in both modes (the benchmark's
    'messages / backward' counts messages and lineage queries, not replies)."""
    run_on_ranks(_hooks_and_messages, 2, init="rpc")


def _sent_results_are_not_kept(rank: int, world_size: int) -> None:
    if rank != 0:
        return
    for mode in H.MODES:
        a, b = support.leaf(7, 64, 64), support.leaf(8, 64, 64)
        with dgrpc.context() as cid:
            y = dgrpc.rpc_sync("worker1", F.add_and_watch, args=(a, b))
            # worker1 keeps the graph behind the result it sent, not the result's data.
            assert not H.query("worker1", F.last_result_alive)
            dgrpc.backward(cid, [(y * y).sum()], mode=mode)
            grads = dgrpc.get_gradients(cid)
        H.assert_close(grads[a], 2 * (a + b).detach(), f"{mode}: a")
        H.assert_close(grads[b], 2 * (a + b).detach(), f"{mode}: b")


def test_a_worker_does_not_keep_the_data_of_tensors_it_sent() -> None:
    run_on_ranks(_sent_results_are_not_kept, 2, init="rpc")
