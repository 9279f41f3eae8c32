"""The loss modules under DistributedDataParallel and FSDP2, float32 tolerances, checkpoints of
earlier releases, and bad input on the memory-efficient path.

Semantics asserted: SGD steps of an encoder under DDP or inside a ``fully_shard``-ed (FSDP2)
model with a loss module (its learnable scalars inside or outside the DDP module, dense or ring
path, uneven local batches) leave exactly the parameters of the same steps of one process on
the concatenated batch; the modules' scalars get the single-process gradient on every rank.
Errors are raised on every rank.
"""

from __future__ import annotations

import math

import pytest
import torch
from torch import Tensor, nn
from torch.distributed.fsdp import fully_shard
from torch.nn.parallel import DistributedDataParallel

import distgrad as dg
from distgrad.errors import CollectiveArgumentError
from distgrad.testing import run_on_ranks
from tests._support import FLOAT64, seeded

ROWS = 8


def _batch() -> tuple[Tensor, Tensor]:
    gen = seeded(3)
    base = torch.randn(ROWS, 6, dtype=torch.float64, generator=gen)
    return base, base + 0.2 * torch.randn(ROWS, 6, dtype=torch.float64, generator=gen)


def _make(kind: str, block: int | None) -> tuple[nn.Module, nn.Module]:
    torch.manual_seed(0)
    encoder = nn.Linear(6, 4).double()
    criterion: nn.Module = {
        "clip": lambda: dg.losses.CLIPLoss(10.0, block_size=block),
        "siglip": lambda: dg.losses.SigLIPLoss(3.0, -2.0, block_size=block),
        "nt_xent": lambda: dg.losses.NTXentLoss(0.3, learnable=True, block_size=block),
        "info_nce": lambda: dg.losses.InfoNCELoss(0.3, learnable=True, block_size=block),
        "barlow_twins": lambda: dg.losses.BarlowTwinsLoss(0.1),
    }[kind]()
    return encoder, criterion.double()


def _step(encoder: nn.Module, criterion: nn.Module, a: Tensor, b: Tensor) -> None:
    optimizer = torch.optim.SGD([*encoder.parameters(), *criterion.parameters()], lr=0.3)
    criterion(encoder(a), encoder(b)).backward()
    optimizer.step()


CASES = [
    ("clip", None),
    ("clip", 2),
    ("siglip", 3),
    ("nt_xent", 2),
    ("info_nce", None),
    ("barlow_twins", None),
]


def _ddp_steps(rank: int, world_size: int, sizes: list[int]) -> list[list[Tensor]]:
    a, b = _batch()
    mine = slice(sum(sizes[:rank]), sum(sizes[: rank + 1]))
    out = []
    for kind, block in CASES:
        encoder, criterion = _make(kind, block)
        ddp = DistributedDataParallel(encoder)  # the loss module stays outside DDP
        _step(ddp, criterion, a[mine], b[mine])
        out.append([p.detach() for p in [*encoder.parameters(), *criterion.parameters()]])
    return out


@pytest.mark.parametrize("sizes", [[5, 3], [3, 0, 2, 3]], ids=str)
def test_one_ddp_step_with_a_loss_module_outside_ddp_equals_one_process(sizes: list[int]) -> None:
    """Parameters after one step, every rank, float64 (tolerance 1e-10: reduction order)."""
    per_rank = run_on_ranks(_ddp_steps, len(sizes), args=(sizes,))
    for i, (kind, block) in enumerate(CASES):
        encoder, criterion = _make(kind, block)
        _step(encoder, criterion, *_batch())
        expected = [*encoder.parameters(), *criterion.parameters()]
        for rank, result in enumerate(per_rank):
            for got, want in zip(result[i], expected, strict=True):
                torch.testing.assert_close(got, want.detach(), **FLOAT64, msg=f"{kind} rank {rank}")


class _Together(nn.Module):
    """An encoder and a loss module in one model (what DDP or fully_shard wraps)."""

    def __init__(self, kind: str, block: int | None) -> None:
        super().__init__()
        self.encoder, self.criterion = _make(kind, block)

    def forward(self, a: Tensor, b: Tensor) -> Tensor:
        out: Tensor = self.criterion(self.encoder(a), self.encoder(b))
        return out


STEPS = 3


def _train(model: nn.Module, a: Tensor, b: Tensor) -> None:
    """STEPS steps of SGD with momentum (so each step also carries the earlier ones)."""
    optimizer = torch.optim.SGD(model.parameters(), lr=0.3, momentum=0.9)
    for _ in range(STEPS):
        optimizer.zero_grad()
        model(a, b).backward()
        optimizer.step()


def _full(p: Tensor) -> Tensor:
    """A parameter's full value: FSDP2 holds a shard of it (a DTensor)."""
    full = p.full_tensor() if hasattr(p, "full_tensor") else p
    return full.detach().clone()


def _wrapped_training(rank: int, world_size: int, wrapper: str) -> list[list[Tensor]]:
    a, b = _batch()
    mine = slice(0, 5) if rank == 0 else slice(5, ROWS)  # uneven: 5 and 3 rows
    out = []
    for kind, block in CASES:
        model = _Together(kind, block)
        if wrapper == "fsdp2":
            fully_shard(model.encoder)
            fully_shard(model)  # the root holds the loss module's scalars
            _train(model, a[mine], b[mine])
        else:
            ddp = DistributedDataParallel(model)  # kept alive: its reducer outlives the backward
            _train(ddp, a[mine], b[mine])
        out.append([_full(p) for p in model.parameters()])
    return out


@pytest.mark.parametrize("wrapper", ["ddp", "fsdp2"])
def test_training_with_the_loss_module_inside_the_wrapped_model_equals_one_process(
    wrapper: str,
) -> None:
    """Every loss module inside the DDP or fully_shard-ed model, 3 SGD steps with momentum on 2
    ranks (5 and 3 rows): every parameter equals one process's (tolerance 1e-10: reduction
    order). DDP and FSDP2 average the already replicated scalar gradients, which changes
    nothing."""
    per_rank = run_on_ranks(_wrapped_training, 2, args=(wrapper,))
    for i, (kind, block) in enumerate(CASES):
        model = _Together(kind, block)
        _train(model, *_batch())
        for rank, result in enumerate(per_rank):
            for got, want in zip(result[i], model.parameters(), strict=True):
                torch.testing.assert_close(got, want.detach(), **FLOAT64, msg=f"{kind} rank {rank}")


def test_learnable_scalars_are_one_element_vectors_as_fully_shard_requires() -> None:
    for kind, _ in CASES:
        for name, p in _make(kind, None)[1].named_parameters():
            assert p.shape == (1,), f"{kind}.{name}: {tuple(p.shape)}"


def test_checkpoints_of_earlier_releases_still_load() -> None:
    """Earlier releases saved 0-dim scalars, and SigLIPLoss's as log_scale and bias."""
    old = {"log_scale": torch.tensor(math.log(3.0)), "bias": torch.tensor(-2.0)}
    siglip = dg.losses.SigLIPLoss()
    siglip.load_state_dict(old)
    assert siglip.log_logit_scale.tolist() == pytest.approx([math.log(3.0)])
    assert siglip.logit_bias.tolist() == [-2.0]
    clip = dg.losses.CLIPLoss()
    clip.load_state_dict({"log_logit_scale": torch.tensor(math.log(50.0))})
    assert clip.log_logit_scale.tolist() == pytest.approx([math.log(50.0)])
    nested = nn.Sequential(nn.Linear(2, 2), dg.losses.NTXentLoss())
    state = nested.state_dict()
    state["1.log_temperature"] = torch.tensor(math.log(0.2))
    nested.load_state_dict(state)
    assert nested[1].log_temperature.tolist() == pytest.approx([math.log(0.2)])
    assert list(siglip.state_dict()) == ["log_logit_scale", "logit_bias"]  # today's names


def test_siglip_keywords_of_earlier_releases_warn_and_still_work() -> None:
    gen = seeded(0)
    x, y = (torch.randn(4, 3, generator=gen) for _ in range(2))
    with pytest.warns(
        FutureWarning,
        match=r"siglip_loss\(scale=, bias=...\) is deprecated.*logit_scale=, logit_bias=",
    ):
        old = dg.losses.siglip_loss(x, y, scale=3.0, bias=-1.0)
    torch.testing.assert_close(old, dg.losses.siglip_loss(x, y, 3.0, -1.0))
    with pytest.warns(FutureWarning, match=r"SigLIPLoss\(bias=...\) is deprecated"):
        module = dg.losses.SigLIPLoss(bias=-1.0)
    assert module.logit_bias.tolist() == [-1.0]
    with pytest.raises(TypeError, match="got both scale= and logit_scale="):
        dg.losses.siglip_loss(x, y, scale=3.0, logit_scale=3.0)


def _float32(rank: int, world_size: int, block: int | None) -> list[Tensor]:
    gen = seeded(5)
    x, y = (torch.randn(64, 32, generator=gen) for _ in range(2))
    mine = slice(rank * 32, (rank + 1) * 32)
    x, y = x[mine].requires_grad_(), y[mine].requires_grad_()
    scale = torch.tensor(20.0, requires_grad=True)
    loss = dg.losses.clip_loss(x, y, logit_scale=scale, block_size=block)
    loss.backward()
    assert x.grad is not None and y.grad is not None and scale.grad is not None
    return [loss.detach(), x.grad, y.grad, scale.grad]


@pytest.mark.parametrize("block", [None, 8], ids=["dense", "ring"])
def test_float32_clip_on_two_ranks_matches_float64_single_process(block: int | None) -> None:
    """float32 against a float64 reference: rtol 1e-5, atol 1e-6 (float32 rounding over 64
    candidates and a logit scale of 20)."""
    gen = seeded(5)
    x, y = (torch.randn(64, 32, generator=gen).double().requires_grad_() for _ in range(2))
    scale = torch.tensor(20.0, dtype=torch.float64, requires_grad=True)
    loss = dg.losses.clip_loss(x, y, logit_scale=scale)
    loss.backward()
    assert x.grad is not None and y.grad is not None and scale.grad is not None
    per_rank = run_on_ranks(_float32, 2, args=(block,))
    tol = {"rtol": 1e-5, "atol": 1e-6, "check_dtype": False}
    for rank, (value, gx, gy, _) in enumerate(per_rank):
        rows = slice(rank * 32, (rank + 1) * 32)
        torch.testing.assert_close(value, loss.detach(), **tol)
        torch.testing.assert_close(gx, 2 * x.grad[rows], **tol)  # world_size x (contract)
        torch.testing.assert_close(gy, 2 * y.grad[rows], **tol)
    averaged = sum(r[3] for r in per_rank) / 2
    torch.testing.assert_close(averaged, scale.grad, **tol)


def _ring_bad_inputs(rank: int, world_size: int) -> list[str]:
    calls = [
        lambda: dg.losses.siglip_loss(torch.ones(3, 4), torch.ones(3, 4), block_size=0),
        lambda: dg.losses.nt_xent(
            torch.ones(3, 4), torch.ones(3, 4), temperature=-1.0 if rank else 0.5, block_size=2
        ),
        lambda: dg.losses.clip_loss(torch.ones(3, 4), torch.ones(3, 5), block_size=2),
        lambda: dg.losses.info_nce(torch.ones(3, 4), torch.ones(3 - rank, 4), block_size=2),
    ]
    seen = []
    for call in calls:
        try:
            call()
        except CollectiveArgumentError as exc:
            seen.append(str(exc))
        else:
            seen.append("no error")
    return seen


def test_bad_input_on_the_ring_path_raises_on_every_rank() -> None:
    """block_size, temperature on one rank only, dims of the two modalities, batch sizes of
    the two views on one rank only: the same error on both ranks, no hang."""
    for seen in run_on_ranks(_ring_bad_inputs, 2, timeout=30):
        assert "block_size must be None (dense), 'auto' or a positive int, got 0" in seen[0]
        assert "rank 1: temperature must be finite and positive, got -1.0" in seen[1]
        assert "image and text must have the same shape" in seen[2]
        assert "rank 1: query and key must have the same shape" in seen[3]


def test_module_rejects_a_non_positive_initial_temperature() -> None:
    with pytest.raises(ValueError, match=r"temperature must be finite and positive, got 0\.0"):
        dg.losses.NTXentLoss(0.0)
    with pytest.raises(ValueError, match="logit_scale must be finite and positive, got inf"):
        dg.losses.CLIPLoss(float("inf"))
