"""At exit, distgrad's handler lets a helper thread left waiting by an abandoned exchange (a ^C
during ``wait_pairs``) finish while the interpreter can still give it the GIL; a helper that
cannot finish (its peer died mid-transfer) holds the exit up only for the grace.

The abort this prevents needs interpreter finalisation, which only a real torchrun job has
(``stress --endings keyboard_interrupt --nproc 4``: 5 of 23 launches aborted before); here the
handler's waiting is checked in-process, on a stand-in for gloo's work.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from types import SimpleNamespace

import pytest

from distgrad._exchange import inflight
from distgrad._exchange import wait as _wait


class _Work:
    """A point-to-point work whose ``wait`` returns once ``done`` is set."""

    def __init__(self) -> None:
        self.done = threading.Event()

    def wait(self) -> None:
        self.done.wait()


@pytest.fixture
def work() -> Iterator[_Work]:
    w = _Work()
    yield w
    w.done.set()  # never leave a helper blocked behind the test
    deadline = time.monotonic() + 5
    while _wait.busy_helpers() and time.monotonic() < deadline:
        time.sleep(0.001)


def _abandon(work: _Work) -> None:
    """What a ^C in ``wait_pairs`` leaves behind: the job submitted, nobody waiting for it."""
    _wait._submit(_wait._Job([work]))
    deadline = time.monotonic() + 5
    while not _wait.busy_helpers() and time.monotonic() < deadline:
        time.sleep(0.001)
    assert _wait.busy_helpers()


def test_exit_waits_for_a_helper_until_its_exchange_ends(work: _Work) -> None:
    _abandon(work)
    threading.Timer(0.2, work.done.set).start()  # the peers catch up
    start = time.monotonic()
    inflight._let_helpers_finish()
    waited = time.monotonic() - start
    assert not _wait.busy_helpers()
    assert 0.15 < waited < inflight._HELPERS_GRACE_S


def test_exit_gives_up_on_a_stuck_helper_after_the_grace(
    work: _Work, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(inflight, "_HELPERS_GRACE_S", 0.1)
    _abandon(work)
    start = time.monotonic()
    inflight._let_helpers_finish()
    assert 0.1 <= time.monotonic() - start < 1.0
    assert _wait.busy_helpers()  # still blocked: the exit goes on without it


def test_exit_costs_nothing_without_a_busy_helper(monkeypatch: pytest.MonkeyPatch) -> None:
    # Asserted as "never sleeps", not as a time: a loaded machine can stretch any time.
    slept: list[float] = []
    clock = SimpleNamespace(monotonic=time.monotonic, sleep=slept.append)
    monkeypatch.setattr(inflight, "time", clock)
    inflight._let_helpers_finish()
    assert slept == []
