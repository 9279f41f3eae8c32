"""Healthy jobs end clean and failing ones fail the way they should, under the real launcher.

Each case is one torchrun job (``job.py``): every distgrad op and loss, forward and backward,
past the checked calls, then one ending. Asserted, from torchrun's exit code and every worker's
output: a clean ending exits 0 with every rank's work done; a failing one fails with the failing
rank's own error while the others get distgrad's error naming it or torchrun's SIGTERM; no
process aborts, crashes or hangs (``stress.problems``). The slow test is the 200-launch stress
(``python -m tests.lifecycle.stress --launches 200`` runs it outside pytest, with a tally).
"""

from __future__ import annotations

import itertools

import pytest

from tests.lifecycle.stress import CLEAN, FAILING, excerpt, launch, problems

# One clean ending, one failing and one signal in the default tier; every ending, and 4
# processes, in the slow tier (10-18 s a launch), which CI runs.
DEFAULT = {("sigterm", 2)}  # the others in the slow tier, which CI runs


@pytest.mark.timeout(200)
@pytest.mark.parametrize(
    ("ending", "nproc"),
    [
        case if case in DEFAULT else pytest.param(*case, marks=pytest.mark.slow)
        for case in [*((e, 2) for e in (*CLEAN, *FAILING)), ("destroy", 4), ("raise", 4)]
    ],
)
def test_a_torchrun_job_ends_as_it_should(ending: str, nproc: int) -> None:
    run = launch(ending, nproc)
    found = problems(run)
    shown = "\n".join(excerpt(run.output, 80))
    assert not found, f"{ending} on {nproc} processes: {found}\n{shown}"


@pytest.mark.slow
@pytest.mark.timeout(200 * 160)
def test_200_launches_end_as_they_should() -> None:
    plan = itertools.cycle(itertools.product((*CLEAN, *FAILING), (2, 4)))
    failed = []
    for ending, nproc in itertools.islice(plan, 200):
        run = launch(ending, nproc)
        found = problems(run)
        if found:
            failed.append((ending, nproc, found))
    assert not failed, f"{len(failed)} of 200 launches failed: {failed}"
