"""Forward+backward time of each distgrad.parallel pattern against the torch version people
write by hand, on the same 2 gloo ranks, in paired rounds.

    python benchmarks/parallel.py                # 40 rounds per pattern (a few minutes on 2 cores)
    python benchmarks/parallel.py --rounds 5     # a quick run
    python benchmarks/parallel.py --memory       # peak extra memory per rank instead

The hand-written versions (each exact: the benchmark compares speed, not correctness):

* tensor parallel: a sequence-parallel MLP whose gather and reduce-scatter are Megatron-style
  ``autograd.Function``s around ``all_gather_into_tensor`` and ``reduce_scatter_tensor``
  (gloo's reduce-scatter where torch has one; an all_reduce and a slice otherwise).
* MoE: top-2 routing; the counts exchanged with ``all_to_all_single``, and the tokens sent and
  brought back with an ``all_to_all_single`` wrapped in an ``autograd.Function`` whose
  backward swaps the split sizes.
* ring attention: the hand-written alternative to a ring, all-gathering K and V with
  ``torch.distributed.nn.functional.all_gather`` and calling
  ``F.scaled_dot_product_attention`` with the global causal mask (exact, but it holds the whole
  sequence's K and V on every rank).
* synchronized batch norm: ``torch.nn.SyncBatchNorm`` refuses CPU tensors, so gloo users write
  sum, sum of squares and count, ``torch.distributed.nn.functional.all_reduce`` of them, and
  ``E[x^2] - E[x]^2``.

Method: each pattern runs in two fresh rank processes (``run_on_ranks``), one thread per rank.
After two warm-up steps of each version, every round runs both versions in a random order
(the same on both ranks); each is timed from a barrier to a barrier after its backward, so the
time is the slower rank's. The ratio is the median over rounds of distgrad's time over the
hand-written version's time *in the same round*, so that a slow stretch of the shared machine
slows both sides of a ratio. Float32. ``--memory``: each version once in two fresh rank
processes; the growth of the rank's resident high-water mark (``ru_maxrss``) over one
forward+backward, inputs excluded, the larger of the two ranks.
"""

from __future__ import annotations

import argparse
import random
import resource
import statistics
import time
import warnings
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.nn.functional as dist_nn
import torch.nn.functional as F
from torch import Tensor

from distgrad import parallel as P
from distgrad.testing import run_on_ranks

Step = Callable[[], Tensor]

# -- hand-written versions ------------------------------------------------------------------


class _Gather(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: Tensor) -> Tensor:  # type: ignore[no-untyped-def]
        out = x.new_empty((x.shape[0] * dist.get_world_size(), *x.shape[1:]))
        dist.all_gather_into_tensor(out, x.contiguous())
        return out

    @staticmethod
    def backward(ctx, grad: Tensor) -> Tensor:  # type: ignore[no-untyped-def]
        return _reduce_scatter(grad)


def _reduce_scatter(x: Tensor) -> Tensor:
    n, rank = dist.get_world_size(), dist.get_rank()
    out = x.new_empty((x.shape[0] // n, *x.shape[1:]))
    try:
        dist.reduce_scatter_tensor(out, x.contiguous())
    except (RuntimeError, NotImplementedError):  # a backend without it: all_reduce and slice
        total = x.contiguous().clone()
        dist.all_reduce(total)
        out = total.chunk(n)[rank].clone()
    return out


class _ReduceScatter(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: Tensor) -> Tensor:  # type: ignore[no-untyped-def]
        return _reduce_scatter(x)

    @staticmethod
    def backward(ctx, grad: Tensor) -> Tensor:  # type: ignore[no-untyped-def]
        return _Gather.apply(grad)  # type: ignore[no-any-return]


class _AllToAll(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: Tensor, send: list[int], recv: list[int]) -> Tensor:  # type: ignore[no-untyped-def]
        ctx.sizes = (send, recv)
        out = x.new_empty((sum(recv), *x.shape[1:]))
        dist.all_to_all_single(out, x.contiguous(), recv, send)
        return out

    @staticmethod
    def backward(ctx, grad: Tensor):  # type: ignore[no-untyped-def]
        send, recv = ctx.sizes
        back = grad.new_empty((sum(send), *grad.shape[1:]))
        dist.all_to_all_single(back, grad.contiguous(), send, recv)
        return back, None, None


# -- the four cases: (distgrad step, hand-written step) ---------------------------------------


def _leaf(*shape: int, gen: torch.Generator) -> Tensor:
    return torch.randn(*shape, generator=gen).requires_grad_()


def _tensor_parallel(rank: int, n: int, gen: torch.Generator) -> tuple[Step, Step, str]:
    tokens, width, hidden = 2048, 512, 2048
    x = _leaf(tokens // n, width, gen=gen)
    w1, w2 = _leaf(hidden // n, width, gen=gen), _leaf(width, hidden // n, gen=gen)
    v = torch.randn(tokens // n, width, generator=gen)
    sizes = [tokens // n] * n

    def ours() -> Tensor:
        h = P.column_parallel_linear(x, w1, sequence_parallel=True, sizes=sizes)
        y = P.row_parallel_linear(F.gelu(h), w2, sequence_parallel=True, sizes=sizes)
        return (y * v).sum()

    def hand() -> Tensor:
        h = F.linear(_Gather.apply(x), w1)
        return (_ReduceScatter.apply(F.linear(F.gelu(h), w2)) * v).sum()

    return ours, hand, f"sequence-parallel MLP, {tokens} tokens, {width} -> {hidden} -> {width}"


def _moe(rank: int, n: int, gen: torch.Generator) -> tuple[Step, Step, str]:
    tokens, width, experts = 4096, 256, 8
    x = _leaf(tokens, width, gen=gen)
    router = _leaf(experts, width, gen=gen)
    mine = experts // n
    weights = [_leaf(width, width, gen=gen) for _ in range(mine)]
    v = torch.randn(tokens, width, generator=gen)

    def ours() -> Tensor:
        routing = P.route(F.linear(x, router), 2)
        parts = P.dispatch(x, routing).split(routing.expert_sizes)
        outs = [torch.tanh(p @ w) for p, w in zip(parts, weights, strict=True)]
        return (P.combine(torch.cat(outs), routing) * v).sum()

    def hand() -> Tensor:
        top_w, top_e = torch.softmax(F.linear(x, router), -1).topk(2, -1)
        top_w = top_w / top_w.sum(-1, keepdim=True)
        flat = top_e.reshape(-1)
        order = torch.argsort(flat, stable=True)
        counts = torch.bincount(flat, minlength=experts)
        send = counts.view(n, mine).sum(1)
        table = torch.empty_like(counts)
        dist.all_to_all_single(table, counts)  # table[s * mine + e]: rank s's rows for e
        recv_l, send_l = table.view(n, mine).sum(1).tolist(), send.tolist()
        got = _AllToAll.apply(x[order // 2], send_l, recv_l)
        # received: source-major, each source's rows by expert; regroup by local expert
        per = table.view(n, mine)
        ids = torch.repeat_interleave(torch.arange(mine).repeat(n), per.reshape(-1))
        out = torch.empty_like(got)
        for e, w in enumerate(weights):
            rows = torch.nonzero(ids == e).squeeze(1)
            out = out.index_copy(0, rows, torch.tanh(got[rows] @ w))
        back = _AllToAll.apply(out, recv_l, send_l)
        y = torch.zeros_like(x).index_add(0, order // 2, back * top_w.reshape(-1)[order, None])
        return (y * v).sum()

    return ours, hand, f"MoE top-2, {tokens} tokens per rank, width {width}, {experts} experts"


RING_SEQ = 4096  # --ring-seq changes it


def _ring(rank: int, n: int, gen: torch.Generator) -> tuple[Step, Step, str]:
    batch, heads, seq, dim = 1, 8, RING_SEQ, 64
    s = seq // n
    q, k, v = (_leaf(batch, heads, s, dim, gen=gen) for _ in range(3))
    cot = torch.randn(batch, heads, s, dim, generator=gen)
    sizes = [s] * n
    keys = torch.arange(seq)
    queries = rank * s + torch.arange(s)
    allowed = keys[None, :] <= queries[:, None]  # [s, seq] the global causal mask

    def ours() -> Tensor:
        return (P.ring_attention(q, k, v, causal=True, sizes=sizes) * cot).sum()

    def hand() -> Tensor:
        all_k = torch.cat(dist_nn.all_gather(k), dim=2)
        all_v = torch.cat(dist_nn.all_gather(v), dim=2)
        out = F.scaled_dot_product_attention(q, all_k, all_v, attn_mask=allowed)
        return (out * cot).sum()

    return ours, hand, f"causal attention, sequence {seq}, {heads} heads of {dim}"


def _batch_norm(rank: int, n: int, gen: torch.Generator) -> tuple[Step, Step, str]:
    shape = (64, 64, 16, 16)
    x = _leaf(*shape, gen=gen)
    v = torch.randn(*shape, generator=gen)
    ours_bn = P.SyncBatchNorm(shape[1])
    weight, bias = ours_bn.weight, ours_bn.bias

    def ours() -> Tensor:
        return (ours_bn(x) * v).sum()

    def hand() -> Tensor:
        count = torch.tensor([x.numel() / x.shape[1]])
        stats = torch.cat([x.sum((0, 2, 3)), (x * x).sum((0, 2, 3)), count])
        total = dist_nn.all_reduce(stats)
        c = shape[1]
        mean = total[:c] / total[-1]
        var = total[c : 2 * c] / total[-1] - mean * mean
        y = (x - mean[:, None, None]) * torch.rsqrt(var + 1e-5)[:, None, None]
        return ((y * weight[:, None, None] + bias[:, None, None]) * v).sum()

    return ours, hand, f"batch norm of [{', '.join(map(str, shape))}] per rank"


CASES = {
    "tensor parallel": _tensor_parallel,
    "MoE dispatch/combine": _moe,
    "ring attention": _ring,
    "SyncBatchNorm": _batch_norm,
}


def _timed(step: Step) -> float:
    dist.barrier()
    start = time.perf_counter()
    step().backward()
    dist.barrier()
    return time.perf_counter() - start


def _rank(rank: int, n: int, case: str, rounds: int, ring_seq: int) -> dict[str, object]:
    global RING_SEQ
    RING_SEQ = ring_seq
    warnings.simplefilter("ignore")  # torch.distributed.nn's deprecation warning
    torch.set_num_threads(1)
    ours, hand, what = CASES[case](rank, n, torch.Generator().manual_seed(rank))
    with torch.no_grad():  # the two compute the same thing
        a, b = ours(), hand()
        torch.testing.assert_close(a, b, rtol=1e-3, atol=1e-3 * float(b.abs()), msg=case)
    order = random.Random(0)  # the same order on every rank
    for _ in range(2):
        _timed(ours)
        _timed(hand)
    times: dict[str, list[float]] = {"ours": [], "hand": []}
    for _ in range(rounds):
        pair = [("ours", ours), ("hand", hand)]
        order.shuffle(pair)
        for name, step in pair:
            times[name].append(_timed(step))
    return {"what": what, **times}


def _peak_mib(rank: int, n: int, case: str, variant: str, ring_seq: int) -> float:
    """Growth of this rank's resident high-water mark over one forward+backward, in MiB."""
    global RING_SEQ
    RING_SEQ = ring_seq
    warnings.simplefilter("ignore")
    torch.set_num_threads(1)
    ours, hand, _ = CASES[case](rank, n, torch.Generator().manual_seed(rank))
    step = ours if variant == "ours" else hand
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    step().backward()
    return (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) / 1024  # Linux: KiB


def _memory(cases: list[str], n: int, ring_seq: int) -> list[str]:
    """Each version in fresh rank processes, so no earlier allocation is counted."""
    rows = []
    for case in cases:
        peaks = {
            v: max(run_on_ranks(_peak_mib, n, args=(case, v, ring_seq), timeout=1800))
            for v in ("hand", "ours")
        }
        rows.append(f"| {case} | {peaks['hand']:.0f} | {peaks['ours']:.0f} |")
        print(rows[-1], flush=True)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=40)
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--output", type=Path, default=None)
    parser.add_argument("--cases", default=",".join(CASES), help="comma-separated case names")
    parser.add_argument(
        "--memory", action="store_true", help="peak extra memory per rank instead of time"
    )
    parser.add_argument("--ring-seq", type=int, default=RING_SEQ, help="ring attention's length")
    args = parser.parse_args()
    if args.memory:
        print("| pattern | hand-written torch (MiB) | distgrad.parallel (MiB) |")
        _memory(args.cases.split(","), args.world_size, args.ring_seq)
        return
    rows = []
    for case in args.cases.split(","):
        found = run_on_ranks(
            _rank, args.world_size, args=(case, args.rounds, args.ring_seq), timeout=1800
        )[0]
        ours, hand = found["ours"], found["hand"]
        ratios = sorted(a / b for a, b in zip(ours, hand, strict=True))
        q = len(ratios) // 4
        rows.append(
            f"| {case} | {found['what']} | {statistics.median(hand) * 1e3:.1f} | "
            f"{statistics.median(ours) * 1e3:.1f} | **{statistics.median(ratios):.2f}x** "
            f"({ratios[q]:.2f}-{ratios[-1 - q]:.2f}) |"
        )
        print(rows[-1], flush=True)
    table = "\n".join(
        [
            "| pattern | case | hand-written torch (ms) | distgrad.parallel (ms) | "
            "paired ratio (quartiles) |",
            "|---|---|---:|---:|---:|",
            *rows,
        ]
    )
    if args.output is not None:
        args.output.write_text(table + "\n")


if __name__ == "__main__":
    main()
