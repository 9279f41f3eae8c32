"""examples/pipeline.py under torchrun: both pipelines agree with one process on every rank,
and every process exits 0, over 5 launches (issue: count the exit codes).

torchrun's exit code is 0 only when every worker exited 0; each worker also prints its two
verdicts and, after destroying its process group, a last line, so a worker that aborts in
teardown (after its work) is seen too. No crash sign may appear in the output.
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "pipeline.py"
DEADLINE_S = 120.0
LAUNCHES = 5
CRASH = re.compile(
    r"terminate called|Aborted|Segmentation fault|Fatal Python error|exitcode\s*:\s*-"
)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def _launch(nproc: int) -> tuple[int | None, str]:
    command = [
        sys.executable, "-m", "torch.distributed.run",
        "--standalone", "--nproc-per-node", str(nproc),
        "--rdzv-endpoint", f"127.0.0.1:{_free_port()}",
        "--max-restarts", "0", "--tee", "3",
        str(EXAMPLE),
    ]  # fmt: skip
    env = {**os.environ, "GLOO_SOCKET_IFNAME": "lo", "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen(
        command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env, start_new_session=True
    )
    try:
        output, _ = proc.communicate(timeout=DEADLINE_S)
        return proc.returncode, output.decode(errors="replace")
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        output, _ = proc.communicate()
        return None, output.decode(errors="replace")


@pytest.mark.slow
@pytest.mark.timeout(LAUNCHES * (DEADLINE_S + 10))
def test_the_pipeline_example_agrees_and_every_process_exits_0_over_5_launches() -> None:
    nproc = 2
    clean = 0
    for launch in range(LAUNCHES):
        code, output = _launch(nproc)
        tail = "\n".join(output.splitlines()[-30:])
        assert code == 0, f"launch {launch}: torchrun exited {code}\n{tail}"
        assert not CRASH.search(output), f"launch {launch}: a crash sign\n{tail}"
        for rank in range(nproc):
            for name in ("torch Schedule1F1B", "distgrad.pipeline"):
                assert re.search(rf"rank {rank} stage {rank}: {re.escape(name)}\s+AGREE", output)
            assert f"rank {rank}: done, process group destroyed" in output, tail
            clean += 1
    assert clean == LAUNCHES * nproc  # 10 processes, each exited 0 after its last line
