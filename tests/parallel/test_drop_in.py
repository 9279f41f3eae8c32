"""dg.parallel as a drop-in for what users already call: torch's SyncBatchNorm signature,
Megatron's gather_output and input_is_parallel, GShard's capacity order and routing decisions
made by the user's own router.

Semantics asserted: ``SyncBatchNorm.__init__`` and ``convert_sync_batchnorm`` take torch's
parameters with torch's defaults (``group=`` and ``convert`` stay as aliases). ``route`` with
``order="choice"`` keeps exactly the slots GShard's top-2 rule keeps (every first choice before
any second, ``locations2 = cumsum(mask2) - 1 + sum(mask1)``), written here independently;
``order="token"`` is the earlier rule and differs on most problems. A decision passed as
``experts=``/``weights=`` routes as the same decision made from logits. On 2 ranks (float64,
random cotangents): the distributed decision equals one process's on the whole batch for both
orders and an external decision; an MLP of ``ColumnParallelLinear(gather_output=True)`` and
``RowParallelLinear(input_is_parallel=False)`` equals the plain MLP, value and gradients, under
the sum contract (gradients summed over ranks equal one process's) and the replicated one
(every rank's input gradient equals one process's).
"""

from __future__ import annotations

import inspect

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor

from distgrad import parallel as P
from distgrad.errors import CollectiveArgumentError
from distgrad.testing import run_on_ranks
from tests._support import FLOAT64_ABSOLUTE, seeded

DT = torch.float64


def test_sync_batch_norm_takes_torch_s_signature() -> None:
    ours = inspect.signature(P.SyncBatchNorm.__init__).parameters
    theirs = inspect.signature(torch.nn.SyncBatchNorm.__init__).parameters
    for name, param in theirs.items():
        assert name in ours, name
        assert ours[name].kind == param.kind and ours[name].default == param.default, name
    assert list(ours)[: len(theirs) - 1] == list(theirs)[:-1]  # positional order; bias last
    converter = inspect.signature(P.SyncBatchNorm.convert_sync_batchnorm).parameters
    assert list(converter) == list(
        inspect.signature(torch.nn.SyncBatchNorm.convert_sync_batchnorm).parameters
    )


def test_sync_batch_norm_without_bias_and_its_converter() -> None:
    layer = P.SyncBatchNorm(3, bias=False)
    assert layer.bias is None and layer.weight.shape == (3,)
    model = torch.nn.Sequential(torch.nn.BatchNorm1d(3, bias=False), torch.nn.ReLU())
    model[0].train(False)
    converted = P.SyncBatchNorm.convert_sync_batchnorm(model, process_group=None)
    assert isinstance(converted[0], P.SyncBatchNorm) and converted[0].bias is None
    assert not converted[0].training
    x = torch.randn(4, 3)
    assert torch.equal(converted(x), torch.nn.Sequential(model[0], model[1])(x))
    # The earlier names are aliases.
    assert P.SyncBatchNorm(2, group=None).process_group is None
    with pytest.raises(CollectiveArgumentError, match=r"pass process_group .* or group"):
        P.SyncBatchNorm(2, process_group=object(), group=object())  # type: ignore[arg-type]


def _gshard_kept(experts: Tensor, capacity: int, num_experts: int) -> Tensor:
    """GShard/DeepSpeed top-k capacity, written from their top2gating: choice j's location is
    its place among the choice-j tokens of the expert plus every earlier choice's count."""
    masks = [F.one_hot(experts[:, j], num_experts) for j in range(experts.shape[1])]
    kept, before = [], torch.zeros(num_experts, dtype=torch.int64)
    for mask in masks:
        locations = torch.cumsum(mask, 0) - 1 + before
        kept.append((locations * mask).sum(1) < capacity)
        before = before + mask.sum(0)
    return torch.stack(kept, 1)


def test_route_choice_order_keeps_gshard_s_slots_and_token_order_differs() -> None:
    differs = 0
    for seed in range(8):
        logits = torch.randn(12, 4, dtype=DT, generator=seeded(seed))
        for k in (2, 3):
            choice = P.route(logits, k, capacity=4, order="choice")
            assert torch.equal(choice.kept, _gshard_kept(choice.experts, 4, 4)), (seed, k)
        token = P.route(logits, 2, capacity=4)
        differs += not torch.equal(token.kept, P.route(logits, 2, capacity=4, order="choice").kept)
    assert differs >= 4, differs
    empty = P.route(torch.zeros(0, 4, dtype=DT), 2, capacity=1, order="choice")
    assert empty.kept.shape == (0, 2) and empty.expert_sizes == (0, 0, 0, 0)


def test_route_takes_a_decision_made_elsewhere() -> None:
    logits = torch.randn(10, 5, dtype=DT, generator=seeded(1))
    made = P.route(logits, 2, capacity=3, order="choice")
    weights = torch.softmax(logits, -1).topk(2, -1).values
    weights = weights / weights.sum(-1, keepdim=True)
    for given in (
        P.route(experts=made.experts, weights=weights, num_experts=5, capacity=3, order="choice"),
        P.route(experts=made.experts, weights=weights, num_experts=5, kept=made.kept),
    ):
        assert torch.equal(given.kept, made.kept) and torch.equal(given.tokens, made.tokens)
        assert torch.allclose(given.weights, made.weights)
        assert given.send_sizes == made.send_sizes and given.expert_sizes == made.expert_sizes
    # Default weights are ones; a wrong shape or both kept and capacity are refused.
    assert torch.equal(P.route(experts=made.experts, num_experts=5).weights, torch.ones(20))
    with pytest.raises(CollectiveArgumentError, match=r"route on rank 0: pass kept or capacity"):
        P.route(experts=made.experts, num_experts=5, kept=made.kept, capacity=2)
    with pytest.raises(CollectiveArgumentError, match=r"experts= needs num_experts="):
        P.route(experts=made.experts)
    with pytest.raises(
        CollectiveArgumentError, match=r"order must be one of \['choice', 'token'\], got 'expert'"
    ):
        P.route(logits, 1, order="expert")  # type: ignore[arg-type]


def _logits() -> Tensor:
    return torch.randn(14, 4, dtype=DT, generator=seeded(2))


def _drop_ins_on_two_ranks(rank: int, n: int, alone: dict[str, Tensor]) -> None:
    # Routing: every rank's decision is its slice of one process's on the whole batch.
    mine = slice(0, 8) if rank == 0 else slice(8, 14)
    for order in ("token", "choice"):
        here = P.route(_logits()[mine], 2, capacity=5, order=order)  # type: ignore[arg-type]
        assert torch.equal(here.kept, alone[order][mine]), (rank, order)
        given = P.route(experts=here.experts, num_experts=4, capacity=5, order=order)  # type: ignore[arg-type]
        assert torch.equal(given.kept, here.kept)
        assert given.send_sizes == here.send_sizes and given.recv_sizes == here.recv_sizes
    # Megatron's options: a whole output, a whole input.
    torch.manual_seed(0)
    fc1, fc2 = torch.nn.Linear(4, 6, dtype=DT), torch.nn.Linear(6, 3, dtype=DT)
    x = torch.randn(5, 4, dtype=DT, generator=seeded(3))
    cot = torch.randn(5, 3, dtype=DT, generator=seeded(4))
    xs = x.clone().requires_grad_()
    want = fc2(F.gelu(fc1(xs)))
    (want * cot).sum().backward()
    for objective in ("sum", "replicated"):
        col = P.ColumnParallelLinear.from_linear(fc1, gather_output=True, objective=objective)
        row = P.RowParallelLinear.from_linear(fc2, input_is_parallel=False, objective=objective)
        xd = x.clone().requires_grad_()
        h = col(xd)
        assert h.shape == (5, 6)
        out = row(F.gelu(h))
        torch.testing.assert_close(out, want, **FLOAT64_ABSOLUTE)
        share = cot / n if objective == "sum" else cot  # sum: the shares add up to one loss
        (out * share).sum().backward()
        cols = slice(0, 3) if rank == 0 else slice(3, 6)
        assert fc1.weight.grad is not None and fc2.weight.grad is not None
        torch.testing.assert_close(col.weight.grad, fc1.weight.grad[cols], **FLOAT64_ABSOLUTE)
        torch.testing.assert_close(row.weight.grad, fc2.weight.grad[:, cols], **FLOAT64_ABSOLUTE)
        dx, dbias = xd.grad, row.bias.grad
        assert dx is not None and dbias is not None
        if objective == "sum":  # replicated tensors: their gradients add up over ranks
            dx, dbias = dx.clone(), dbias.clone()
            dist.all_reduce(dx), dist.all_reduce(dbias)
        torch.testing.assert_close(dx, xs.grad, **FLOAT64_ABSOLUTE)
        torch.testing.assert_close(dbias, fc2.bias.grad, **FLOAT64_ABSOLUTE)


def test_drop_ins_equal_one_process_on_two_ranks() -> None:
    alone = {o: P.route(_logits(), 2, capacity=5, order=o).kept for o in ("token", "choice")}  # type: ignore[arg-type]
    assert not torch.equal(alone["token"], alone["choice"])  # the problem tells them apart
    run_on_ranks(_drop_ins_on_two_ranks, 2, args=(alone,), timeout=90)
