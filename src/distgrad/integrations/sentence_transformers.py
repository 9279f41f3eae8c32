"""sentence-transformers' ``MultipleNegativesRankingLoss`` and its cached (GradCache) variant,
exact over the global batch.

One changed import in sentence-transformers' training code (``sentence_transformers.losses``
-> this module): the constructors take sentence-transformers 6.2's arguments (the model first),
``forward(sentence_features, labels)`` its inputs: a list of tokenized columns (anchor,
positive, then any hard negatives), each embedded by ``model(features)["sentence_embedding"]``.
The loss is :func:`distgrad.losses.info_nce` of the anchors against every rank's positives
and every rank's hard negatives (docs/losses.md, "Hard negatives"). What each option does:

* ``scale``: the inverse temperature (``temperature = 1 / scale``); must be positive.
* ``similarity_fct``: ``None`` or sentence-transformers' ``cos_sim`` (the default: cosine),
  or its ``dot_score`` (the embeddings as given). Any other function is refused: the loss
  computes its similarities inside distgrad's kernels.
* ``gather_across_devices``: accepted and moot: the candidates are always every rank's, and
  every rank returns the global mean loss, so DistributedDataParallel's averaging gives the
  single-process gradient. (sentence-transformers with ``False`` takes the candidates from
  the local batch only.)
* ``directions``: ``("query_to_doc",)`` or ``("query_to_doc", "doc_to_query")``;
  ``"query_to_query"`` and ``"doc_to_doc"`` (same-type negatives) are refused.
* ``partition_mode``: ``"joint"`` or ``"per_direction"``, as sentence-transformers.
* ``hardness_mode`` with ``hardness_strength > 0``: refused (distgrad's loss has no hardness
  weighting); with strength 0 it has no effect, as in sentence-transformers.
* ``labels``: ignored, as sentence-transformers ignores it.

The cached variant adds ``mini_batch_size`` (the embedding passes go ``mini_batch_size`` rows
at a time), ``mini_batch_num_tokens`` (refused: pack by ``mini_batch_size``) and
``show_progress_bar`` (accepted; no bar is drawn).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import contextmanager, nullcontext
from functools import partial
from typing import Any, Literal

import torch
from torch import Tensor, nn
from torch.nn.parallel import DistributedDataParallel
from torch.utils.checkpoint import get_device_states, set_device_states

from distgrad._mesh import GroupLike
from distgrad.integrations._options import refuse
from distgrad.losses.contrastive import Directions, info_nce

__all__ = ["CachedMultipleNegativesRankingLoss", "MultipleNegativesRankingLoss"]

Direction = Literal["query_to_doc", "query_to_query", "doc_to_query", "doc_to_doc"]
Features = dict[str, Any]
_DIRECTIONS: dict[str, Literal["query_to_key", "key_to_query"]] = {
    "query_to_doc": "query_to_key",
    "doc_to_query": "key_to_query",
}


def _normalizes(loss: str, similarity_fct: Callable[[Tensor, Tensor], Tensor] | None) -> bool:
    """Whether ``similarity_fct`` is cosine (True) or the dot product (False), recognised by
    sentence-transformers' names; anything else is refused."""
    name = getattr(similarity_fct, "__name__", None)
    if similarity_fct is None or name == "cos_sim":
        return True
    if name == "dot_score":
        return False
    raise refuse(
        loss,
        "similarity_fct",
        similarity_fct,
        "pass sentence_transformers.util.cos_sim (the default) or dot_score",
    )


class MultipleNegativesRankingLoss(nn.Module):
    """InfoNCE with in-batch and hard negatives over the global batch, with
    sentence-transformers' ``MultipleNegativesRankingLoss`` signature (module docstring).

    The value, on every rank: the mean over the global batch's anchors of
    ``-log softmax(scale * sim(a_i, C))[p_i]``, ``C`` every rank's positives and hard
    negatives (sentence-transformers' value on a rank is the mean over its own anchors; the
    mean of those over ranks, with even shards, is this). ``group``, ``sizes``: see
    :func:`distgrad.losses.info_nce`; its docstring gives the communication.

    Args:
        model: the encoder: ``model(features)["sentence_embedding"]`` embeds one column (a
            SentenceTransformer, or any module that returns that dict).
        scale: the inverse temperature (``temperature = 1 / scale``); must be positive.
        similarity_fct: ``None`` or sentence-transformers' ``cos_sim`` (cosine), or its
            ``dot_score`` (the embeddings as given), recognised by name.
        gather_across_devices: accepted, and changes nothing (the candidates are always
            every rank's).
        directions: ``("query_to_doc",)``, or with ``"doc_to_query"`` too (the symmetric
            loss); same-type negatives are refused.
        partition_mode: with both directions, ``"joint"`` (one softmax over both sets of
            candidates) or ``"per_direction"`` (the mean of the two cross-entropies).
        hardness_mode: sentence-transformers' hardness weighting; refused with a positive
            ``hardness_strength``, which it has no effect without.
        hardness_strength: the weighting's strength; only 0 (no weighting) is accepted with a
            ``hardness_mode``.
        group: distgrad's: the process group (default: the default group) or a DeviceMesh
            dimension, whose ranks hold the global batch.
        sizes: distgrad's: every rank's row count, the same list on every rank; given, the
            ranks need not exchange their row counts (default: they do).

    Raises:
        UnsupportedOptionError: a ``scale`` that is not positive, a ``similarity_fct`` other
            than ``cos_sim`` and ``dot_score``, ``directions`` without ``"query_to_doc"`` or
            with same-type negatives, an unknown ``partition_mode``, a ``hardness_mode`` with
            ``hardness_strength > 0``; and, in
            the forward, fewer than two columns. The forward raises as
            ``distgrad.losses.info_nce`` does otherwise.

    Example:
        >>> class Encoder(torch.nn.Linear):  # a SentenceTransformer in miniature
        ...     def forward(self, features):  # float rows stand in for token ids
        ...         return {"sentence_embedding": super().forward(features["input_ids"])}
        >>> model = Encoder(8, 4, dtype=torch.float64)
        >>> g = torch.Generator().manual_seed(0)
        >>> anchors, positives = ({"input_ids": x} for x in torch.randn(2, 4, 8, generator=g,
        ...                                                              dtype=torch.float64))
        >>> MNRL = dg.integrations.sentence_transformers.MultipleNegativesRankingLoss
        >>> loss = MNRL(model, scale=20.0)([anchors, positives], None)  # (columns, labels)
        >>> embed = [model(column)["sentence_embedding"] for column in (anchors, positives)]
        >>> torch.equal(loss, dg.losses.info_nce(*embed, temperature=1 / 20.0))
        True
    """

    def __init__(
        self,
        model: nn.Module,
        scale: float = 20.0,
        similarity_fct: Callable[[Tensor, Tensor], Tensor] | None = None,
        gather_across_devices: bool = False,
        directions: tuple[Direction, ...] = ("query_to_doc",),
        partition_mode: Literal["joint", "per_direction"] = "joint",
        hardness_mode: Literal["in_batch_negatives", "hard_negatives", "all_negatives"]
        | None = None,
        hardness_strength: float = 0.0,
        *,
        group: GroupLike = None,
        sizes: Sequence[int] | None = None,
    ) -> None:
        super().__init__()
        name = type(self).__name__
        if not scale > 0:
            raise refuse(name, "scale", scale, "pass a positive scale (1 / temperature)")
        self.normalize = _normalizes(name, similarity_fct)
        if "query_to_doc" not in directions or not set(directions) <= set(_DIRECTIONS):
            raise refuse(
                name,
                "directions",
                directions,
                "pass ('query_to_doc',) or ('query_to_doc', 'doc_to_query'): same-type "
                "negatives (query_to_query, doc_to_doc) are not offered",
            )
        if partition_mode not in ("joint", "per_direction"):
            raise refuse(name, "partition_mode", partition_mode, "pass 'joint' or 'per_direction'")
        if hardness_mode is not None and hardness_strength > 0:
            raise refuse(
                name,
                "hardness_mode",
                hardness_mode,
                "leave it None (or hardness_strength=0): distgrad's loss has no hardness weighting",
            )
        self.model = model
        self.scale, self.similarity_fct = scale, similarity_fct
        self.gather_across_devices = gather_across_devices
        self.directions, self.partition_mode = tuple(directions), partition_mode
        self.hardness_mode, self.hardness_strength = hardness_mode, hardness_strength
        self.group, self.sizes = group, sizes

    @property
    def temperature(self) -> float:
        """``1 / scale``, as sentence-transformers' property."""
        return 1.0 / self.scale

    def forward(self, sentence_features: Iterable[Features], labels: Tensor | None) -> Tensor:
        columns = list(sentence_features)
        embeddings = [self.model(features)["sentence_embedding"] for features in columns]
        return self.compute_loss_from_embeddings(embeddings, labels)

    def compute_loss_from_embeddings(
        self, embeddings: Sequence[Tensor], labels: Tensor | None = None
    ) -> Tensor:
        """The loss of the columns' embeddings: anchors, positives, then hard negatives,
        ``[B_l, D]`` each (sentence-transformers' method of the same name)."""
        if len(embeddings) < 2:
            raise refuse(
                type(self).__name__,
                "sentence_features",
                f"{len(embeddings)} column(s)",
                "pass at least the anchors and the positives",
            )
        anchors, positives, *hard = embeddings
        negatives = torch.stack(hard, 1) if hard else None  # [B_l, m, D]
        directions: Directions = tuple(_DIRECTIONS[d] for d in self.directions)
        return info_nce(
            anchors,
            positives,
            negatives=negatives,
            directions=directions,
            partition=self.partition_mode,
            temperature=1.0 / self.scale,
            normalize=self.normalize,
            group=self.group,
            sizes=self.sizes,
        )

    def get_config_dict(self) -> dict[str, Any]:
        """The options, as sentence-transformers' model cards record them."""
        return {
            "scale": self.scale,
            "similarity_fct": "cos_sim" if self.normalize else "dot_score",
            "gather_across_devices": self.gather_across_devices,
            "directions": self.directions,
            "partition_mode": self.partition_mode,
            "hardness_mode": self.hardness_mode,
            "hardness_strength": self.hardness_strength,
        }


class _Rng:
    """The CPU and device RNG states before a mini-batch's first embedding pass, restored for
    its second, so that dropout draws the same masks twice (GradCache's requirement)."""

    def __init__(self, features: Features) -> None:
        tensors = [v for v in features.values() if isinstance(v, Tensor)]
        self.cpu = torch.get_rng_state()
        self.devices, self.states = get_device_states(*tensors)

    @contextmanager
    def replayed(self) -> Iterator[None]:
        with torch.random.fork_rng(devices=self.devices):
            torch.set_rng_state(self.cpu)
            set_device_states(self.devices, self.states)
            yield


def _rows(features: Features) -> int:
    for key in ("input_ids", "attention_mask"):
        if isinstance(features.get(key), Tensor):
            return int(features[key].shape[0])
    return next(int(v.shape[0]) for v in features.values() if isinstance(v, Tensor) and v.ndim)


def _slice(features: Features, begin: int, end: int) -> Features:
    return {k: v[begin:end] if isinstance(v, Tensor) and v.ndim else v for k, v in features.items()}


class CachedMultipleNegativesRankingLoss(MultipleNegativesRankingLoss):
    """``MultipleNegativesRankingLoss`` with GradCache (Gao et al., 2021): the same value and
    gradients, with the encoder's memory that of ``mini_batch_size`` rows.

    The forward (1) embeds every column ``mini_batch_size`` rows at a time without a graph,
    keeping each mini-batch's RNG state; (2) computes the loss over the global batch from those
    embeddings and differentiates it with respect to them, which caches each embedding's
    gradient (the loss gathers every rank's embeddings with distgrad's ``all_gather``, whose
    backward returns every rank's gradient of a row to its owner, so the cache holds this
    rank's rows' whole gradient: W times their single-process one, as the uncached loss
    gives); and returns the value. Its backward (3) embeds each mini-batch again, with the
    same RNG state, and back-propagates its cached gradient times the loss's (a scalar the
    same on every rank in training: 1, a loss scale or an accumulation factor; since the
    loss's own backward already ran in the forward, a rank's factor scales its replay only,
    as in sentence-transformers' cached loss). Under
    DistributedDataParallel every replay but the last runs under ``no_sync()``, so the
    gradients are averaged once.

    Cost: two embedding passes of the batch (one without a graph), the loss's own
    communication in the forward, none in the backward.

    Args:
        model: the encoder: ``model(features)["sentence_embedding"]`` embeds one column (a
            SentenceTransformer, or any module that returns that dict).
        scale: the inverse temperature (``temperature = 1 / scale``); must be positive.
        similarity_fct: ``None`` or sentence-transformers' ``cos_sim`` (cosine), or its
            ``dot_score`` (the embeddings as given), recognised by name.
        mini_batch_size: the rows each embedding pass takes; a positive int.
        mini_batch_num_tokens: refused when given (pack the passes by ``mini_batch_size``).
        gather_across_devices: accepted, and changes nothing (the candidates are always
            every rank's).
        directions: ``("query_to_doc",)``, or with ``"doc_to_query"`` too (the symmetric
            loss); same-type negatives are refused.
        partition_mode: with both directions, ``"joint"`` (one softmax over both sets of
            candidates) or ``"per_direction"`` (the mean of the two cross-entropies).
        show_progress_bar: accepted; no bar is drawn.
        hardness_mode: sentence-transformers' hardness weighting; refused with a positive
            ``hardness_strength``, which it has no effect without.
        hardness_strength: the weighting's strength; only 0 (no weighting) is accepted with a
            ``hardness_mode``.
        group: distgrad's: the process group (default: the default group) or a DeviceMesh
            dimension, whose ranks hold the global batch.
        sizes: distgrad's: every rank's row count, the same list on every rank; given, the
            ranks need not exchange their row counts (default: they do).

    Raises:
        UnsupportedOptionError: a ``scale`` that is not positive, a ``similarity_fct`` other
            than ``cos_sim`` and ``dot_score``, ``directions`` without ``"query_to_doc"`` or
            with same-type negatives, an unknown ``partition_mode``, a ``hardness_mode`` with
            ``hardness_strength > 0``,
            ``mini_batch_num_tokens`` given, a ``mini_batch_size`` that is not a positive int;
            and, in the forward, fewer than two columns. The forward raises as
            ``distgrad.losses.info_nce`` does otherwise.

    Example:
        >>> class Encoder(torch.nn.Linear):  # a SentenceTransformer in miniature
        ...     def forward(self, features):  # float rows stand in for token ids
        ...         return {"sentence_embedding": super().forward(features["input_ids"])}
        >>> model = Encoder(8, 4, dtype=torch.float64)
        >>> g = torch.Generator().manual_seed(0)
        >>> anchors, positives = ({"input_ids": x} for x in torch.randn(2, 4, 8, generator=g,
        ...                                                              dtype=torch.float64))
        >>> st = dg.integrations.sentence_transformers
        >>> cached = st.CachedMultipleNegativesRankingLoss(model, mini_batch_size=2)
        >>> cached([anchors, positives], None).backward()  # two passes of 2 rows per column
        >>> grad, model.weight.grad = model.weight.grad, None
        >>> st.MultipleNegativesRankingLoss(model)([anchors, positives], None).backward()
        >>> torch.allclose(grad, model.weight.grad)  # the uncached loss's gradient
        True
    """

    def __init__(
        self,
        model: nn.Module,
        scale: float = 20.0,
        similarity_fct: Callable[[Tensor, Tensor], Tensor] | None = None,
        mini_batch_size: int = 32,
        mini_batch_num_tokens: int | None = None,
        gather_across_devices: bool = False,
        directions: tuple[Direction, ...] = ("query_to_doc",),
        partition_mode: Literal["joint", "per_direction"] = "joint",
        show_progress_bar: bool = False,
        hardness_mode: Literal["in_batch_negatives", "hard_negatives", "all_negatives"]
        | None = None,
        hardness_strength: float = 0.0,
        *,
        group: GroupLike = None,
        sizes: Sequence[int] | None = None,
    ) -> None:
        super().__init__(
            model,
            scale,
            similarity_fct,
            gather_across_devices,
            directions,
            partition_mode,
            hardness_mode,
            hardness_strength,
            group=group,
            sizes=sizes,
        )
        name = type(self).__name__
        if mini_batch_num_tokens is not None:
            raise refuse(
                name, "mini_batch_num_tokens", mini_batch_num_tokens, "use mini_batch_size"
            )
        if not (isinstance(mini_batch_size, int) and mini_batch_size > 0):
            raise refuse(name, "mini_batch_size", mini_batch_size, "pass a positive int")
        self.mini_batch_size, self.mini_batch_num_tokens = mini_batch_size, mini_batch_num_tokens
        self.show_progress_bar = show_progress_bar

    def _ranges(self, features: Features) -> list[tuple[int, int]]:
        rows, step = _rows(features), self.mini_batch_size
        return [(b, min(b + step, rows)) for b in range(0, rows, step)]

    def forward(self, sentence_features: Iterable[Features], labels: Tensor | None) -> Tensor:
        columns = list(sentence_features)
        ranges = [self._ranges(features) for features in columns]
        grad_enabled = torch.is_grad_enabled()
        reps: list[Tensor] = []
        states: list[list[_Rng]] = []
        with torch.no_grad():  # step 1: every mini-batch, no graph
            for features, spans in zip(columns, ranges, strict=True):
                parts, rngs = [], []
                for begin, end in spans:
                    batch = _slice(features, begin, end)
                    rngs.append(_Rng(batch))
                    parts.append(self.model(batch)["sentence_embedding"])
                reps.append(torch.cat(parts).detach().requires_grad_(grad_enabled))
                states.append(rngs)
        if not grad_enabled:
            return self.compute_loss_from_embeddings(reps, labels)
        with torch.enable_grad():  # step 2: the loss, and its gradient at the embeddings
            loss = self.compute_loss_from_embeddings(reps, labels)
            cache = torch.autograd.grad(loss, reps)
        out = loss.detach().requires_grad_()
        out.register_hook(  # type: ignore[no-untyped-call]
            partial(self._replay, columns, ranges, states, cache)
        )
        return out

    def _replay(
        self,
        columns: list[Features],
        ranges: list[list[tuple[int, int]]],
        states: list[list[_Rng]],
        cache: tuple[Tensor, ...],
        grad_output: Tensor,
    ) -> None:
        """Step 3, in the loss's backward: each mini-batch embedded again with its RNG state,
        its cached gradient (times the loss's) back-propagated into the model."""
        model = self.model
        left = sum(len(spans) for spans in ranges)
        with torch.enable_grad():
            for features, spans, rngs, grads in zip(columns, ranges, states, cache, strict=True):
                for (begin, end), rng in zip(spans, rngs, strict=True):
                    left -= 1
                    # DDP averages once, after the last replay
                    later = isinstance(model, DistributedDataParallel) and left > 0
                    deferred = model.no_sync() if later else nullcontext()  # type: ignore[operator]
                    with deferred, rng.replayed():
                        rep = model(_slice(features, begin, end))["sentence_embedding"]
                        if rep.requires_grad:
                            rep.backward(grads[begin:end] * grad_output)

    def get_config_dict(self) -> dict[str, Any]:
        """The options, as sentence-transformers' model cards record them."""
        return {
            **super().get_config_dict(),
            "mini_batch_size": self.mini_batch_size,
            "mini_batch_num_tokens": self.mini_batch_num_tokens,
        }
