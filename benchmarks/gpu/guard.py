"""Part ``guard``: the opt-in data guard's exchanges with no host synchronisation, and a
mismatched tag raised when it should be."""

from __future__ import annotations

import torch

import distgrad as dg
from distgrad._exchange import guard as _guard
from distgrad._exchange import ops
from distgrad._exchange.group import resolve
from distgrad.errors import CollectiveMismatchError

from .ranks import bind, on_ranks, setups, short
from .report import Section
from .step import leaf


def _guard_rows(rank: int, n: int, device: str) -> list[tuple[str, str]]:
    """The data guard (distgrad._exchange.guard) on this device: guarded exchanges of every
    kind under the strictest sync debug mode, then a mismatched tag, which on CUDA must be
    raised at the next guarded call and not before (no host synchronisation), and on CPU at
    once."""
    where = bind(rank, device)
    dg.set_guard(True)  # opt-in
    group = resolve(None, "gpu_check")
    x = leaf(rank, where, torch.float32, 3).detach()
    watch = where.type == "cuda"
    rows = []
    strict = "error" if watch else "default"

    def exchanges() -> None:
        for op in ("sum", "max", "min"):
            ops.all_reduce.eager(x, op, group=group)
        each = [x.shape[0]] * n
        ops.reduce.eager(x, 0, group=group)
        ops.broadcast.eager(x, 0, group=group)
        ops.all_gather.eager(x, each, group=group)
        ops.all_to_all.eager(x.repeat(n, 1), each, each, group=group)
        ops.gather.eager(x, each, 0, group=group)
        whole = x.repeat(n, 1) if group.rank == 0 else None
        ops.scatter.eager(whole, each, 0, x.shape[1:], x.dtype, x.device, group=group)
        ops.permute.eager(x, [(r + 1) % n for r in range(n)], x.shape, group=group)

    exchanges()  # warm: the tag tensors are made (and copied to the device) once
    try:
        if watch:
            torch.cuda.set_sync_debug_mode(strict)
        exchanges()
        if watch:
            torch.cuda.synchronize()
        _guard.raise_pending(group)
        rows.append(("matching calls: no synchronisation, no false alarm", "pass"))
    except RuntimeError as exc:
        rows.append(("matching calls: no synchronisation, no false alarm", f"FAIL: {short(exc)}"))
    finally:
        if watch:
            torch.cuda.set_sync_debug_mode("default")
    tag = _guard.reduced_tag(group, "all_reduce", x, "sum")
    assert tag is not None
    wrong = _guard.tag_tensor(tag, x.dtype, where) * (n + 1)  # no group of n sums to this
    name = "a mismatched tag: raised at the next guarded call (CUDA) or at once (CPU)"
    try:
        if watch:
            torch.cuda.set_sync_debug_mode(strict)
        _guard.check(wrong, tag, group, n)
        if not watch:
            rows.append((name, "FAIL: a CPU check returned on a mismatched tag"))
            return rows
        torch.cuda.set_sync_debug_mode("default")
        torch.cuda.synchronize()  # the verdict has landed; the next guarded call reads it
        ops.all_reduce.eager(x, "sum", group=group)
        rows.append((name, "FAIL: the next guarded call did not raise"))
    except CollectiveMismatchError as exc:
        late = "earlier exchange" in str(exc)
        ok = late == watch
        rows.append((name, ("pass" if ok else "FAIL: raised at the wrong time") + f": {exc}"[:160]))
    except RuntimeError as exc:
        rows.append((name, f"FAIL: {short(exc)}"))
    finally:
        if watch:
            torch.cuda.set_sync_debug_mode("default")
    return rows


def part(device: str, gpus: int) -> Section:
    section = Section(
        "guard",
        'The data guard (docs/semantics.md, "The data guard"): guarded exchanges of every '
        "kind (distgrad._exchange.ops' all_reduce sum/max/min, reduce, broadcast, all_gather, "
        "all_to_all, gather, scatter, permute) under "
        '`torch.cuda.set_sync_debug_mode("error")`, with no false alarm; then a mismatched tag: '
        "on CUDA it must be queued without a host synchronisation and raised as the next "
        "guarded call on the group begins, on CPU at once. The first setup only (on one GPU, "
        "NCCL at world size 1: the tags are checked though nothing crosses a link).",
        ("setup", "check", "result"),
    )
    setup = setups(device, gpus)[0]
    per_rank = on_ranks(
        section,
        setup,
        ("every check",),
        _guard_rows,
        (setup.device,),
        timeout=120,
        collective_timeout=30,
    )
    if per_rank is None:
        return section
    for name, result in per_rank[0]:
        section.rows.append((setup.label, name, result))
    return section
