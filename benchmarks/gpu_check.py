"""One command that checks distgrad on the GPUs of this machine and writes what it found.

Run from the repository root: ``python benchmarks/gpu_check.py`` (at most about 10 minutes on
one GPU). It uses every visible GPU, one rank per GPU on NCCL; with a single GPU it runs NCCL
at world size 1 and gloo with CUDA tensors at world size 2 (gloo lacks CUDA support for some
exchanges: each op's row says what happened). Eight parts, each a table in the results file:

* ``gradients``: the gradient sweep of every op (tests/collectives/reference.py, the sweep the
  test suite runs on CPU) against single-process autograd, float64 and float32.
* ``losses``: every loss function and loss module, dense and ring paths, float32 and under
  bfloat16 autocast, against the float64 single-process loss of the same features, with the
  tolerances of docs/losses.md and tests/losses/test_precision.py; then CLIP's
  forward+backward time and peak memory at world size 1, dense and ring against plain torch
  (one logits matrix).
* ``sync``: every op and loss past the checked calls, one by one, under
  ``torch.cuda.set_sync_debug_mode("warn")`` (each host synchronisation listed), then a
  training step under ``"error"``.
* ``guard``: the opt-in data guard's exchanges under ``set_sync_debug_mode("error")``, and a
  mismatched tag raised at the next guarded call (CUDA) or at once (CPU).
* ``compile``: the same calls in one step under ``torch.compile(fullgraph=True)`` (inductor):
  one graph, no break, eager's gradients.
* ``memory``: peak GPU memory of the dense and ring CLIP loss at global batch 16k and 32k.
* ``timing``: forward+backward time of every op at three sizes against torch's c10d
  collectives (the same exchanges, no autograd) and funcol's differentiable collectives, as
  paired ratios.
* ``scale``: CLIP and SigLIP at global batch 32k, 128k and 1M, dim 512 and 768, on one GPU:
  the fused Triton kernels, the torch ring, dense, plain torch and Inf-CL (where installed),
  time and peak memory per row.

``--device cpu`` runs every part on gloo with CPU tensors at small sizes, to prove the
command's logic where no GPU is present (the test suite does that:
tests/benchmarks/test_gpu_check.py);
it writes ``results/gpu_check_cpu.md``, which is labelled as a CPU run. ``results/gpu_check.md``
is reserved for GPU runs. A part that cannot run on the hardware present says so in a row
("not run: ..."); none is silently left out. ``--parts`` picks parts.

Each part is a module of ``benchmarks/gpu/`` (``gpu/gradients.py``, ..., ``gpu/timing.py``, beside
what they share: ``step``, ``ranks``, ``report``); this file is the command.
"""

from __future__ import annotations

import argparse
import sys
import time
import traceback
from collections.abc import Callable, Sequence
from pathlib import Path

import torch

# The parts import tests.collectives.reference from the repository root, and are the package
# gpu in this folder (a script's folder is on sys.path already, not a file imported by path).
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.append(str(Path(__file__).resolve().parent))

from gpu import compile as compiled  # the module, not the builtin
from gpu import gradients, guard, losses, memory, scale, sync, timing
from gpu.ranks import short
from gpu.report import Section, one_row, render

RESULTS = Path(__file__).parent / "results"
PARTS = ("gradients", "losses", "sync", "guard", "compile", "memory", "timing", "scale")
RUNNERS: dict[str, Callable[[str, int], Section]] = {
    "gradients": gradients.part,
    "losses": losses.part,
    "sync": sync.part,
    "guard": guard.part,
    "compile": compiled.part,
    "memory": memory.part,
    "timing": timing.part,
    "scale": scale.part,
}


def run(
    device: str, parts: Sequence[str], on_part: Callable[[list[Section]], None] | None = None
) -> list[Section]:
    """Every chosen part; a part that cannot run here, or fails outright, is a row saying so.
    ``on_part`` sees the sections so far after each part: the results file is rewritten then, so
    a run cut off by a machine's time limit still leaves what it measured."""
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    sections: list[Section] = []
    for part in parts:
        started = time.monotonic()
        if device == "cuda" and gpus == 0:
            sections.append(one_row(part, "not run: no CUDA device (torch.cuda is not available)"))
            continue
        try:
            sections.append(RUNNERS[part](device, gpus))
        except Exception as exc:  # the other parts still run and the file is still written
            traceback.print_exc()
            sections.append(one_row(part, f"FAIL: the part itself failed: {short(exc)}"))
        print(f"{part}: {time.monotonic() - started:.1f} s", flush=True)
        if on_part is not None:
            on_part(sections)
    return sections


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    parser.add_argument(
        "--parts", default=",".join(PARTS), help=f"comma-separated: {','.join(PARTS)}"
    )
    parser.add_argument(
        "--out",
        type=Path,
        default=None,
        help="results file (default: results/gpu_check.md, or gpu_check_cpu.md with --device cpu)",
    )
    args = parser.parse_args(argv)
    parts = [p for p in args.parts.split(",") if p]
    unknown = sorted(set(parts) - set(PARTS))
    if unknown:
        parser.error(f"unknown parts {unknown}; choose from {','.join(PARTS)}")
    out = args.out or RESULTS / ("gpu_check.md" if args.device == "cuda" else "gpu_check_cpu.md")
    started = time.monotonic()
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0

    def write(sections: list[Section]) -> None:
        out.write_text(render(sections, args.device, gpus, time.monotonic() - started))

    sections = run(args.device, parts, on_part=write)
    write(sections)
    print(f"wrote {out}")
    failed = sum(s.counts()["FAIL"] for s in sections)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
