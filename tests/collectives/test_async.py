"""``async_op=True``: every op returns at once a tensor that waits for its data on first use.

Semantics asserted (docs/semantics.md, "Overlap: async_op"):

* values and gradients are the blocking call's: the whole reference sweep
  (tests/collectives/reference.py) against single-process autograd, with ``async_op=True``;
* the call returns before the exchange can have finished: rank 0 calls the op, then lets rank 1
  start its side (through the store). A call that waited would never return, and the test
  would fail at the store's timeout instead;
* the backward's exchange is started the same way: ``torch.autograd.grad`` returns rank 0's
  gradient before rank 1 has begun its backward, and it waits on first use;
* a gradient that reaches a leaf's ``.grad`` is a plain tensor (``AccumulateGrad`` waits);
* the choice is the call's, carried in its plan: a call without ``async_op`` blocks, whether
  its call shape was last called async or it runs inside another op's async scope;
* a peer that dies while the exchange is in flight is an error at the first use, naming it.
"""

from __future__ import annotations

import datetime
import os
from collections.abc import Callable

import pytest
import torch
import torch.distributed as dist
from torch import Tensor

import distgrad as dg
from distgrad._exchange.async_op import deferred
from distgrad.errors import RankFailedError
from distgrad.testing import run_on_ranks
from tests._support import EXACT
from tests.collectives.reference import cases, check_case, edge_cases, warm_up

# What a rank waits, at most, for its peer's go-ahead through the store: ample on a loaded
# machine, and the failure a call that blocks would meet.
_GO_AHEAD = datetime.timedelta(seconds=30)


def _sweep(rank: int, n: int, which: str, guard: bool, debug: bool = False) -> list[str]:
    warm_up()
    dg.set_guard(guard)
    dg.set_debug(debug)
    chosen = cases(n) if which == "main" else edge_cases(n)
    failures = []
    for case in chosen:
        for known in (False, True):
            try:
                check_case(rank, n, case, torch.float64, known=known, async_op=True)
            except (AssertionError, RuntimeError) as exc:
                failures.append(f"rank {rank}: {case} (sizes known: {known}): {str(exc)[:300]}")
    return failures


@pytest.mark.parametrize("world_size", [2, 3])
def test_every_op_with_async_op_matches_single_process_autograd(world_size: int) -> None:
    for which in ("main", "edge"):
        failures = run_on_ranks(_sweep, world_size, args=(which, False), timeout=120)
        assert not [f for per_rank in failures for f in per_rank], failures


def test_async_op_in_debug_mode() -> None:
    """Every call checked across ranks (so each one blocks at its check), then in flight."""
    failures = run_on_ranks(_sweep, 2, args=("main", False, True), timeout=120)
    assert not [f for per_rank in failures for f in per_rank], failures


def test_async_op_with_the_data_guard_on() -> None:
    """The guard's tags are read where the data is: at the wait, still on every rank."""
    failures = run_on_ranks(_sweep, 2, args=("main", True), timeout=120)
    assert not [f for per_rank in failures for f in per_rank], failures


def _calls(rank: int, n: int) -> dict[str, Callable[..., Tensor]]:
    """Every op once, every size given: nothing but the data crosses."""
    rows = [2] * n
    ring = [(r + 1) % n for r in range(n)]
    return {
        "all_gather": lambda x, **k: dg.all_gather(x, sizes=[2 * n] * n, **k),
        "reduce_scatter": lambda x, **k: dg.reduce_scatter(x, sizes=rows, **k),
        "all_reduce": lambda x, **k: dg.all_reduce(x, **k),
        "all_reduce avg": lambda x, **k: dg.all_reduce(x, "avg", **k),
        "all_to_all": lambda x, **k: dg.all_to_all(x, input_sizes=rows, output_sizes=rows, **k),
        "broadcast": lambda x, **k: dg.broadcast(x, 0, **k),
        "reduce": lambda x, **k: dg.reduce(x, 0, **k),
        "gather": lambda x, **k: dg.gather(x, 0, sizes=[2 * n] * n, **k),
        # A receiver passes its part's shape (a slice of x, so it still has a gradient).
        "scatter": lambda x, **k: dg.scatter(x if rank == 0 else x[:2], 0, sizes=rows, **k),
        "permute": lambda x, **k: dg.permute(x, ring, recv_shape=(2 * n, 3), **k),
    }


def _go_ahead(key: str, rank: int) -> None:
    """Rank 0 posts ``key``; every other rank waits for it."""
    store = dist.distributed_c10d._get_default_store()
    if rank == 0:
        store.set(key, "go")
    else:
        store.wait([key], _GO_AHEAD)


def _returns_before_the_peer_calls(rank: int, n: int) -> list[str]:
    warm_up()
    found = []
    for name, call in _calls(rank, n).items():
        x = torch.arange(2.0 * n * 3, dtype=torch.float64).view(2 * n, 3) * (rank + 1)
        v = torch.linspace(-1, 1, 2 * n * n * 3, dtype=torch.float64)
        x.requires_grad_()
        if rank == 0:
            out = call(x, async_op=True)
            assert isinstance(out, dg.AsyncTensor) and not out.done, name
            _go_ahead(f"{name} forward", rank)
        else:
            _go_ahead(f"{name} forward", rank)
            out = call(x)
        # The backward: rank 0 gets its gradient back before rank 1 starts its backward.
        loss = (out * v[: out.numel()].view(out.shape)).sum()
        if rank == 0:
            (grad,) = torch.autograd.grad(loss, x)
            assert isinstance(grad, dg.AsyncTensor) and not grad.done, f"{name}: {type(grad)}"
            _go_ahead(f"{name} backward", rank)
        else:
            _go_ahead(f"{name} backward", rank)
            (grad,) = torch.autograd.grad(loss, x, allow_unused=True, materialize_grads=True)
        # The same call, blocking on every rank, gives the same values and gradient.
        again = x.detach().requires_grad_()
        want = call(again)
        want_loss = (want * v[: want.numel()].view(want.shape)).sum()
        (want_grad,) = torch.autograd.grad(
            want_loss, again, allow_unused=True, materialize_grads=True
        )
        torch.testing.assert_close(
            out.detach(), want.detach(), **EXACT, msg=lambda m, name=name: f"{name}: {m}"
        )
        torch.testing.assert_close(
            grad, want_grad, **EXACT, msg=lambda m, name=name: f"{name} gradient: {m}"
        )
        found.append(name)
    return found


def test_the_call_and_its_backward_return_before_the_peer_starts() -> None:
    for found in run_on_ranks(_returns_before_the_peer_calls, 2, timeout=120):
        assert len(found) == 10, found


def _leaf_grad(rank: int, n: int) -> list[str]:
    warm_up()
    x = torch.ones(4, 3, dtype=torch.float64, requires_grad=True)
    out = dg.all_gather(x, sizes=[4] * n, async_op=True)
    (out * (rank + 1)).sum().backward()
    assert x.grad is not None
    torch.testing.assert_close(x.grad, torch.full_like(x, n * (n + 1) / 2), **EXACT)
    kinds = [type(x.grad).__name__]
    # The choice is each call's, carried by its plan: one call shape (whose plan is kept after
    # its first call) called blocking, async, blocking; and a blocking call made while another
    # op's async scope is open (as a backward's partner op runs) still blocks.
    for async_op in (False, True, False):
        y = dg.all_reduce(x.detach(), async_op=async_op)
        kinds.append(type(y).__name__)
        torch.testing.assert_close(y, torch.full_like(y, n), **EXACT)
    with deferred():
        kinds.append(type(dg.all_reduce(x.detach())).__name__)
    return kinds


def test_a_leaf_gets_a_plain_tensor_and_the_async_choice_is_each_calls() -> None:
    expected = ["Tensor", "Tensor", "AsyncTensor", "Tensor", "Tensor"]
    assert run_on_ranks(_leaf_grad, 2) == [expected, expected]


def _peer_dies_in_flight(rank: int, n: int) -> None:
    warm_up()
    x = torch.ones(4, 3)
    if rank == 1:
        os._exit(3)  # gone before its side of the exchange
    out = dg.all_gather(x, sizes=[4] * n, async_op=True)
    out.sum()  # the first use waits, and must fail naming rank 1


def test_a_peer_that_dies_in_flight_fails_the_first_use_naming_it() -> None:
    with pytest.raises(RankFailedError) as failed:
        run_on_ranks(_peer_dies_in_flight, 2, timeout=60, collective_timeout=30)
    message = str(failed.value)
    assert "all_gather" in message and "async_op=True" in message and "rank 1" in message, message


def _read_without_an_operation(rank: int, n: int) -> list[object]:
    warm_up()
    out = dg.all_gather(torch.full((2,), float(rank)), sizes=[2] * n, async_op=True)
    copy = dg.all_reduce(torch.ones(3), async_op=True)
    return [out, copy.numpy().tolist(), repr(dg.broadcast(torch.ones(1), 0, async_op=True))]


def test_pickling_numpy_and_repr_wait_for_the_data() -> None:
    """What reads memory without a tensor operation still gets the data, not a wrapper."""
    for out, copied, text in run_on_ranks(_read_without_an_operation, 2):
        assert type(out) is torch.Tensor  # unpickled from the rank: the plain data
        torch.testing.assert_close(out, torch.tensor([0.0, 0.0, 1.0, 1.0]), **EXACT)
        assert copied == [2.0, 2.0, 2.0]
        assert text == "AsyncTensor(tensor([1.]))"


def _double_backward(rank: int, n: int) -> str:
    warm_up()
    gen = torch.Generator().manual_seed(rank)
    x0 = torch.randn(4, 3, dtype=torch.float64, generator=gen)
    v = torch.randn(4 * n, 3, dtype=torch.float64, generator=gen)
    found = []
    for async_op in (False, True):
        x = x0.clone().requires_grad_()
        y = dg.all_gather(x, sizes=[4] * n, async_op=async_op)
        (g,) = torch.autograd.grad((y**3 * v).sum(), x, create_graph=True)
        (g**2).sum().backward()
        assert x.grad is not None
        found.append((g.detach(), x.grad, type(g).__name__))
    torch.testing.assert_close(found[1][0], found[0][0], **EXACT)
    torch.testing.assert_close(found[1][1], found[0][1], **EXACT)
    return found[1][2]


def test_a_double_backward_through_async_ops_is_the_blocking_ones() -> None:
    """``create_graph=True``: the gradient is itself in flight, and differentiable."""
    assert run_on_ranks(_double_backward, 2) == ["AsyncTensor", "AsyncTensor"]
