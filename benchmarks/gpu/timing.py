"""Part ``timing``: every op's forward+backward time against torch's c10d collectives, the
autograd floor and funcol, as paired ratios."""

from __future__ import annotations

import random
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from tests.collectives.reference import warm_up
from torch import Tensor

import distgrad as dg

from .ranks import bind, on_ranks, setups
from .report import Section
from .step import OPS

# torch 2.13 renamed these (the old names warn); older releases have only the old names.
_ALL_GATHER = getattr(dist, "all_gather_single", dist.all_gather_into_tensor)
_REDUCE_SCATTER = getattr(dist, "reduce_scatter_single", dist.reduce_scatter_tensor)


def _c10d(op: str, x: Tensor, n: int, rank: int) -> None:
    """The exchanges of ``op``'s forward and backward with torch's c10d collectives, no
    autograd: the floor distgrad's ops are compared with."""
    nccl = dist.get_backend() == "nccl"

    def scatter_reduce(big: Tensor) -> Tensor:  # gloo has no reduce_scatter
        out = big.new_empty(big.shape[0] // n, *big.shape[1:])
        if nccl:
            _REDUCE_SCATTER(out, big)
            return out
        summed = big.clone()
        dist.all_reduce(summed)
        return summed[rank * out.shape[0] : (rank + 1) * out.shape[0]]

    def gather_all(small: Tensor) -> Tensor:
        out = small.new_empty(small.shape[0] * n, *small.shape[1:])
        _ALL_GATHER(out, small)
        return out

    if op in ("all_gather", "reduce_scatter"):
        y = gather_all(x) if op == "all_gather" else scatter_reduce(x)
        gather_all(y) if op == "reduce_scatter" else scatter_reduce(y)
    elif op == "all_reduce":
        for _ in range(2):
            dist.all_reduce(x.clone())
    elif op == "all_to_all":
        for _ in range(2):
            dist.all_to_all_single(torch.empty_like(x), x)
    elif op in ("broadcast", "reduce"):
        first, second = (
            (dist.broadcast, dist.reduce) if op == "broadcast" else (dist.reduce, dist.broadcast)
        )
        first(x.clone(), 0)
        second(x.clone(), 0)
    elif op in ("gather", "scatter"):  # a gather and a scatter of one rank's part, in order
        part = x[: x.shape[0] // n] if op == "scatter" else x
        parts = [torch.empty_like(part) for _ in range(n)] if rank == 0 else None
        pieces = list(part.repeat(n, 1).chunk(n)) if rank == 0 else None
        if op == "gather":
            dist.gather(part, parts, 0)
            dist.scatter(torch.empty_like(part), pieces, 0)
        else:
            dist.scatter(torch.empty_like(part), pieces, 0)
            dist.gather(part, parts, 0)
    elif op == "permute" and n > 1:
        for _ in range(2):
            got = torch.empty_like(x)
            ops = [
                dist.P2POp(dist.isend, x, (rank + 1) % n),
                dist.P2POp(dist.irecv, got, (rank - 1) % n),
            ]
            for work in dist.batch_isend_irecv(ops):
                work.wait()


def _distgrad(op: str, x: Tensor, n: int, rank: int) -> Tensor:
    sizes = [x.shape[0]] * n
    if op == "all_gather":
        return dg.all_gather(x, sizes=sizes)
    if op == "reduce_scatter":
        return dg.reduce_scatter(x)
    if op == "all_reduce":
        return dg.all_reduce(x)
    if op == "all_to_all":
        return dg.all_to_all(x)
    if op == "broadcast":
        return dg.broadcast(x, 0)
    if op == "reduce":
        return dg.reduce(x, 0)
    if op == "gather":
        return dg.gather(x, 0, sizes=sizes)
    if op == "scatter":
        part = x.shape[0] // n
        mine = x if rank == 0 else x[:part]
        return dg.scatter(mine, 0, sizes=[part] * n)
    return dg.permute(x, [(r + 1) % n for r in range(n)], recv_shape=tuple(x.shape))


def _funcol(op: str, x: Tensor, n: int) -> Tensor | None:
    """funcol's differentiable collective for ``op``, where it has one."""
    import torch.distributed._functional_collectives as funcol

    group = dist.group.WORLD
    assert group is not None
    # torch 2.13's names; the older ones (still there, warning) on earlier releases.
    if op == "all_gather":
        gather = getattr(funcol, "all_gather_single_autograd", None)
        return (gather or funcol.all_gather_tensor_autograd)(x, 0, group)
    if op == "reduce_scatter":
        scatter = getattr(funcol, "reduce_scatter_single_autograd", None)
        return (scatter or funcol.reduce_scatter_tensor_autograd)(x, "sum", 0, group)
    if op == "all_reduce":
        return funcol.all_reduce(x, "sum", group)  # differentiable for "sum" only
    if op == "all_to_all":
        return funcol.all_to_all_single_autograd(x, None, None, group)
    return None


FUNCOL_OPS = ("all_gather", "reduce_scatter", "all_reduce", "all_to_all")


def _timed(step: Callable[[], None], where: torch.device) -> float:
    if where.type == "cuda":
        torch.cuda.synchronize()
    start = time.perf_counter()
    step()
    if where.type == "cuda":
        torch.cuda.synchronize()
    return time.perf_counter() - start


def _times(
    rank: int, n: int, device: str, shapes: list[tuple[int, int]], rounds: list[int]
) -> list[tuple[str, str, str, float, float, float]]:
    """(op, shape, variant, median ms, paired ratio to c10d, its spread) per op, shape and
    variant; each round runs every variant once in a shuffled order, from a barrier; a
    variant's time in a round is the slower rank's."""
    where = bind(rank, device)
    warm_up(device)
    order = random.Random(0)  # the same shuffle on every rank: they must call alike
    found = []
    for shape, count in zip(shapes, rounds, strict=True):
        for op in OPS:
            rows = shape[0] * (n if op in ("reduce_scatter", "all_to_all", "scatter") else 1)
            x = torch.randn(rows, shape[1], device=where)
            leaf = x.clone().requires_grad_()  # autograd's variants; c10d's gets no graph
            out_shape = tuple(_distgrad(op, leaf, n, rank).shape)
            variants: dict[str, Callable[[], None]] = {
                "c10d": lambda op=op, x=x: _c10d(op, x, n, rank),
                "distgrad": lambda op=op, x=leaf: _backward(_distgrad(op, x, n, rank)),
                "autograd floor": lambda x=leaf, s=out_shape: _backward(_Floor.apply(x, s)),
            }
            if op in FUNCOL_OPS:
                variants["funcol"] = lambda op=op, x=leaf: _backward(_funcol(op, x, n))
            names = list(variants)
            for name in names:  # warm-up
                variants[name]()
            times = torch.zeros(count, len(names), dtype=torch.float64)
            for i in range(count):
                picked = names[:]
                order.shuffle(picked)
                for name in picked:
                    dist.barrier()
                    times[i, names.index(name)] = _timed(variants[name], where)
            slowest = times.to(where)
            dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
            slowest = slowest.cpu()
            base = slowest[:, names.index("c10d")]
            for j, name in enumerate(names):
                ratios = (slowest[:, j] / base).tolist()
                q = statistics.quantiles(ratios, n=4) if len(ratios) > 1 else [ratios[0]] * 3
                found.append(
                    (
                        op,
                        f"{shape}",
                        name,
                        1e3 * float(slowest[:, j].median()),
                        statistics.median(ratios),
                        q[2] - q[0],
                    )
                )
    return found


class _Floor(torch.autograd.Function):
    """The autograd floor: a local Function with distgrad's output shape and no communication
    (forward and backward each allocate their result), through the same ``apply`` a user's
    Function pays. distgrad's time over this one is what its own code costs per call."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, shape: tuple[int, ...]) -> Tensor:
        ctx.like = (x.shape, x.dtype, x.device)
        return x.new_empty(shape)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None]:
        shape, dtype, device = ctx.like
        return torch.empty(shape, dtype=dtype, device=device), None


def _backward(out: Tensor | None) -> None:
    assert out is not None
    out = out.wait() if hasattr(out, "wait") else out  # funcol's output is asynchronous
    out.backward(torch.ones_like(out))


def part(device: str, gpus: int) -> Section:
    if device == "cuda":
        shapes, rounds = [(256, 128), (4096, 512), (16384, 1024)], [50, 30, 15]
    else:
        shapes, rounds = [(16, 8), (64, 16), (256, 32)], [2, 2, 2]
    setup = setups(device, gpus)[0]
    one_gpu = ": one GPU, so no data moves between GPUs" if gpus == 1 else ""
    section = Section(
        "timing",
        f"Forward+backward time of every op ({setup.label}{one_gpu}), "
        f"float32 [rows, cols] per rank at {', '.join(map(str, shapes))}, against torch's c10d "
        "collectives doing the same forward and backward exchanges without autograd (on "
        "world size 1 most are copies), the autograd floor (a local autograd Function with the "
        "op's output shape and no communication: what any differentiable call costs; distgrad's "
        "target is this plus 10 us) and funcol's `*_autograd` collectives where funcol has "
        "one. Each round runs every variant once, shuffled, from a barrier; a time "
        f"is the slower rank's; {rounds} rounds. Ratio: the median over rounds of the "
        "variant's time over c10d's in the same round (paired), with its interquartile range."
        + ("" if device == "cuda" else " CPU mode: tiny sizes and 2 rounds, no meaning as speed."),
        ("setup", "op", "shape", "variant", "median ms", "ratio to c10d (IQR)"),
    )
    per_rank = on_ranks(
        section,
        setup,
        ("every op", "-", "-", "-"),
        _times,
        (setup.device, shapes, rounds),
        timeout=400,
        collective_timeout=120,
    )
    if per_rank is None:
        return section
    for op, shape, name, ms, ratio, spread in per_rank[0]:
        section.rows.append(
            (setup.label, op, shape, name, f"{ms:.3f}", f"{ratio:.2f}x ({spread:.2f})")
        )
    return section
