"""No deprecation warning from distgrad's own calls: every collective forward and backward,
every loss, a model-parallel pattern, and a whole RPC session (init_rpc, a call in a context,
both backward modes, the optimizer, shutdown), each on real ranks with every warning shown
(``simplefilter("always")``). A ``DeprecationWarning``, a ``FutureWarning``, or any warning
whose text says "deprecated" (torch words some as ``UserWarning``) fails the test with where
it was raised. The demo is checked the same way by tests/cli (it runs the same calls)."""

from __future__ import annotations

import tempfile
import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import torch

import distgrad as dg
import distgrad.rpc as dgrpc
from distgrad.testing import run_on_ranks
from tests import _support as support
from tests.rpc import _funcs as F


def _deprecated(found: list[warnings.WarningMessage]) -> list[str]:
    return [
        f"{w.category.__name__} at {w.filename}:{w.lineno}: {str(w.message)[:200]}"
        for w in found
        if issubclass(w.category, DeprecationWarning | FutureWarning)
        or "deprecat" in str(w.message).lower()
    ]


@contextmanager
def _every_warning() -> Iterator[list[warnings.WarningMessage]]:
    with warnings.catch_warnings(record=True) as found:
        warnings.simplefilter("always")
        yield found


def _collectives_and_losses(rank: int, n: int) -> list[str]:
    g = support.seeded(rank)
    x = torch.randn(4, 6, generator=g, requires_grad=True)
    wide = x.repeat(n, 1)
    calls: list[Callable[[], torch.Tensor]] = [
        lambda: dg.all_gather(x),
        lambda: dg.all_gather(x, sizes=[4] * n),
        lambda: dg.reduce_scatter(wide),
        *(lambda op=op: dg.all_reduce(x, op) for op in ("sum", "avg", "prod", "max", "min")),
        lambda: dg.all_to_all(wide),
        lambda: dg.broadcast(x, 0),
        lambda: dg.reduce(x, 0),
        lambda: dg.gather(x, 0, sizes=[4] * n),
        lambda: dg.scatter(wide if rank == 0 else x, 0, sizes=[4] * n),
        lambda: dg.permute(x, [(r + 1) % n for r in range(n)], recv_shape=(4, 6)),
        lambda: dg.all_gather(x, async_op=True) * 1,
        lambda: dg.losses.nt_xent(x, x.flip(0)),
        lambda: dg.losses.info_nce(x, x.flip(0), block_size=2),
        lambda: dg.losses.clip_loss(x, x.flip(0), 10.0),
        lambda: dg.losses.siglip_loss(x, x.flip(0), 10.0, -10.0),
        lambda: dg.losses.barlow_twins(x, x.flip(0)),
        lambda: dg.parallel.ColumnParallelLinear(6, 4 * n)(x),
    ]
    with _every_warning() as found:
        for call in calls:
            out = call()
            (out * support.cotangent(rank, out)).sum().backward()
    return _deprecated(found)


def test_collectives_losses_and_patterns_raise_no_deprecation_warning() -> None:
    for rank, found in enumerate(run_on_ranks(_collectives_and_losses, 2)):
        assert not found, f"rank {rank}: " + "\n".join(found)


def _rpc_session(rank: int, n: int, folder: str) -> list[str]:
    with _every_warning() as found:
        dgrpc.init_rpc(f"worker{rank}", rank=rank, world_size=n, init_method=f"file://{folder}/rpc")
        if rank == 0:
            w = dgrpc.rpc_sync("worker1", F.make_param, args=("w", 1, (3,)))
            opt = dgrpc.DistributedOptimizer(torch.optim.SGD, [w], lr=0.1)
            x = torch.ones(3, dtype=torch.float64, requires_grad=True)
            for mode in ("fast", "smart"):
                with dgrpc.context() as cid:
                    y = dgrpc.rpc_sync("worker1", F.add_plain, args=(x, w.to_here()))
                    dgrpc.backward(cid, [(y * y).sum()], mode=mode)
                    opt.step(cid)
        dgrpc.shutdown()
    return _deprecated(found)


def test_an_rpc_session_raises_no_deprecation_warning() -> None:
    """torch's own TensorPipe setup warns "You are using a Backend ProcessGroupGloo as a
    ProcessGroup. This usage is deprecated" from inside ``init_rpc``; distgrad's ``init_rpc``
    does not pass it on (see ``distgrad.rpc._lifecycle``)."""
    with tempfile.TemporaryDirectory() as folder:
        results = run_on_ranks(_rpc_session, 2, args=(folder,), init="none")
    for rank, found in enumerate(results):
        assert not found, f"rank {rank}: " + "\n".join(found)
