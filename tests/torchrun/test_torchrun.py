"""torchrun as users launch it: two "nodes" on loopback, each a torchrun agent, meeting through
the c10d rendezvous, running a short DDP training with a distgrad loss (tests/torchrun/train.py).

Semantics asserted: after 3 SGD steps every worker's parameters (encoder and the loss module's
learnable scale) equal those of one process trained on the whole batch, float64, tolerance
1e-10 (reduction order). The test launches torchrun itself (it cannot go through
run_on_ranks): each agent has a deadline, and on any failure the agents are terminated, then
killed, and every worker whose pid was recorded is killed too (torchrun starts each worker in a
session of its own, so killing an agent's process group does not reach them).
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from tests._support import FLOAT64
from tests.torchrun import train

SCRIPT = Path(train.__file__)
ROOT = SCRIPT.parents[2]
DEADLINE_S = 120.0
# pytest's own timeout must leave room after the deadline for stopping the agents and printing
# their logs: a pytest timeout that fires first hides why the job did not finish.
TEST_TIMEOUT_S = DEADLINE_S + 60


def _free_port() -> int:
    # A small race remains between closing this socket and the rendezvous binding the port.
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def _agent(node: int, per_node: int, port: int, out: Path) -> subprocess.Popen[bytes]:
    command = [
        sys.executable, "-m", "torch.distributed.run",  # the torchrun program
        "--nnodes", "2",
        "--nproc-per-node", str(per_node),
        "--rdzv-backend", "c10d",
        "--rdzv-endpoint", f"127.0.0.1:{port}",
        "--rdzv-id", f"distgrad-test-{port}",
        "--rdzv-conf", "join_timeout=60",
        "--local-addr", "127.0.0.1",
        "--max-restarts", "0",
        str(SCRIPT), str(out),
    ]  # fmt: skip
    env = {**os.environ, "GLOO_SOCKET_IFNAME": "lo", "OMP_NUM_THREADS": "1"}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    with (out / f"agent{node}.log").open("wb") as log:  # the agent keeps its own copy
        return subprocess.Popen(
            command, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=out, start_new_session=True
        )


def _stop(agents: list[subprocess.Popen[bytes]], out: Path) -> None:
    """Terminate the agents (they stop their workers), then kill whatever is left."""
    for agent in agents:
        if agent.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(agent.pid, signal.SIGTERM)
    for agent in agents:
        try:
            agent.wait(timeout=10)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(agent.pid, signal.SIGKILL)
            agent.wait(timeout=10)
    for pid_file in out.glob("pid*"):
        with contextlib.suppress(ProcessLookupError, ValueError, PermissionError):
            os.kill(int(pid_file.read_text()), signal.SIGKILL)


def _launch(per_node: int, out: Path) -> None:
    port = _free_port()
    agents = [_agent(node, per_node, port, out) for node in range(2)]
    deadline = time.monotonic() + DEADLINE_S
    try:
        for agent in agents:
            agent.wait(timeout=max(1.0, deadline - time.monotonic()))
    except subprocess.TimeoutExpired:
        pass
    finally:
        _stop(agents, out)
    codes = [agent.returncode for agent in agents]
    if codes != [0, 0]:
        logs = "\n".join(
            f"--- agent {node} (exit {code}):\n{(out / f'agent{node}.log').read_text()[-20000:]}"
            for node, code in enumerate(codes)
        )
        pytest.fail(f"torchrun agents exited with {codes} (deadline {DEADLINE_S:.0f} s)\n{logs}")


@pytest.mark.timeout(TEST_TIMEOUT_S)
@pytest.mark.parametrize(  # 2x2 (4 workers on 2 cores, 15 s) in the slow tier, which CI runs
    "per_node", [pytest.param(1, id="2x1"), pytest.param(2, id="2x2", marks=pytest.mark.slow)]
)
def test_ddp_training_launched_by_torchrun_on_two_nodes_equals_one_process(
    per_node: int, tmp_path: Path
) -> None:
    _launch(per_node, tmp_path)
    encoder, criterion = train.make_models()
    train.train(encoder, criterion, *train.batch())
    expected = train.parameters(encoder, criterion)
    world = 2 * per_node
    for rank in range(world):
        got = torch.load(tmp_path / f"rank{rank}.pt")
        assert got.keys() == expected.keys()
        for name, value in expected.items():
            torch.testing.assert_close(got[name], value, **FLOAT64, msg=f"rank {rank} {name}")
