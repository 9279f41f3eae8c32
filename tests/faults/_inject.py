"""Faults injected into real ranks, and what the surviving rank saw (used by the tests here and
by ``benchmarks/faults.py``).

Two ranks run the same training-like loop of one op, forward and backward, with sizes given
(the loop's path: past the checked first calls, nothing but the data is sent). Rank 1, the
victim, injects a fault at step ``_FAULT_STEP``:

* ``sigkill``: a thread sends the process SIGKILL ``delay`` seconds after the victim enters the
  faulty pass (``delay`` > 0 lands the kill in the middle of a large transfer, or with a large
  ``run_on`` somewhere in a busy loop of small ones; with
  ``in_wait`` the victim sleeps instead of making the call, so the kill lands while its peers
  have waited ``delay`` seconds for it);
* ``exit``: the same thread calls ``os._exit(3)`` instead;
* ``raise``: the victim raises at that point (in the backward: from a hook, so autograd stops)
  and ``run_on_ranks`` reports it and exits the process.

The victim writes the time of its fault to a file first. Rank 0 (and rank 2 on 3 ranks), the
survivor, runs the loop
until an exchange fails and returns what it saw (the time, its own pass, the error), so the
caller computes how long detection took. Both ranks use ``time.time()`` on one machine.
"""

from __future__ import annotations

import os
import signal
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, replace

import torch
import torch.distributed as dist
from torch import Tensor

import distgrad as dg
from distgrad.collectives._signature import CHECKED_CALLS
from distgrad.errors import RankFailedError
from distgrad.testing import run_on_ranks

SMALL = (256, 128)  # 128 KB of float32: point-to-point exchanges of it are waited for inline
LARGE = (8192, 1024)  # 32 MB: waited for by a helper thread while this thread watches the peers
# The ring loss computes [rows, rows] logits per step: its 32 MB of keys are few, long rows.
_RING_LARGE = (64, 131072)
_FAULT_STEP = CHECKED_CALLS + 1  # past the checked calls: the data exchange itself

Op = Callable[[Tensor], Tensor]


def _ring_loss(x: Tensor) -> Tensor:
    rows = [x.shape[0]] * dist.get_world_size()
    return dg.losses.info_nce(x, x * 2, block_size=64, sizes=rows)


def ops(world_size: int, rows: int) -> dict[str, Op]:
    """Every op, called as a training loop calls it: sizes given, rank 0 as root."""
    even = [rows] * world_size
    split = [rows // world_size] * world_size
    # reduce_scatter's pieces add up to the rows whatever the world size (256 rows on 3 ranks)
    pieces = [*split[:-1], rows - sum(split[:-1])]
    ring = [(r + 1) % world_size for r in range(world_size)]
    return {
        "all_gather": lambda x: dg.all_gather(x, sizes=even),
        "all_reduce": lambda x: dg.all_reduce(x),
        "reduce_scatter": lambda x: dg.reduce_scatter(x, sizes=pieces),
        "all_to_all": lambda x: dg.all_to_all(x, input_sizes=split, output_sizes=split),
        "permute": lambda x: dg.permute(x, ring, recv_shape=x.shape),
        "broadcast": lambda x: dg.broadcast(x, 0),
        "reduce": lambda x: dg.reduce(x, 0),
        "gather": lambda x: dg.gather(x, 0, sizes=even),
        "scatter": lambda x: dg.scatter(
            x[: rows // world_size] if dist.get_rank() else x, 0, sizes=split
        ),
        "info_nce (ring)": _ring_loss,
        # Not distgrad: torch's own all_gather under the same fault, for comparison.
        "torch all_gather": _torch_all_gather,
    }


# torch 2.13's name for all_gather_into_tensor (the old name warns)
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


def _torch_all_gather(x: Tensor) -> Tensor:
    out = x.new_empty((x.shape[0] * dist.get_world_size(), *x.shape[1:]))
    _all_gather_single(out, x.detach().contiguous())
    return out


def named(op: str, where: str) -> str:
    """How the survivor's error names ``op``: in the forward as it was called, in the backward
    by the autograd node that runs it (the ring losses' is ``ring_reduce``)."""
    if op == "info_nce (ring)":
        return "info_nce" if where == "forward" else "ring_reduce"
    return op.removeprefix("torch ")


@dataclass(frozen=True)
class Fault:
    op: str
    shape: tuple[int, int] = SMALL
    where: str = "forward"  # or "backward"
    kind: str = "sigkill"  # or "exit", "raise"
    delay: float = 0.0
    fault_file: str = ""
    in_wait: bool = False
    # Steps run after the fault's: a few (the fault ends the loop at its step), or many for a
    # kill ``delay`` seconds into a busy loop of small exchanges (it lands in whichever call
    # is running then).
    run_on: int = 5


@dataclass(frozen=True)
class Seen:
    """What the survivor saw: when, in which of its passes, and the error (None: no error)."""

    when: float
    where: str
    error_type: str | None
    message: str


def run_fault(rank: int, world_size: int, fault: Fault) -> Seen:
    """The loop on each rank; rank 1 injects ``fault``, the others return what they saw."""
    shape = _RING_LARGE if fault.op == "info_nce (ring)" and fault.shape == LARGE else fault.shape
    op = ops(world_size, shape[0])[fault.op]
    gen = torch.Generator().manual_seed(rank)
    x = torch.randn(shape, generator=gen, requires_grad=True)
    differentiable = fault.op != "torch all_gather"
    where = "forward"
    try:
        for step in range(_FAULT_STEP + fault.run_on):
            inject = rank == 1 and step == _FAULT_STEP
            where = "forward"
            if inject and fault.where == "forward":
                _inject(fault)
            y = op(x)
            if not differentiable:
                continue
            where = "backward"
            if inject and fault.where == "backward":
                y.register_hook(lambda g: _inject(fault) or g)
            y.backward(torch.ones_like(y))
    except Exception as exc:
        if rank == 1:
            raise
        return Seen(time.time(), where, type(exc).__name__, str(exc))
    if rank == 1:
        time.sleep(60)  # a fault that did not end this process: let the survivor's view show
    return Seen(time.time(), where, None, "")


def _inject(fault: Fault) -> None:
    if fault.kind == "raise":
        _stamp(fault)
        raise RuntimeError(f"injected fault in the {fault.where} of {fault.op}")

    def end() -> None:
        time.sleep(fault.delay)
        _stamp(fault)
        if fault.kind == "exit":
            os._exit(3)
        os.kill(os.getpid(), signal.SIGKILL)

    threading.Thread(target=end, daemon=True).start()
    if fault.delay == 0 or fault.in_wait:
        time.sleep(fault.delay + 1)  # the thread ends this process before the op starts


def _stamp(fault: Fault) -> None:
    with open(fault.fault_file, "w") as f:
        f.write(repr(time.time()))


def inject(
    fault: Fault, collective_timeout: float, grace: float, world_size: int = 2
) -> tuple[RankFailedError | None, float | None]:
    """Run ``fault`` on ``world_size`` fresh ranks (rank 1 the victim, every other rank a
    survivor): the harness's failure (None: no rank failed) and the time of the fault (None: it
    never happened). The fault's time file is made and removed here."""
    handle, path = tempfile.mkstemp(prefix="distgrad-fault-")
    os.close(handle)
    try:
        failure = None
        try:
            run_on_ranks(
                run_fault,
                world_size,
                args=(replace(fault, fault_file=path),),
                timeout=60,
                collective_timeout=collective_timeout,
                grace=grace,
            )
        except RankFailedError as exc:
            failure = exc
        with open(path) as f:
            stamp = f.read()
        return failure, float(stamp) if stamp else None
    finally:
        os.unlink(path)
