"""Six canonical RPC programs (examples/rpc_programs: parameter server, RNN with a remote
embedding, pipeline with micro-batches, DDP with RPC, batch-updating parameter server,
agent/observer) run with torch's modules and with distgrad's, the import switched alone:
every value they compute (losses, parameters after every optimizer step) is equal bit for bit
at every step, and every process exits 0.

FAST in the default run; SMART (where distributed autograd runs) under ``-m slow``, to keep
the default suite short. The ratio of step times is printed by benchmarks/rpc_programs.py,
not asserted here."""

from __future__ import annotations

import pytest
from examples.rpc_programs import AUTOGRAD_PROGRAMS, PROGRAMS
from examples.rpc_programs.runner import differences, launch


@pytest.mark.parametrize("name", PROGRAMS)
def test_program_computes_what_torch_computes_fast(name: str) -> None:
    """FAST: equal to torch at every step, on every rank."""
    assert differences(launch(name, "torch"), launch(name, "fast")) == []


@pytest.mark.slow
@pytest.mark.parametrize("name", AUTOGRAD_PROGRAMS)
def test_program_computes_what_torch_computes_smart(name: str) -> None:
    """SMART: equal to torch at every step, on every rank."""
    assert differences(launch(name, "torch"), launch(name, "smart")) == []
