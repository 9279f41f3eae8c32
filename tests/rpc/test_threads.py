"""Threads: the serializer keeps nothing between messages, and contexts on several threads
over the same leaves finish, in both modes, with the gradients local autograd gives."""

from __future__ import annotations

import gc
import threading
import weakref

import torch

from distgrad.rpc import _transport
from distgrad.rpc._wire import GradientMessage


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
