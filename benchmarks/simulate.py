"""The checker simulated (every rank in this process, LocalTensorMode) against on processes.

Two checks, each timed both ways in the same process, in a shuffled order every round:

* the README's example, read from README.md and saved as ``check_info_nce.py`` in a temporary
  folder, as the README says: ``check_against_single_process(info_nce, make_inputs(),
  world_size=2)`` in Python (the call's wall time), and at 8 ranks;
* ``distgrad check check_info_nce.py:info_nce`` on that saved file, as a user runs it, a new
  Python process each time: the command's wall time, torch's import included.

Reported: the median of the paired ratios (simulated over processes, same round) and each
side's median, per run; then the range over runs. Writes benchmarks/results/simulate.md.

    .venv/bin/python benchmarks/simulate.py [--rounds 10] [--runs 3]
"""

from __future__ import annotations

import argparse
import functools
import importlib
import os
import random
import re
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from types import ModuleType

import torch
import torch.distributed as dist
import torch.nn.functional as F

import distgrad as dg

ROOT = Path(__file__).resolve().parents[1]


@functools.cache
def _readme_example() -> ModuleType:
    """The README's first python block, saved as the README says (check_info_nce.py) in a
    temporary folder, imported by module name as the checker's ranks import it."""
    block = re.search(r"```python\n(.*?)```", (ROOT / "README.md").read_text(), re.S)
    assert block is not None, "README.md has no python example"
    folder = Path(tempfile.mkdtemp(prefix="distgrad-simulate-"))
    (folder / "check_info_nce.py").write_text(block.group(1))
    sys.path.insert(0, str(folder))
    return importlib.import_module("check_info_nce")


def _python_check(simulate: bool, world_size: int = 2) -> float:
    readme = _readme_example()
    started = time.perf_counter()
    report = dg.testing.check_against_single_process(
        readme.info_nce, readme.make_inputs(), world_size=world_size, simulate=simulate
    )
    assert report.ok, str(report)
    return time.perf_counter() - started


def _cli_check(simulate: bool) -> float:
    example = _readme_example().__file__
    command = [sys.executable, "-m", "distgrad", "check", f"{example}:info_nce"]
    started = time.perf_counter()
    done = subprocess.run(
        [*command, *(["--simulate"] if simulate else [])],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr
    return time.perf_counter() - started


def _one_run(rounds: int) -> dict[str, tuple[float, float, float]]:
    """{check: (median ratio, median simulated s, median processes s)}."""
    out = {}
    checks: list[tuple[str, Callable[[bool], float]]] = [
        ("README example (Python)", _python_check),
        ("distgrad check", _cli_check),
        ("README example on 8 ranks (Python)", lambda simulate: _python_check(simulate, 8)),
    ]
    for name, timed in checks:
        timed(True), timed(False)  # warm: the forkserver, the imports
        ratios, sims, procs = [], [], []
        for _ in range(rounds):
            order = [True, False]
            random.shuffle(order)
            seconds = {simulate: timed(simulate) for simulate in order}
            sims.append(seconds[True])
            procs.append(seconds[False])
            ratios.append(seconds[True] / seconds[False])
        out[name] = (statistics.median(ratios), statistics.median(sims), statistics.median(procs))
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--runs", type=int, default=3)
    args = parser.parse_args()
    torch.set_num_threads(1)
    runs = [_one_run(args.rounds) for _ in range(args.runs)]
    load = os.getloadavg()[0]
    lines = [
        "# The checker simulated against on processes",
        "",
        f"`benchmarks/simulate.py --rounds {args.rounds} --runs {args.runs}`: torch "
        f"{torch.__version__}, {os.cpu_count()} cores, load average {load:.2f} at the end "
        "(the machine was shared with other engineers' work). The example is the README's "
        "as written there (`sizes=` given), saved as check_info_nce.py; `distgrad check` runs "
        "on that file. Each round times both ways "
        "in a shuffled order; a ratio is simulated over processes in the same round "
        "(below 1: the simulation is faster).",
        "",
        "| check (2 ranks unless said) | run | median ratio | simulated (s) | processes (s) |",
        "| --- | --- | --- | --- | --- |",
    ]
    for name in runs[0]:
        for i, run in enumerate(runs):
            ratio, sim, proc = run[name]
            lines.append(f"| {name} | {i + 1} | {ratio:.3f} | {sim:.3f} | {proc:.3f} |")
    lines.append("")
    for name in runs[0]:
        ratios = [run[name][0] for run in runs]
        lines.append(
            f"- {name}: simulated / processes {min(ratios):.3f}-{max(ratios):.3f} over "
            f"{len(runs)} runs ({1 / max(ratios):.1f}x-{1 / min(ratios):.1f}x faster)."
        )
    text = "\n".join(lines) + "\n"
    (ROOT / "benchmarks" / "results" / "simulate.md").write_text(text)
    print(text)


# ---------------------------------------------------------------------------------------------
# What simulates: `--support` checks each pattern simulated and on processes and says whether
# the verdicts are the same, or why the simulation refused (docs/checker.md quotes the table).

_W = torch.randn(64, 3, dtype=torch.float64, generator=torch.Generator().manual_seed(1))


def _world() -> int:
    return dist.get_world_size() if dist.is_initialized() else 1


def _weights(x: torch.Tensor) -> torch.Tensor:
    return _W.narrow(0, 0, x.shape[0]).narrow(1, 0, x.shape[1])  # (x[:n] cannot simulate)


def p_all_gather(x: torch.Tensor) -> torch.Tensor:
    return (dg.all_gather(x) * _weights(dg.all_gather(x))).sum()


def p_all_gather_async(x: torch.Tensor) -> torch.Tensor:
    y = dg.all_gather(x, async_op=True)
    return (y * _W[:8, : x.shape[1]]).sum()


def _reduced(x: torch.Tensor, op: str) -> torch.Tensor:
    return (dg.all_reduce(x.sum(0, keepdim=True), op) * _W[:1, : x.shape[1]]).sum()


def p_all_reduce_sum(x: torch.Tensor) -> torch.Tensor:
    return _reduced(x, "sum")


def p_all_reduce_avg(x: torch.Tensor) -> torch.Tensor:
    return _reduced(x, "avg")


def p_all_reduce_max(x: torch.Tensor) -> torch.Tensor:
    return _reduced(x, "max")


def p_reduce_scatter(x: torch.Tensor) -> torch.Tensor:
    full = dg.all_gather(x)
    sizes = dg.all_gather(torch.full((1,), x.shape[0])).tolist()
    return (dg.reduce_scatter(full * _weights(full), sizes=sizes) * x).sum()


def p_all_to_all(x: torch.Tensor) -> torch.Tensor:
    return (dg.all_to_all(x) * _weights(x)).sum()


def p_broadcast(x: torch.Tensor) -> torch.Tensor:
    return (dg.broadcast(x, 0) * _weights(x)).sum()


def p_reduce(x: torch.Tensor) -> torch.Tensor:
    return (dg.reduce(x, 0) * _weights(x)).sum()


def p_gather(x: torch.Tensor) -> torch.Tensor:
    out = dg.gather(x, 0)
    return (out * _weights(out)).sum() if out is not None else (x * 0).sum()


def p_scatter(x: torch.Tensor) -> torch.Tensor:
    full = dg.all_gather(x)
    return (dg.scatter(full, 0) * _weights(x)).sum()


def p_permute(x: torch.Tensor) -> torch.Tensor:
    perm = [(r + 1) % _world() for r in range(_world())]
    out = dg.permute(x, perm)  # the source's rows
    return (out * _weights(out)).sum()


def p_sub_group(x: torch.Tensor) -> torch.Tensor:
    if not dist.is_initialized():
        return (x * _weights(x)).sum()
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("a", "b"))
    return (dg.all_gather(x, group=(mesh, "b")) ** 2).sum()


def p_info_nce_loss(x: torch.Tensor) -> torch.Tensor:
    return dg.losses.info_nce(x, x.flip(1))


def p_info_nce_ring(x: torch.Tensor) -> torch.Tensor:
    return dg.losses.info_nce(x, x.flip(1), block_size=2)


def p_clip_loss(x: torch.Tensor) -> torch.Tensor:
    return dg.losses.clip_loss(x, x.flip(1))


def p_siglip_loss(x: torch.Tensor) -> torch.Tensor:
    return dg.losses.siglip_loss(x, x.flip(1))


def p_nt_xent(x: torch.Tensor) -> torch.Tensor:
    return dg.losses.nt_xent(x, x.flip(1))


def p_barlow_twins(x: torch.Tensor) -> torch.Tensor:
    return dg.losses.barlow_twins(x, x.flip(1))


def p_clip_ring(x: torch.Tensor) -> torch.Tensor:
    return dg.losses.clip_loss(x, x.flip(1), block_size=2)


def p_cross_entropy(x: torch.Tensor) -> torch.Tensor:
    """A user's InfoNCE with torch's fused cross-entropy (the README's, for uneven shards)."""
    keys = dg.all_gather(x.flip(1))
    offset = dg.all_gather(torch.full((1,), x.shape[0]))[: _rank()].sum()
    return F.cross_entropy(x @ keys.T, torch.arange(x.shape[0]) + offset, reduction="sum")


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


# (pattern, world size, shards): None is the checker's even split of 8 rows.
SUPPORT = [
    (p_all_gather, 2, None),
    (p_all_gather, 3, [5, 0, 3]),
    (p_all_gather_async, 2, None),
    (p_reduce_scatter, 3, [4, 1, 3]),
    (p_all_to_all, 2, None),
    (p_broadcast, 2, None),
    (p_reduce, 2, None),
    (p_gather, 3, [4, 1, 3]),
    (p_scatter, 2, None),
    (p_permute, 3, [4, 1, 3]),
    (p_all_reduce_sum, 2, None),
    (p_all_reduce_avg, 2, None),
    (p_all_reduce_max, 2, None),
    (p_sub_group, 4, None),
    (p_info_nce_loss, 3, [5, 0, 3]),
    (p_clip_loss, 3, [5, 0, 3]),
    (p_siglip_loss, 3, [5, 0, 3]),
    (p_nt_xent, 3, [5, 0, 3]),
    (p_barlow_twins, 3, [5, 0, 3]),
    (p_info_nce_ring, 4, None),
    (p_clip_ring, 4, None),
    (p_clip_ring, 3, [5, 0, 3]),
    (p_cross_entropy, 2, None),
    (p_cross_entropy, 3, [5, 0, 3]),
]


def support() -> None:
    """Each pattern checked simulated and on processes: the same verdict, or why refused.
    Writes benchmarks/results/simulate_support.md (docs/checker.md's table reads it)."""
    import warnings

    warnings.simplefilter("ignore")
    x = {"x": torch.randn(8, 3, dtype=torch.float64, generator=torch.Generator().manual_seed(0))}
    rows = [
        "# What simulates",
        "",
        f"`benchmarks/simulate.py --support`, torch {torch.__version__}: each pattern checked "
        "with `simulate=True` and on processes (8 rows of float64, the shards shown).",
        "",
        "| pattern | ranks | shards | simulated |",
        "| --- | --- | --- | --- |",
    ]
    for fn, world, shards in SUPPORT:
        head = f"| `{fn.__name__[2:]}` | {world} | {shards or 'even'} |"
        kwargs = {"world_size": world, "shard_sizes": shards}
        try:
            simulated = dg.testing.check_against_single_process(fn, x, simulate=True, **kwargs)
        except Exception as exc:
            rows.append(f"{head} refused: {str(exc).split(': ', 2)[-1][:200]} |")
            continue
        try:
            processes = dg.testing.check_against_single_process(fn, x, **kwargs)
        except Exception as exc:
            rows.append(f"{head} processes raised {type(exc).__name__} |")
            continue
        same = (simulated.ok, simulated.diagnoses) == (processes.ok, processes.diagnoses)
        verdict = "AGREE" if simulated.ok else "MISMATCH"
        rows.append(f"{head} {'same' if same else 'DIFFERENT'} verdict ({verdict}) |")
    text = "\n".join(rows) + "\n"
    (ROOT / "benchmarks" / "results" / "simulate_support.md").write_text(text)
    print(text)


if __name__ == "__main__" and "--support" in sys.argv:
    support()
    sys.exit(0)


if __name__ == "__main__":
    main()
