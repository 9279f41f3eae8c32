"""Threads: the serializer keeps nothing between messages; gradients are torch's bit for bit
whatever the intra-op thread setting; contexts on several threads over the same leaves
finish, in both modes, with the gradients local autograd gives."""

from __future__ import annotations

import gc
import threading
import weakref

import pytest
import torch
import torch.distributed.autograd as torch_autograd
from torch.distributed import rpc as torch_rpc

import distgrad.rpc as dgrpc
from distgrad.rpc import _transport
from distgrad.rpc._wire import GradientMessage
from distgrad.testing import run_on_ranks
from tests.rpc import _funcs as F
from tests.rpc import _helpers as H


def test_a_serialized_message_keeps_nothing_alive() -> None:
    """A pickler kept between messages kept the last message's objects in its memo, where the
    garbage collector on another thread found one freed while the memo was being cleared (the
    segfault of issue 20 item 6). Nothing of a message may outlive its serialization."""
    grad = torch.ones(3, 3)
    message = GradientMessage(1, 2, [grad], 3, 1.0, "worker0")
    gone = weakref.ref(grad), weakref.ref(message)
    pickled, tensors = _transport._serializer.serialize(message)
    assert tensors == [grad] and pickled
    del grad, message, tensors
    gc.collect()
    assert gone[0]() is None and gone[1]() is None


def test_serializing_on_many_threads_while_collecting() -> None:
    """Eight threads serialize messages while another collects garbage: no crash, and every
    thread gets back its own tensors."""
    stop = threading.Event()
    errors: list[BaseException] = []

    def collect() -> None:
        while not stop.is_set():
            gc.collect(0)

    def send(seed: int) -> None:
        try:
            for i in range(300):
                grads = [torch.full((2,), float(seed * 1000 + i)) for _ in range(3)]
                _, tensors = _transport._serializer.serialize(
                    GradientMessage(seed, i, grads, 0, 1.0, "worker0")
                )
                assert [t is g for t, g in zip(tensors, grads, strict=True)] == [True] * 3
        except BaseException as exc:  # reported below
            errors.append(exc)

    collector = threading.Thread(target=collect)
    senders = [threading.Thread(target=send, args=(s,)) for s in range(8)]
    collector.start()
    for t in senders:
        t.start()
    for t in senders:
        t.join(30)
    stop.set()
    collector.join(30)
    assert not errors, errors


def _thread_count(rank: int, world_size: int, threads: int) -> None:
    if rank != 0:
        return
    g = torch.Generator().manual_seed(1)
    x = torch.randn(16, 4, 24, 24, generator=g, requires_grad=True)
    # Every RPC thread of worker1 runs a forward at 2 threads first: OpenMP then keeps 2 on
    # those threads whatever the process sets later; torch's engine threads start later.
    H.query("worker1", F.set_threads, 2)
    for _ in range(6):
        futures = [
            torch_rpc.rpc_async("worker1", F.run_conv_stage, args=(x.detach(),)) for _ in range(24)
        ]
        torch.futures.wait_all(futures)
    # Set once per process, as programs do: torch's engine threads take the setting when they
    # first run (they too keep it afterwards, so each count gets fresh processes).
    torch.set_num_threads(threads)
    assert H.query("worker1", F.set_threads, threads) == threads
    with torch_autograd.context() as cid:
        y = torch_rpc.rpc_sync("worker1", F.run_conv_stage, args=(x,))
        torch_autograd.backward(cid, [(y * H.cotangent(2, y)).sum()])
        want = H.query("worker1", F.conv_stage_grads, cid, True)
        want.append(torch_autograd.get_gradients(cid)[x])
    for mode in H.MODES:
        with dgrpc.context() as cid:
            y = dgrpc.rpc_sync("worker1", F.run_conv_stage, args=(x,))
            dgrpc.backward(cid, [(y * H.cotangent(2, y)).sum()], mode=mode)
            got = H.query("worker1", F.conv_stage_grads, cid, False)
            got.append(dgrpc.get_gradients(cid)[x])
        for i, (a, b) in enumerate(zip(got, want, strict=True)):
            assert torch.equal(a, b), (
                f"{mode}, {threads} intra-op threads: gradient {i} differs from torch's "
                f"by up to {float((a - b).abs().max())}"
            )


@pytest.mark.parametrize("threads", [1, 2])
def test_gradients_equal_torchs_bit_for_bit_at_any_intra_op_thread_count(threads: int) -> None:
    """A convolution stage on worker1, float32, its RPC threads warmed at 2 threads before the
    processes set ``threads``: torch's dist autograd and distgrad (both modes) give the same
    bits. (Before the fix, 1 thread: the weight gradient differed in the last bits.)"""
    run_on_ranks(_thread_count, 2, args=(threads,), init="rpc")
