"""Mistakes in a pipeline program are errors that name the ranks and the transfer, on every
rank, within the group's timeout or the dead-peer watch's milliseconds; never a hang.

A rank that finds a problem with what it received raises at once (its error is in the
harness's report); its peer, waiting for that rank's next message, fails as soon as the
rank's process is gone (the dead-peer watch), or at the group's timeout when it stays. The
peers' bodies catch what they raise and return ``(error type, message, when)``, so a test
asserts what *each* rank saw.
"""

from __future__ import annotations

import os
import re
import signal
import time
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

import distgrad.pipeline as dgp
from distgrad.errors import RankFailedError
from distgrad.testing import run_on_ranks

Seen = tuple[str, str, float]
TIMEOUT_S = 1.5  # the group's timeout in the cases that wait for it
NAMED_WITHIN_S = 5.0  # after a peer's death (measured: tens of ms; CI machines are loaded)


def _seen(exc: BaseException) -> Seen:
    return type(exc).__name__, str(exc), time.time()


def _failed(fn: Callable[..., object], *args: object) -> tuple[str, dict[int, Seen]]:
    """Run ``fn`` on 2 ranks, one of which raises; the harness's report (the raising rank's
    own error first) and what the others returned."""
    try:
        run_on_ranks(fn, 2, args=args, collective_timeout=20, timeout=40)
    except RankFailedError as failure:
        return str(failure), failure.results
    raise AssertionError("no rank raised")


def _both_receive(rank: int, world: int) -> Seen | None:
    try:
        with dgp.context():
            dgp.recv(1 - rank)  # nobody sends
    except Exception as exc:
        return _seen(exc)
    return None


@pytest.mark.slow  # 4-5 s: the group's timeout, then the wait for the peers' reports
def test_a_receive_with_no_matching_send_times_out_naming_the_transfer_on_every_rank() -> None:
    """Both ranks receive and neither sends: each fails at the group's timeout with an error
    that names itself, the transfer and the peer."""
    seen = run_on_ranks(_both_receive, 2, collective_timeout=TIMEOUT_S, timeout=30)
    for rank, got in enumerate(seen):
        assert got is not None, f"rank {rank} raised nothing"
        _, message, _ = got
        first = message.splitlines()[0]
        assert f"rank {rank} was in the forward of dg.pipeline.irecv from rank {1 - rank}" in first
        assert "(transfer 0)" in first, first


def _wrong_shape(rank: int, world: int, dtype: str) -> Seen | None:
    if rank == 1:  # raises
        with dgp.context():
            wanted = torch.float32 if dtype == "dtype" else torch.float64
            shape = (3, 5) if dtype == "dtype" else (4, 5)
            dgp.recv(0, shape=shape, dtype=wanted)
    try:
        with dgp.context() as cid:
            x = torch.ones(3, 5, dtype=torch.float64, requires_grad=True)
            dgp.send(x * 2, 1)
            dgp.backward(cid)  # waits for a gradient that never comes
    except Exception as exc:
        return _seen(exc)
    return None


def test_a_received_shape_that_differs_from_the_sent_one_is_named_on_both_ranks() -> None:
    """The receiver expects (4, 5), the sender sends (3, 5): the receiver raises a
    CollectiveMismatchError naming both shapes and the sender's rank, before any data is
    read; the sender, waiting for its send to be received, is told the receiver is gone,
    naming the rank and the transfer."""
    report, seen = _failed(_wrong_shape, "shape")
    assert "--- rank 1: CollectiveMismatchError: the forward of dg.pipeline.irecv from rank 0 " in (
        report
    )
    assert "(transfer 0) on rank 1: rank 0 sends shape (3, 5) where this rank expects (4, 5)" in (
        report
    )
    _, message, _ = seen[0]
    first = message.splitlines()[0]
    # Waiting in its send (gloo's send waits until the receiver posts a buffer for it).
    assert "rank 0 was in the forward of dg.pipeline.isend to rank 1 (transfer 0)" in first, first
    assert "its connection to rank 1 closed" in first, first
    assert float(re.search(r"closed, ([0-9.]+) s into the wait", first)[1]) < NAMED_WITHIN_S  # type: ignore[index]


def test_a_received_dtype_that_differs_from_the_sent_one_is_named() -> None:
    """The receiver expects float32, the sender sends float64: named on the receiver."""
    report, _ = _failed(_wrong_shape, "dtype")
    assert "--- rank 1: CollectiveMismatchError: " in report, report
    assert "rank 0 sends dtype torch.float64 where this rank expects torch.float32" in report


def _backwards_that_differ(rank: int, world: int) -> Seen | None:
    if rank == 0:  # raises
        with dgp.context() as cid:
            x = torch.ones(2, 2, dtype=torch.float64, requires_grad=True)
            dgp.send(x * 2, 1, microbatch=0)
            dgp.send(x * 3, 1, microbatch=1)
            dgp.backward(cid, microbatch=0)
    try:
        with dgp.context() as cid:  # both labelled 0: this backward covers two transfers
            a = dgp.recv(0, microbatch=0)
            b = dgp.recv(0, microbatch=0)
            dgp.backward(cid, [(a * b).sum()], microbatch=0)
        with dgp.context():  # the next step: waits for rank 0, stopped at its error
            dgp.recv(0)
    except Exception as exc:
        return _seen(exc)
    return None


def test_backwards_that_cover_different_transfers_are_an_error_naming_both_counts() -> None:
    """Rank 1's backward of microbatch 0 covers two transfers where rank 0's covers one: rank
    0 raises, naming both counts; rank 1, in its next step, is told rank 0 is gone."""
    report, seen = _failed(_backwards_that_differ)
    assert "--- rank 0: CollectiveMismatchError: " in report, report
    assert "rank 1's backward sends 2 gradient(s) to this rank, where this rank's backward " in (
        report
    )
    assert "covers 1 transfer(s) to rank 1" in report
    _, message, _ = seen[1]
    assert "its connection to rank 0 closed" in message.splitlines()[0], message


def _killed_mid_step(rank: int, world: int, stamp: str) -> Seen | None:
    try:
        with dgp.context() as cid:
            if rank == 0:
                x = torch.ones(64, 64, dtype=torch.float64, requires_grad=True)
                dgp.send(x * 2, 1)
                dgp.backward(cid)
            else:
                dgp.recv(0)
                Path(stamp).write_text(str(time.time()))
                os.kill(os.getpid(), signal.SIGKILL)  # before it sends the gradient back
    except Exception as exc:
        return _seen(exc)
    return None


def test_a_peer_killed_mid_step_is_named_within_milliseconds(tmp_path: Path) -> None:
    """Rank 1 is SIGKILLed between its receive and its backward: rank 0, waiting for the
    gradient, fails naming rank 1 and the transfer, long before the group's timeout (20 s)."""
    stamp = tmp_path / "killed"
    try:
        run_on_ranks(_killed_mid_step, 2, args=(str(stamp),), collective_timeout=20, timeout=40)
    except RankFailedError as failure:
        seen = failure.results.get(0)
        assert seen is not None, str(failure)
        assert "--- rank 1: died without reporting (exit code -9)" in str(failure)
    else:
        raise AssertionError("rank 1's death went unnoticed")
    _, message, when = seen
    first = message.splitlines()[0]
    assert "rank 0 was in the backward of dg.pipeline send to rank 1 (transfer 0" in first, first
    assert "its connection to rank 1 closed" in first, first
    assert when - float(stamp.read_text()) < NAMED_WITHIN_S


def _local_mistakes(rank: int, world: int) -> list[str]:
    seen = []
    for mistake in ("outside", "left", "self"):
        try:
            if mistake == "outside":
                dgp.send(torch.ones(2), 1 - rank)
            elif mistake == "left":
                with dgp.context():
                    x = torch.ones(2, requires_grad=True)
                    if rank == 0:
                        dgp.send(x * 2, 1)
                    else:
                        dgp.recv(0)
            else:
                with dgp.context():
                    dgp.send(torch.ones(2), rank)
        except Exception as exc:
            seen.append(f"{type(exc).__name__}: {exc}")
    return seen


def test_local_mistakes_are_worded_for_the_user() -> None:
    """A transfer outside a context; a context left with transfers no backward ran (its
    peers would wait for them); a transfer to this rank itself."""
    seen = run_on_ranks(_local_mistakes, 2)
    for rank, (outside, left, itself) in enumerate(seen):
        assert outside.startswith("PipelineError: dg.pipeline.isend was called outside"), outside
        assert f"PipelineError: rank {rank} leaves dg.pipeline context" in left, left
        way = "send to rank 1" if rank == 0 else "recv from rank 0"
        assert f"transfers no backward ran: {way} (transfer 0" in left, left
        assert itself.startswith("CollectiveArgumentError: dg.pipeline.isend on rank"), itself
        assert f"dst={rank} is this rank itself" in itself, itself


def _shape_changes(rank: int, world: int) -> Seen | None:
    try:
        for step in range(10):  # 8 checked steps, then data only; the tenth changes shape
            rows = 3 if step < 9 else 2
            with dgp.context() as cid:
                if rank == 0:
                    x = torch.ones(rows, 4, dtype=torch.float64, requires_grad=True)
                    dgp.send(x * 2, 1)  # raises at the tenth step
                    dgp.backward(cid)
                else:
                    dgp.backward(cid, [dgp.recv(0).sum()])
    except Exception as exc:
        if rank == 0:
            raise
        return _seen(exc)
    return None


def test_a_shape_that_changes_after_the_checked_calls_is_refused_by_the_sender() -> None:
    """After its checked calls a transfer sends only data, its shape learned: a sender whose
    shape then changes raises (the receiver would read the wrong bytes), naming both shapes
    and how to keep them fixed; the receiver is told the sender is gone."""
    report, seen = _failed(_shape_changes)
    assert "--- rank 0: CollectiveMismatchError: " in report, report
    assert "transfer 0 to rank 1 sends shape (2, 4)" in report, report
    assert "announced shape (3, 4)" in report, report
    assert "dg.pipeline.context(check=True)" in report, report
    _, message, _ = seen[1]
    first = message.splitlines()[0]
    assert "rank 1 was in the forward of dg.pipeline.irecv from rank 0 (transfer 0)" in first
    assert "its connection to rank 0 closed" in first, first
