"""Small pipeline programs written with :mod:`distgrad.pipeline`, each checking itself against
one process: the runnable examples of its API reference (a program must be importable to run
on the ranks ``distgrad.testing.run_on_ranks`` starts). Each returns, on every rank, whether
its stage's gradients equal those of the whole model in one process.
"""

from __future__ import annotations

import torch
from torch import Tensor

import distgrad.pipeline as dgp

__all__ = ["microbatches", "split_backward", "two_stages"]


def _setup(rank: int) -> tuple[list[Tensor], Tensor, Tensor, Tensor]:
    """Two stages' weights, the batch and a target; this rank's weight, a leaf."""
    g = torch.Generator().manual_seed(0)
    weights = [torch.randn(4, 4, dtype=torch.float64, generator=g) for _ in range(2)]
    x = torch.randn(6, 4, dtype=torch.float64, generator=g)
    y = torch.randn(6, 4, dtype=torch.float64, generator=g)
    return weights, x, y, weights[rank].clone().requires_grad_()


def _reference(weights: list[Tensor], x: Tensor, y: Tensor, rank: int, parts: int) -> Tensor:
    """This rank's weight's gradient in one process: the mean over ``parts`` microbatches."""
    ws = [w.clone().requires_grad_() for w in weights]
    losses = [
        ((torch.tanh(xm @ ws[0]) @ ws[1] - ym) ** 2).mean()
        for xm, ym in zip(x.chunk(parts), y.chunk(parts), strict=True)
    ]
    torch.autograd.backward([torch.stack(losses).sum() / parts])
    grad = ws[rank].grad
    assert grad is not None
    return grad


def two_stages(rank: int, world_size: int) -> bool:
    """Rank 0 computes ``tanh(x @ w0)`` and sends it; rank 1 receives it, computes the loss and
    starts the backward, which brings the gradient back to rank 0."""
    weights, x, y, w = _setup(rank)
    with dgp.context() as cid:
        if rank == 0:
            dgp.send(torch.tanh(x @ w), dst=1)
            dgp.backward(cid)  # no loss here: driven by the gradient that arrives
        else:
            h = dgp.recv(src=0, shape=(6, 4), dtype=torch.float64)
            dgp.backward(cid, [((h @ w - y) ** 2).mean()])
    return torch.allclose(w.grad, _reference(weights, x, y, rank, 1))  # type: ignore[arg-type]


def microbatches(rank: int, world_size: int) -> bool:
    """Three microbatches, their forwards started with ``isend``/``irecv`` and each
    microbatch's backward run on its own (``microbatch=``), in 1F1B order on rank 1."""
    weights, x, y, w = _setup(rank)
    xs, ys = x.chunk(3), y.chunk(3)
    with dgp.context() as cid:
        if rank == 0:
            for m in range(3):
                dgp.isend(torch.tanh(xs[m] @ w), 1, microbatch=m)
            for m in range(3):
                dgp.backward(cid, microbatch=m)
        else:
            for m in range(3):
                h = dgp.irecv(0, shape=(2, 4), dtype=torch.float64, microbatch=m).wait()
                assert h is not None
                loss = ((h @ w - ys[m]) ** 2).mean() / 3  # torch's mean over microbatches
                dgp.backward(cid, [loss], microbatch=m)
    return torch.allclose(w.grad, _reference(weights, x, y, rank, 3))  # type: ignore[arg-type]


def split_backward(rank: int, world_size: int) -> bool:
    """A zero-bubble stage's backward in two halves: the input gradient first
    (``weights=False``, which sends it on), the weight gradient later."""
    weights, x, y, w = _setup(rank)
    with dgp.context() as cid:
        if rank == 0:
            dgp.send(torch.tanh(x @ w), 1)
            dgp.backward(cid)
        else:
            h = dgp.recv(0, shape=(6, 4), dtype=torch.float64)
            dgp.backward(cid, [((h @ w - y) ** 2).mean()], weights=False)
            untouched = w.grad is None  # only the input half ran
            dgp.backward_weights(cid)
            assert untouched
    return torch.allclose(w.grad, _reference(weights, x, y, rank, 1))  # type: ignore[arg-type]
