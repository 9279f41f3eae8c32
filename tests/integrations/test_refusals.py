"""What the drop-ins cannot honour is refused when the loss is built, with an
UnsupportedOptionError (a ValueError) that names the loss, the argument, what was passed and
what to do; what they accept and ignore is accepted. No process group: these are checks of
the arguments alone."""

from __future__ import annotations

import pytest
import torch

from distgrad.errors import UnsupportedOptionError
from distgrad.integrations import lightly, open_clip, sentence_transformers

st = sentence_transformers


def _dot_score(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return a @ b.T


_dot_score.__name__ = "dot_score"

REFUSED = [
    (lambda: open_clip.ClipLoss(use_horovod=True), "use_horovod=True", "torch.distributed"),
    (lambda: open_clip.ClipLoss(rank=1, world_size=4), "rank=1, world_size=4", "rank 0 of 1"),
    (lambda: open_clip.SigLipLoss(dist_impl="ring"), "dist_impl='ring'", "'bidir'"),
    (
        lambda: lightly.NTXentLoss(memory_bank_size=(4096, 128)),
        "memory_bank_size=(4096, 128)",
        "lightly's own loss",
    ),
    (lambda: lightly.NTXentLoss(temperature=-0.5), "temperature=-0.5", "positive"),
    (
        lambda: st.MultipleNegativesRankingLoss(None, directions=("query_to_doc", "doc_to_doc")),
        "directions=",
        "same-type negatives",
    ),
    (
        lambda: st.MultipleNegativesRankingLoss(
            None, hardness_mode="hard_negatives", hardness_strength=5.0
        ),
        "hardness_mode='hard_negatives'",
        "no hardness weighting",
    ),
    (
        lambda: st.MultipleNegativesRankingLoss(None, similarity_fct=torch.cdist),
        "similarity_fct=",
        "cos_sim",
    ),
    (lambda: st.MultipleNegativesRankingLoss(None, scale=0.0), "scale=0.0", "positive"),
    (
        lambda: st.CachedMultipleNegativesRankingLoss(None, mini_batch_num_tokens=512),
        "mini_batch_num_tokens=512",
        "mini_batch_size",
    ),
    (
        lambda: st.CachedMultipleNegativesRankingLoss(None, mini_batch_size=0),
        "mini_batch_size=0",
        "positive int",
    ),
]


@pytest.mark.parametrize(("build", "passed", "instead"), REFUSED)
def test_an_option_that_cannot_be_honoured_is_refused_naming_it(
    build: object, passed: str, instead: str
) -> None:
    with pytest.raises(UnsupportedOptionError) as caught:
        build()  # type: ignore[operator]
    message = str(caught.value)
    assert passed in message and instead in message, message
    assert isinstance(caught.value, ValueError)


def test_what_is_moot_is_accepted() -> None:
    """Every distributed flag, label caching, a zero hardness strength, the dot product."""
    open_clip.ClipLoss(local_loss=True, gather_with_grad=True, cache_labels=True)
    open_clip.SigLipLoss(cache_labels=True, dist_impl="shift")
    lightly.NTXentLoss(memory_bank_size=0, gather_distributed=True)
    lightly.NTXentLoss(memory_bank_size=(0, 128))  # lightly's bank, disabled
    lightly.BarlowTwinsLoss(lambda_param=0.01, gather_distributed=True)
    loss = st.CachedMultipleNegativesRankingLoss(
        None,
        similarity_fct=_dot_score,
        hardness_mode="in_batch_negatives",
        gather_across_devices=True,
        show_progress_bar=True,
    )
    assert loss.get_config_dict()["similarity_fct"] == "dot_score"
    assert loss.temperature == 1 / 20.0


def test_output_dict_and_logit_bias_as_open_clip() -> None:
    """``output_dict=True`` returns {"contrastive_loss": loss}; ClipLoss's logit_bias changes
    nothing and gets a gradient of exactly 0; SigLipLoss's None bias is 0."""
    gen = torch.Generator().manual_seed(0)
    x, y = (
        torch.nn.functional.normalize(torch.randn(4, 3, generator=gen, dtype=torch.float64), dim=1)
        for _ in range(2)
    )
    bias = torch.tensor(-3.0, dtype=torch.float64, requires_grad=True)
    out = open_clip.ClipLoss()(x, y, 5.0, bias, output_dict=True)
    assert isinstance(out, dict) and list(out) == ["contrastive_loss"]
    torch.testing.assert_close(out["contrastive_loss"], open_clip.ClipLoss()(x, y, 5.0))
    out["contrastive_loss"].backward()
    assert bias.grad is not None and float(bias.grad) == 0.0
    sig = open_clip.SigLipLoss()
    torch.testing.assert_close(sig(x, y, 5.0, None), sig(x, y, 5.0, 0.0))
