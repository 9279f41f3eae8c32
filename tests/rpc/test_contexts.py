"""Contexts: unique ids, one per thread, released on every worker they touched."""

from __future__ import annotations

import threading
import time
from typing import Any

import pytest
import torch

import distgrad.rpc as dgrpc
from distgrad.errors import RpcAutogradError, UnknownContextError
from distgrad.rpc._context import lookup
from distgrad.testing import run_on_ranks
from tests import _support as support
from tests.rpc import _funcs as F
from tests.rpc import _helpers as H


def _known(context_id: int) -> list[tuple[bool, int, int]]:
    """(known, sends, recvs) on workers 1 and 2, asked through torch's RPC (no context sent)."""
    return [H.query(w, F.context_known, context_id) for w in ("worker1", "worker2")]


def _contexts(rank: int, world_size: int) -> None:
    if rank != 0:
        return
    # Ids carry the worker id in the high 16 bits; each worker's ids differ.
    ids = [dgrpc.rpc_sync(f"worker{w}", F.open_context_id) for w in (1, 2, 1)]
    with dgrpc.context() as mine:
        pass
    assert [i >> 48 for i in [mine, *ids]] == [0, 1, 2, 1]
    assert len({mine, *ids}) == 4

    # One context per thread: nesting raises, other threads get their own.
    with dgrpc.context() as outer:
        with (
            pytest.raises(
                RpcAutogradError,
                match=r"^Already have an autograd context id for this thread: "
                r"this thread is already in autograd context",
            ),
            dgrpc.context(),
        ):
            pass
        assert dgrpc.current_context_id() == outer
        seen: list[int | None] = []

        def other() -> None:
            seen.append(dgrpc.current_context_id())
            with dgrpc.context() as inner:
                seen.append(inner)

        t = threading.Thread(target=other)
        t.start()
        t.join(10)
        assert seen[0] is None and seen[1] != outer
    assert dgrpc.current_context_id() is None

    # A chain A -> B -> C records on every worker; after exit the id is unknown everywhere.
    x = torch.ones(2, dtype=torch.float64, requires_grad=True)
    with dgrpc.context(wait_for_release=True) as cid:
        F.chain(x, ["worker1", "worker2"], local=False)
        assert len(lookup(cid).sends) == 1 and len(lookup(cid).recvs) == 1
        assert _known(cid) == [(True, 2, 2), (True, 1, 1)]
    assert _known(cid) == [(False, 0, 0), (False, 0, 0)]
    with pytest.raises(UnknownContextError, match="worker0"):
        dgrpc.get_gradients(cid)

    # Also when the block raises, and in a loop A -> B -> A.
    with pytest.raises(ValueError, match="user error"), dgrpc.context(wait_for_release=True) as cid:
        dgrpc.rpc_sync("worker1", F.scale_then_call_back, args=(x, "worker0", False))
        dgrpc.rpc_sync("worker2", torch.neg, args=(x,))
        assert len(lookup(cid).sends) == 3 and len(lookup(cid).recvs) == 3
        raise ValueError("user error")
    assert _known(cid) == [(False, 0, 0), (False, 0, 0)]
    with pytest.raises(UnknownContextError):
        lookup(cid)

    # By default the release travels in the background; it arrives all the same.
    with dgrpc.context() as cid:
        F.chain(x, ["worker1", "worker2"], local=False)
    deadline = time.monotonic() + 5.0
    while _known(cid) != [(False, 0, 0), (False, 0, 0)]:
        assert time.monotonic() < deadline, f"context {cid} still known: {_known(cid)}"
        time.sleep(0.01)

    # Nothing requires grad: nothing is recorded, but the callee learns the context.
    with dgrpc.context() as cid:
        dgrpc.rpc_sync("worker1", F.add_plain, args=(torch.ones(2), torch.ones(2)))
        assert (len(lookup(cid).sends), len(lookup(cid).recvs)) == (0, 0)
        assert _known(cid)[0] == (True, 0, 0)
        assert _known(cid)[1] == (False, 0, 0)


def test_context_ids_threads_recording_and_release() -> None:
    run_on_ranks(_contexts, 3, init="rpc")


def _recording(rank: int, world_size: int) -> None:
    """torch's graph-recording cases [test_graph_for_*, test_no_graph_with_tensors_not_require
    _grad, test_rpc_complex_args, test_worker_ids_recorded, test_autograd_context]."""
    if rank != 0:
        return
    ids = []
    for _ in range(200):
        with dgrpc.context() as cid:
            assert cid >> 48 == 0 and lookup(cid).context_id == cid
            ids.append(cid)
    assert len(set(ids)) == 200
    for cid in ids:
        with pytest.raises(RuntimeError, match=f"Could not find autograd context with id: {cid}"):
            lookup(cid)
    t1, t2 = support.leaf(1, 3, 3), support.leaf(2, 3, 3)
    for call in (F.remote_call, F.remote_ref_call):
        for fn in (torch.add, F.py_add):
            with dgrpc.context() as cid:
                ret = call("worker1", fn, (t1, t2))
                mine = H.query("worker0", F.recorded, cid)
                # Here: one send whose gradients enter t1 and t2, one recv that made ret.
                assert mine["targets"][0] == ["torch::autograd::AccumulateGrad"] * 2
                assert (mine["sends"], mine["recvs"]) == (1, 1), mine
                assert type(ret.grad_fn).__name__ == "_RecvFunctionBackward"
                # There: the add's result was sent back; its gradient enters the add.
                theirs = H.query("worker1", F.recorded, cid)
                assert theirs["targets"][-1] == ["AddBackward0"], theirs
    with dgrpc.context() as cid:  # a nested call and one that comes back here
        F.chain(t1, ["worker1", "worker2"], local=False)
        dgrpc.rpc_sync("worker1", F.scale_then_call_back, args=(t2, "worker0", False))
        counts = [
            (r["sends"], r["recvs"])
            for r in (H.query(f"worker{w}", F.recorded, cid) for w in range(3))
        ]
        assert counts == [(3, 3), (4, 4), (1, 1)], counts
    with dgrpc.context() as cid:  # nothing requires grad: nothing recorded, workers known
        for w in ("worker1", "worker2"):
            dgrpc.rpc_sync(w, torch.add, args=(t1.detach(), t2.detach()))
        mine = H.query("worker0", F.recorded, cid)
        assert (mine["sends"], mine["recvs"], mine["known"]) == (0, 0, ["worker1", "worker2"])
        tensors = [torch.ones(3, 3, requires_grad=i % 2 == 0) for i in range(10)]
        dgrpc.rpc_sync("worker1", torch.stack, args=(tensors,))
        mine = H.query("worker0", F.recorded, cid)
        assert mine["targets"] == [["torch::autograd::AccumulateGrad"] * 5], mine


def test_recording_follows_torch_s_graph_cases() -> None:
    run_on_ranks(_recording, 3, init="rpc")


def _torch_signature(rank: int, world_size: int, rendezvous: str) -> float:
    from torch.distributed import rpc as torch_rpc

    options = torch_rpc.TensorPipeRpcBackendOptions(
        init_method=f"file://{rendezvous}", rpc_timeout=20, _transports=["uv"]
    )
    backend = torch_rpc.BackendType.TENSORPIPE  # type: ignore[attr-defined]
    dgrpc.init_rpc(f"worker{rank}", backend, rank, world_size, options)
    grad = 0.0
    if rank == 0:
        x = support.leaf(1, 3)
        with dgrpc.context() as cid:
            y = dgrpc.rpc_sync("worker1", torch.mul, args=(x, x))
            dgrpc.backward(cid, [y.sum()], False)  # torch's positional retain_graph
            grad = float((dgrpc.get_gradients(cid)[x] - 2 * x).abs().max())
    dgrpc.shutdown()
    dgrpc.shutdown()  # a second shutdown does nothing
    return grad


def test_init_rpc_takes_torch_s_positional_signature(tmp_path: Any) -> None:
    """init_rpc(name, backend, rank, world_size, rpc_backend_options), as torch's."""
    results = run_on_ranks(_torch_signature, 2, args=(str(tmp_path / "rdzv"),), init="none")
    assert results[0] == 0.0


def _releases_ride_on_calls(rank: int, world_size: int) -> None:
    if rank != 0:
        return
    x = support.leaf(3, 2)
    before = [s["release_messages_sent"] for s in H.states(world_size)]
    steps = 30
    for _ in range(steps):  # A -> B -> C: B forwards each release to C on its next call there
        with dgrpc.context():
            F.chain(x, ["worker1", "worker2"], local=False)
    after = [s["release_messages_sent"] for s in H.states(world_size)]
    sent = [a - b for a, b in zip(after, before, strict=True)]
    # Each release rides on the next step's call; only the last step's (and one that found
    # no call within 5 ms on a loaded machine) goes out as a message.
    assert sum(sent) < steps // 3, sent
    # A call that fails before it leaves (its argument does not pickle) keeps its releases.
    with dgrpc.context():
        F.chain(x, ["worker1", "worker2"], local=False)
    with pytest.raises(AttributeError, match="pickle"), dgrpc.context():
        dgrpc.rpc_sync("worker1", torch.neg, args=(lambda: None,))
    H.no_state_left(world_size)


def test_releases_ride_on_the_next_call_and_reach_every_worker() -> None:
    """30 contexts along A -> B -> C send few release messages and leave no state anywhere."""
    run_on_ranks(_releases_ride_on_calls, 3, init="rpc")


def _shutdown_inside_a_context(rank: int, world_size: int) -> None:
    with dgrpc.context():
        dgrpc.shutdown()  # torch's barrier makes its own RPCs: not refused


def test_shutdown_works_inside_a_context() -> None:
    run_on_ranks(_shutdown_inside_a_context, 2, init="rpc")
