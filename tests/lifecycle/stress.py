"""The lifecycle stress: real torchrun jobs (tests/lifecycle/job.py), each ending one way, and
how every process of each ended.

    python -m tests.lifecycle.stress --launches 200        # the slow version (tens of minutes)

A launch passes when its clean endings exit 0 with every rank's work done, its failing endings
fail the way they should (the failing rank's own error; the others distgrad's named error,
torchrun's SIGTERM or their own ^C), and nothing aborts, crashes or hangs. A failed launch's
output is shown from around its first crash sign (else its end); --keep writes it whole.
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import os
import re
import signal
import socket
import subprocess
import sys
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

JOB = Path(__file__).with_name("job.py")
ROOT = JOB.parents[2]
DEADLINE_S = 150.0
CLEAN = ("destroy", "no_destroy", "sys_exit")
FAILING = ("raise", "keyboard_interrupt", "sigterm")

_CRASH_SIGNS = {
    "abort": re.compile(r"terminate called|SIGABRT|Signal 6 |exitcode\s*:\s*-6\b|Aborted"),
    "segfault": re.compile(r"SIGSEGV|Signal 11 |exitcode\s*:\s*-11\b|Segmentation fault"),
    "bus error": re.compile(r"SIGBUS|exitcode\s*:\s*-7\b"),
}


@dataclass(frozen=True)
class Launch:
    ending: str
    nproc: int
    code: int | None  # torchrun's exit code; None: it hung and was killed
    output: str
    seconds: float


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def launch(ending: str, nproc: int) -> Launch:
    """Run one torchrun job to its end (or kill it at the deadline)."""
    command = [
        sys.executable, "-m", "torch.distributed.run",
        "--standalone", "--nproc-per-node", str(nproc),
        "--rdzv-endpoint", f"127.0.0.1:{_free_port()}",
        "--max-restarts", "0", "--tee", "3",
        str(JOB), ending,
    ]  # fmt: skip
    env = {**os.environ, "GLOO_SOCKET_IFNAME": "lo", "OMP_NUM_THREADS": "1"}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    started = time.monotonic()
    proc = subprocess.Popen(
        command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env, start_new_session=True
    )
    try:
        output, _ = proc.communicate(timeout=DEADLINE_S)
        code: int | None = proc.returncode
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        output, _ = proc.communicate()
        code = None
    return Launch(ending, nproc, code, output.decode(errors="replace"), time.monotonic() - started)


def problems(run: Launch) -> list[str]:
    """What is wrong with how the launch ended (empty: it ended as it should)."""
    found = [f"{name} at exit" for name, sign in _CRASH_SIGNS.items() if sign.search(run.output)]
    if run.code is None:
        found.append(f"hung: still running after {DEADLINE_S:.0f} s")
        return found
    worked = len(set(re.findall(r"worked (\d+)", run.output)))
    if run.ending in CLEAN:
        if run.code != 0:
            found.append(f"torchrun exited {run.code}")
        if worked != run.nproc:
            found.append(f"{worked} of {run.nproc} ranks finished their work")
    else:
        if run.code == 0:
            found.append("torchrun exited 0 although the job failed")
        if run.ending == "raise" and "injected failure on rank 1" not in run.output:
            found.append("rank 1's own error is not in the output")
        named = "distgrad: rank " in run.output
        terminated = re.search(r"exitcode\s*:\s*-15\b|SIGTERM", run.output) is not None
        if run.ending in ("raise", "sigterm") and not (named or terminated):
            found.append("no survivor got distgrad's error or torchrun's SIGTERM")
    return found


def excerpt(output: str, lines: int = 40) -> list[str]:
    """What to show of a failed launch: the lines up to just past the first crash sign (the
    crashed worker's last words come before it; torchrun's summary after it only names the
    signal), else the last lines."""
    text = output.splitlines()
    signs = re.compile("|".join(sign.pattern for sign in _CRASH_SIGNS.values()))
    first = next((i for i, line in enumerate(text) if signs.search(line)), None)
    end = len(text) if first is None else min(len(text), first + 1 + lines // 4)
    return text[max(0, end - lines) : end] if lines > 0 else []


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--launches", type=int, default=200)
    parser.add_argument("--nproc", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--endings", nargs="+", default=[*CLEAN, *FAILING])
    parser.add_argument("--keep", type=Path, help="write each failing launch's output here")
    parser.add_argument("--lines", type=int, default=40, help="lines of a failure's output shown")
    args = parser.parse_args()
    plan = itertools.islice(itertools.cycle(itertools.product(args.endings, args.nproc)), None)
    tally: Counter[str] = Counter()
    bad = 0
    for index in range(args.launches):
        ending, nproc = next(plan)
        run = launch(ending, nproc)
        found = problems(run)
        tally["ok" if not found else "failed"] += 1
        for problem in found:
            tally[problem.split(":")[0]] += 1
        status = "ok" if not found else "FAILED: " + "; ".join(found)
        print(
            f"{index + 1:4d} {ending:18s} nproc={nproc} {run.seconds:5.1f} s {status}", flush=True
        )
        if found:
            bad += 1
            shown = excerpt(run.output, args.lines)
            print("".join(f"     | {line}\n" for line in shown), end="", flush=True)
            if args.keep:
                args.keep.mkdir(parents=True, exist_ok=True)
                (args.keep / f"launch{index + 1}-{ending}-{nproc}.log").write_text(run.output)
    print(
        f"{args.launches} launches: {bad} failed; "
        + ", ".join(f"{k}: {v}" for k, v in tally.items())
    )
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
