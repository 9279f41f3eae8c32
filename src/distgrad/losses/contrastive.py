"""Contrastive losses over the global batch: NT-Xent, InfoNCE, CLIP and SigLIP.

Shapes: ``B`` the global batch, ``B_l`` this rank's rows, ``D`` the embedding dim. Every loss
gathers the candidates it needs with :func:`distgrad.all_gather` (uneven ``B_l`` allowed) and
computes the rows of the global loss that belong to this rank's anchors, so each rank holds a
``[B_l, B]`` block of logits (``[2 B_l, 2 B]`` for NT-Xent).

Value and gradient: every rank returns the global mean loss; its gradient is world_size times
that of its share, so that DistributedDataParallel's averaging gives exactly the single-process
gradient (``_global.global_mean``).

``sizes``: every rank's row count, the same list on every rank (``[B_l] * world_size`` for
even shards). With it a loss sends nothing but the embeddings and the value; without it the
ranks first exchange their row counts (one small all_gather and a host synchronisation), and
inside ``torch.compile`` take them to be alike and check that on the device.

Precision: the loss computes in float32 at least, with autocast off, whatever the inputs'
dtype (``_unit`` says why); the gradients flow back in the inputs' dtype.

``block_size``: None (default) takes the dense path above; ``"auto"`` takes it unless its
logits would pass ``AUTO_DENSE_BYTES`` per rank (``choose_block``). An int takes the
memory-efficient path (``_blockwise``): the keys go round a ring of ranks instead of being
gathered, and no rank ever holds more than ``[block_size, block_size]`` logits per tile, forward
or backward (the backward recomputes them), whatever B_l. Same value and gradients; not twice
differentiable. Communication of the ring path (``distgrad._exchange.ring``, each exchange
overlapped with a block's compute): ``info_nce``, ``nt_xent`` and ``siglip_loss`` forward
W - 1 exchanges of [max B_l, D], backward W + 1 (the keys W - 1 times, their gradient
accumulators [max B_l, D] W times); ``clip_loss`` forward W + 1 (the texts W - 1 times,
their column logsumexps W times), backward W + 1 (the texts with their column statistics
[max B_l, D + 2] W - 1 times, their gradient W times). Compute: 4 matmuls of
B_l x D x B where the dense path does 3 (CLIP too: both its directions share one pass).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any, Literal

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.autograd.function import FunctionCtx

from distgrad._exchange.group import Group, first_row
from distgrad._mesh import GroupLike
from distgrad.collectives.all_gather import apply_all_gather
from distgrad.losses._blockwise import ring_clip, ring_reduce
from distgrad.losses._compat import renamed
from distgrad.losses._global import (
    CLIP_LOSS,
    INFO_NCE,
    NT_XENT,
    SIGLIP_LOSS,
    batch_sizes,
    global_mean,
    global_mean_of,
)

__all__ = [
    "BlockSize",
    "Directions",
    "Partition",
    "choose_block",
    "clip_loss",
    "info_nce",
    "nt_xent",
    "siglip_loss",
]

Scalar = float | Tensor
#: ``block_size``: None (dense), ``"auto"`` (dense unless its logits are large) or the ring's block
BlockSize = int | Literal["auto"] | None


# block_size="auto": the dense path unless its logits would pass this many bytes per rank.
# Why memory alone decides: the ring does one more B_l x D x B matmul than the dense path (4
# against 3) and as many elementwise passes over its chunks as the dense path makes over its
# logits, so it is not faster where the dense logits fit (measured on 2 and 4 CPU ranks, dim
# 512, B_local 1024 to 8192: benchmarks/results/losses.md); it holds [block, block] tiles.
AUTO_DENSE_BYTES = 2 * 2**30
# The ring's block under "auto": CPU 1024 (the benchmarks' block), CUDA 4096 (wider matmuls;
# the block of the H100 timings in benchmarks/results/gpu_check.md).
AUTO_BLOCK = {"cpu": 1024, "cuda": 4096}


def choose_block(
    block_size: BlockSize, rows: Sequence[int], x: Tensor, factor: int = 1, columns: int = 1
) -> int | None:
    """The block size to use: ``block_size`` itself, or for ``"auto"`` the ring's block when
    the dense path's float32 logits ``[factor * max B_l, factor * columns * B]`` (NT-Xent:
    factor 2; InfoNCE with m hard negatives: columns 1 + m) would pass ``AUTO_DENSE_BYTES``,
    else None (dense). Depends only on what every rank knows alike (the row counts, the
    options and the device type), so every rank picks the same path."""
    if block_size != "auto":
        return block_size
    logits = factor * max(rows) * factor * columns * sum(rows) * 4
    return AUTO_BLOCK.get(x.device.type, 4096) if logits > AUTO_DENSE_BYTES else None


@contextmanager
def _float32(x: Tensor) -> Iterator[None]:
    """Where the loss computes: autocast off, so the logits and their reductions stay in the
    inputs' precision, which ``_unit`` raises to float32 at least (see ``_unit``)."""
    with torch.autocast(x.device.type, enabled=False):
        yield


def _unit(x: Tensor, normalize: bool) -> Tensor:
    """``x`` in float32 at least, its rows L2-normalised (unless the model already did).

    Why float32: measured on InfoNCE (B=1024, D=128, t=0.07, bfloat16 features), logits
    computed in bfloat16 under autocast are off by up to 0.09 and the features' gradient by
    6e-3 relative; in float32, 6e-6 and 4e-5. The logits are [B_l, B] against the encoder's
    work, so float32 costs little. The gathered embeddings travel in float32 too (B x D values
    per step, twice a bfloat16 exchange).
    """
    x = x.to(torch.promote_types(x.dtype, torch.float32))
    return F.normalize(x, dim=1) if normalize else x


def _cross_entropy_sum(logits: Tensor, labels: Tensor) -> Tensor:
    """``F.cross_entropy(logits, labels, reduction="sum")`` as its two steps, log_softmax and
    picking each row's label. Why not the fused op: its ``nll_loss`` cannot take a row count
    that is a per-rank value, so ``simulate=True`` (every rank in one process, each with its
    own rows) could not run the losses. The same two kernels as the fused op, the same tensor
    saved for backward (log_softmax's output)."""
    return -F.log_softmax(logits, 1).gather(1, labels.unsqueeze(1)).sum()


def _scalar(value: Scalar, like: Tensor) -> Tensor:
    """``value`` as a 0-dim tensor of ``like``'s dtype (keeping its autograd history).

    A Python number is filled in on the device: ``torch.as_tensor`` would copy it there from
    pageable host memory, a host synchronisation on CUDA at every call (seen on an H200)."""
    if isinstance(value, Tensor):
        return value.to(dtype=like.dtype, device=like.device).reshape(())
    return torch.full((), value, dtype=like.dtype, device=like.device)


Directions = tuple[Literal["query_to_key", "key_to_query"], ...]
Partition = Literal["joint", "per_direction"]


def info_nce(
    query: Tensor,
    key: Tensor,
    *,
    negatives: Tensor | None = None,
    directions: Directions = ("query_to_key",),
    partition: Partition = "joint",
    temperature: Scalar = 0.1,
    normalize: bool = True,
    group: GroupLike = None,
    sizes: Sequence[int] | None = None,
    block_size: BlockSize = None,
) -> Tensor:
    """InfoNCE: each query's positive is the key of the same global row; its negatives are all
    other keys of the global batch and, with ``negatives``, every rank's hard negatives.

    ``L = (1/B) sum_i [logsumexp_{c in C} s <q_i, c> - s <q_i, k_i>]`` over cosine similarities
    (both L2-normalised here; ``normalize=False`` takes the embeddings as given, for features
    the model already normalised), ``s = 1 / temperature`` (a tensor that requires grad, or a
    number), ``C`` every rank's keys and every rank's negatives.

    ``negatives``: [B_l, m, D], row i's m hard negatives (the same m on every rank; from m
    tensors of [B_l, D], ``torch.stack(negs, 1)``). ``directions=("query_to_key",
    "key_to_query")`` adds each key's term against every query of the global batch
    (``logsumexp_j s <k_i, q_j>``; the negatives are candidates, never anchors), combined with
    ``partition``: ``"joint"`` one softmax over both sets (``logaddexp`` of the two
    logsumexps), ``"per_direction"`` the mean of the two cross-entropies (CLIP's form). The
    names follow sentence-transformers' ``MultipleNegativesRankingLoss`` (``query_to_doc``,
    ``doc_to_query``, ``partition_mode``); docs/losses.md, "Hard negatives".

    Communication: forward 1 all_gather of the keys [B_l, D], 1 of the negatives [B_l m, D]
    (with negatives), 1 of [B + 1] (both directions) and a scalar all_reduce for the value;
    backward a reduce-scatter for each gather. Memory: [B_l, B (1 + m)] logits. The row-count
    exchange and the precision are common to every loss (module docstring).

    Args:
        query: this rank's queries, [B_l, D].
        key: this rank's keys, [B_l, D]; row i is ``query[i]``'s positive.
        negatives: this rank's hard negatives, [B_l, m, D] (the same m on every rank), or None.
        directions: ``("query_to_key",)`` or ``("query_to_key", "key_to_query")``.
        partition: with both directions, ``"joint"`` (one softmax over both sets) or
            ``"per_direction"`` (the mean of the two cross-entropies).
        temperature: a number or a tensor that requires grad; finite and positive.
        normalize: L2-normalise the embeddings first (``False``: take them as given).
        group: the process group (default: the default group) or a DeviceMesh dimension.
        sizes: every rank's row count, the same list on every rank (``[B_l] * world_size``); given,
            the loss sends nothing but the embeddings and the value.
        block_size: ``None`` the dense path; an int the ring path, which never holds more than
            ``[B_l, block_size]`` logits per rank; ``"auto"`` the dense path unless its logits
            would be too large.

    Returns:
        The global batch's mean loss, a scalar, the same on every rank.

    Raises:
        CollectiveArgumentError: an invalid argument on some rank (``query`` and ``key`` of
            different shapes, ``negatives`` not [B_l, m, D], unknown ``directions`` or
            ``partition``, a temperature that is not finite and positive, ``sizes`` that are not
            every rank's row count, a ``block_size`` that is not positive); raised on every rank of
            the group.
        CollectiveMismatchError: the ranks' embeddings do not fit together (another dim or dtype),
            found while the group's first calls are checked and in debug mode.
        torch.distributed.DistBackendError: a peer died or never came (docs/faults.md).

    Example:
        >>> g = torch.Generator().manual_seed(0)
        >>> query, key = torch.randn(2, 8, 16, dtype=torch.float64, generator=g)
        >>> round(dg.losses.info_nce(query, key).item(), 4)  # one process, the whole batch
        3.6848
        >>> dg.testing.check_against_single_process(  # 4 ranks of 2 rows, simulated here
        ...     dg.losses.info_nce, {"query": query, "key": key}, world_size=4, simulate=True
        ... ).ok  # the same value and gradients
        True
    """
    call = INFO_NCE.bind(
        group,
        key,
        query=query,
        directions=directions,
        partition=partition,
        negatives=negatives,
        block_size=block_size,
        temperature=temperature,
        sizes=sizes,
    )
    g, m, symmetric = call.group, call["negatives"], call["directions"]
    joint = call["partition"] == "joint"
    rows = batch_sizes(call, key, (m, int(symmetric), int(joint)))
    with _float32(key):
        q, k = _unit(query, normalize), _unit(key, normalize)
        # [B_l m, D]: row i's negatives at rows i m .. i m + m - 1
        n = None if negatives is None or m == 0 else _unit(negatives.flatten(0, 1), normalize)
        t = _scalar(temperature, q)
        block = choose_block(block_size, rows, q, columns=1 + m)
        if n is None and not symmetric:
            if block is not None:
                return _ring_info_nce(q, k, 1 / t, g, rows, block)
            keys = apply_all_gather(k, g, rows, 0)  # [B, D]
            offset, total = first_row(rows, g.rank), sum(rows)
            logits = q @ keys.T / t  # [B_l, B]; positives at column offset + i
            labels = torch.arange(q.shape[0], device=q.device) + offset
            return global_mean(_cross_entropy_sum(logits, labels), total, g)
        if block is not None:
            row, col = _ring_retrieval(q, k, n, 1 / t, g, rows, m, bool(symmetric), block)
        else:
            row, col = _dense_retrieval(q, k, n, 1 / t, g, rows, m, bool(symmetric))
        positive = (q * k).sum(1) / t  # [B_l]: s <q_i, k_i>, the label of both directions
        if col is None:
            terms = row - positive
        elif joint:  # one softmax over q_i's candidates and k_i's queries
            terms = torch.logaddexp(row, col) - positive
        else:  # the mean of the two directions' cross-entropies
            terms = (row + col) / 2 - positive
        return global_mean(terms.sum(), sum(rows), g)


def _dense_retrieval(
    q: Tensor,
    k: Tensor,
    n: Tensor | None,
    scale: Tensor,
    g: Group,
    rows: tuple[int, ...],
    m: int,
    symmetric: bool,
) -> tuple[Tensor, Tensor | None]:
    """Each query's logsumexp over every candidate ([B_l]) and, ``symmetric``, each key's over
    every query ([B_l], else None), from this rank's rows of the global logits.

    The candidate columns: the B keys in rank order (query i of rank r at column
    ``offset_r + i``), then the B m negatives in rank order, row i's m together. Keys and
    negatives are gathered separately so the keys' columns are exactly the first B (one gather
    of each rank's keys and negatives together would interleave them per rank:
    docs/losses.md, "Hard negatives"). The keys' terms against every query are the columns of
    the same ``[B_l, B]`` block, combined over the ranks as CLIP's are (``_column_logsumexp``).
    """
    keys = k if g.size == 1 else apply_all_gather(k, g, rows, 0)  # [B, D]
    logits = (scale * q) @ keys.T  # [B_l, B]; query i's key at column offset + i
    col = None
    if symmetric:
        row, partial = _RowsAndColumns.apply(logits)  # type: ignore[no-untyped-call]
        every, _ = _column_logsumexp(partial, partial.new_zeros(()), g)  # [B]
        offset = first_row(rows, g.rank)
        col = every.narrow(0, offset, q.shape[0])
    else:
        row = logits.logsumexp(1)
    if n is not None:
        negs = n if g.size == 1 else apply_all_gather(n, g, tuple(r * m for r in rows), 0)
        row = torch.logaddexp(row, ((scale * q) @ negs.T).logsumexp(1))  # [B_l, B m] logits
    return row, col


def _ring_retrieval(
    q: Tensor,
    k: Tensor,
    n: Tensor | None,
    scale: Tensor,
    g: Group,
    rows: tuple[int, ...],
    m: int,
    symmetric: bool,
    block: int,
) -> tuple[Tensor, Tensor | None]:
    """``_dense_retrieval`` with the candidates on rings: one direction, the keys and the
    negatives travel together (the logsumexp is the same in any column order); both, CLIP's
    ring (the keys, with their column logsumexps over every query) and, with negatives, a
    second ring of the negatives. The same 4 matmuls of B_l x D x B (1 + m) either way."""
    zero = scale.new_zeros(())
    if not symmetric:
        assert n is not None
        candidates = torch.cat([k, n])  # [B_l (1 + m), D]
        sent = tuple(r * (1 + m) for r in rows)
        return ring_reduce(q, candidates, scale, zero, sent, g, kind="lse", block=block), None
    row, col = ring_clip(q, k, scale, rows, g, block=block)
    if n is not None:
        negs = ring_reduce(
            q, n, scale, zero, tuple(r * m for r in rows), g, kind="lse", block=block
        )
        row = torch.logaddexp(row, negs)
    return row, col


def clip_loss(
    image: Tensor,
    text: Tensor,
    logit_scale: Scalar = 1 / 0.07,
    *,
    normalize: bool = True,
    group: GroupLike = None,
    sizes: Sequence[int] | None = None,
    block_size: BlockSize = None,
) -> Tensor:
    """CLIP's symmetric InfoNCE: images against all texts and texts against all images.

    ``L = (1/2B) sum_i [CE(s <x_i, Y>, i) + CE(s <y_i, X>, i)]`` with cosine similarities and
    ``s = logit_scale`` (pass ``log_scale.exp()`` for CLIP's learnable log-scale). The
    arguments sit where open_clip's ``ClipLoss()(image_features, text_features, logit_scale)``
    has them; ``normalize=False`` takes features the model already L2-normalised as given.

    One logits product per rank: ``S_r = s X_r Y^T`` ([B_l, B]) holds this rank's images
    against every text. Its rows give the images' logsumexps; its columns, combined over the
    ranks, give the texts' (``_column_logsumexp``), so only the texts are gathered.

    Communication: forward 1 all_gather of the texts [B_l, D] and 1 of [B + 1] (each rank's
    column logsumexps over its images, and its part of the value: no scalar all_reduce);
    backward 1 reduce-scatter of [B, D] and 1 of [W, B + 1]. Memory: one [B_l, B] logits
    block (saved for backward). Compute: 3 matmuls of B_l x D x B (one forward, two backward).

    Args:
        image: this rank's image embeddings, [B_l, D].
        text: this rank's text embeddings, [B_l, D]; row i pairs with ``image[i]``.
        logit_scale: the scale ``s`` of the cosine similarities, a number or a tensor that requires
            grad.
        normalize: L2-normalise the embeddings first (``False``: take them as given).
        group: the process group (default: the default group) or a DeviceMesh dimension.
        sizes: every rank's row count, the same list on every rank (``[B_l] * world_size``); given,
            the loss sends nothing but the embeddings and the value.
        block_size: ``None`` the dense path; an int the ring path, which never holds more than
            ``[B_l, block_size]`` logits per rank; ``"auto"`` the dense path unless its logits
            would be too large.

    Returns:
        The global batch's mean loss, a scalar, the same on every rank.

    Raises:
        CollectiveArgumentError: an invalid argument on some rank (``image`` and ``text`` of
            different shapes, ``sizes`` that are not every rank's row count, a ``block_size`` that
            is not positive); raised on every rank of the group.
        CollectiveMismatchError: the ranks' embeddings do not fit together (another dim or dtype),
            found while the group's first calls are checked and in debug mode.
        torch.distributed.DistBackendError: a peer died or never came (docs/faults.md).

    Example:
        >>> g = torch.Generator().manual_seed(0)
        >>> image, text = torch.randn(2, 8, 16, dtype=torch.float64, generator=g)
        >>> round(dg.losses.clip_loss(image, text).item(), 4)  # one process, the whole batch
        5.0409
        >>> dg.testing.check_against_single_process(  # 4 ranks of 2 rows, simulated here
        ...     dg.losses.clip_loss, {"image": image, "text": text}, world_size=4, simulate=True
        ... ).ok  # the same value and gradients
        True
    """
    call = CLIP_LOSS.bind(
        group, text, image=image, block_size=block_size, logit_scale=logit_scale, sizes=sizes
    )
    g, rows = call.group, batch_sizes(call, text)
    with _float32(text):
        x, y = _unit(image, normalize), _unit(text, normalize)
        s = _scalar(logit_scale, x)
        block = choose_block(block_size, rows, x)
        if block is not None:
            return _ring_clip(x, y, s, g, rows, block)
        all_y = y if g.size == 1 else apply_all_gather(y, g, rows, 0)  # [B, D]: the texts
        offset, total = first_row(rows, g.rank), sum(rows)
        logits = (s * x) @ all_y.T  # [B_l, B]; pair i at column offset + i
        # pair i's logit, from the gathered texts: a view, so nothing more is saved for backward
        positive = s * (x * all_y.narrow(0, offset, x.shape[0])).sum(1)  # [B_l]
        per_image, partial = _RowsAndColumns.apply(logits)  # type: ignore[no-untyped-call]
        rest = per_image.sum() / 2 - positive.sum()  # this rank's terms but its texts'
        col, rests = _column_logsumexp(partial, rest, g)  # logsumexps
        local = rest + col.narrow(0, offset, x.shape[0]).sum() / 2
        return global_mean_of(local, rests + col.detach().sum() / 2, total, g)


class _RowsAndColumns(torch.autograd.Function):
    """The logsumexp of every row ([n]) and every column ([m]) of ``logits`` [n, m].

    One node instead of two ``logsumexp`` calls, for a backward that makes two [n, m]
    temporaries instead of seven: ``exp(l - row) * g_row + exp(l - col) * g_col`` in place.
    (Measured on one CPU thread, [2048, 4096] logits of dim 512: forward+backward of CLIP's
    dense loss 1.49 s against 2.16 s with two ``logsumexp`` calls; its 3 matmuls alone take
    0.94 s.) Under ``create_graph`` the backward is the same formula out of place, so the
    loss stays twice differentiable.
    """

    @staticmethod
    def forward(ctx: FunctionCtx, logits: Tensor) -> tuple[Tensor, Tensor]:  # type: ignore[override]
        row, col = logits.logsumexp(1), logits.logsumexp(0)  # col: -inf where n = 0
        ctx.save_for_backward(logits, row, col)
        return row, col

    @staticmethod
    def backward(ctx: Any, g_row: Tensor, g_col: Tensor) -> Tensor:
        saved: tuple[Tensor, ...] = ctx.saved_tensors
        logits, row, col = saved
        if torch.is_grad_enabled():  # create_graph: differentiable ops only
            by_row = (logits - row.unsqueeze(1)).exp() * g_row.unsqueeze(1)
            return by_row + (logits - col.unsqueeze(0)).exp() * g_col.unsqueeze(0)
        grad = torch.sub(logits, row.unsqueeze(1)).exp_().mul_(g_row.unsqueeze(1))
        by_col = torch.sub(logits, col.unsqueeze(0)).exp_()
        return grad.addcmul_(by_col, g_col.unsqueeze(0))


def _column_logsumexp(partial: Tensor, rest: Tensor, g: Group) -> tuple[Tensor, Tensor]:
    """[B]: the logsumexp of every column of the global ``[B, B]`` logits, from this rank's
    ``partial`` logsumexps of its ``[B_l, B]`` rows' columns: every rank's, gathered
    ([W, B]) and combined. Differentiable (the gather's backward is a reduce-scatter), so
    each rank's rows get the gradient of every rank's column terms, and twice differentiable.

    The same message carries each rank's ``rest`` (its terms of the loss other than its texts'
    logsumexps, detached): their sum, also returned, and the columns give the global value
    with no all_reduce of its own."""
    if g.size == 1:
        return partial, rest.detach()
    sent = torch.cat([partial, rest.detach().reshape(1)])[None]  # [1, B + 1]
    gathered = apply_all_gather(sent, g, (1,) * g.size, 0)  # [W, B + 1]
    return gathered[:, :-1].logsumexp(0), gathered[:, -1].detach().sum()


def nt_xent(
    view1: Tensor,
    view2: Tensor,
    *,
    temperature: Scalar = 0.5,
    normalize: bool = True,
    group: GroupLike = None,
    sizes: Sequence[int] | None = None,
    block_size: BlockSize = None,
) -> Tensor:
    """SimCLR's NT-Xent: 2B anchors (both views); each anchor's positive is the other view of
    its sample; its negatives are the other 2B - 2 embeddings of the global batch.

    ``L = -(1/2B) sum_a log [exp(<z_a, z_p(a)>/t) / sum_{c != a} exp(<z_a, z_c>/t)]`` over
    cosine similarities (``normalize=False``: the embeddings as given).

    Communication: forward 2 all_gathers of [B_l, D] and a scalar all_reduce; backward 2
    reduce-scatters of [B, D]. Memory: [2 B_l, 2 B].

    Args:
        view1: this rank's embeddings of the first view, [B_l, D].
        view2: this rank's embeddings of the second view, [B_l, D]; row i is ``view1[i]``'s
            positive.
        temperature: a number or a tensor that requires grad; finite and positive.
        normalize: L2-normalise the embeddings first (``False``: take them as given).
        group: the process group (default: the default group) or a DeviceMesh dimension.
        sizes: every rank's row count, the same list on every rank (``[B_l] * world_size``); given,
            the loss sends nothing but the embeddings and the value.
        block_size: ``None`` the dense path; an int the ring path, which never holds more than
            ``[B_l, block_size]`` logits per rank; ``"auto"`` the dense path unless its logits
            would be too large.

    Returns:
        The global batch's mean loss over its 2B anchors, a scalar, the same on every rank.

    Raises:
        CollectiveArgumentError: an invalid argument on some rank (views of different shapes, a
            temperature that is not finite and positive, ``sizes`` that are not every rank's row
            count, a ``block_size`` that is not positive); raised on every rank of the group.
        CollectiveMismatchError: the ranks' embeddings do not fit together (another dim or dtype),
            found while the group's first calls are checked and in debug mode.
        torch.distributed.DistBackendError: a peer died or never came (docs/faults.md).

    Example:
        >>> g = torch.Generator().manual_seed(0)
        >>> view1, view2 = torch.randn(2, 8, 16, dtype=torch.float64, generator=g)
        >>> round(dg.losses.nt_xent(view1, view2).item(), 4)  # one process, the whole batch
        2.8517
        >>> dg.testing.check_against_single_process(  # 4 ranks of 2 rows, simulated here
        ...     dg.losses.nt_xent, {"view1": view1, "view2": view2}, world_size=4, simulate=True
        ... ).ok  # the same value and gradients
        True
    """
    call = NT_XENT.bind(
        group, view2, view1=view1, block_size=block_size, temperature=temperature, sizes=sizes
    )
    g, rows = call.group, batch_sizes(call, view2)
    with _float32(view2):
        z1, z2 = _unit(view1, normalize), _unit(view2, normalize)
        t = _scalar(temperature, z1)
        block = choose_block(block_size, rows, z1, factor=2)
        if block is not None:
            return _ring_nt_xent(z1, z2, 1 / t, g, rows, block)
        first, second = apply_all_gather(z1, g, rows, 0), apply_all_gather(z2, g, rows, 0)
        offset, total = first_row(rows, g.rank), sum(rows)  # first, second: [B, D] each
        candidates = torch.cat([first, second])  # [2B, D]: every first view, then every second
        anchors = torch.cat([z1, z2])  # [2 B_l, D]
        logits = anchors @ candidates.T / t  # [2 B_l, 2B]
        mine = torch.arange(z1.shape[0], device=z1.device) + offset
        own = torch.cat([mine, mine + total])
        positive = torch.cat([mine + total, mine])
        logits = logits.masked_fill(F.one_hot(own, 2 * total).bool(), float("-inf"))
        return global_mean(_cross_entropy_sum(logits, positive), 2 * total, g)


@renamed(scale="logit_scale", bias="logit_bias")
def siglip_loss(
    image: Tensor,
    text: Tensor,
    logit_scale: Scalar = 10.0,
    logit_bias: Scalar = -10.0,
    *,
    normalize: bool = True,
    group: GroupLike = None,
    sizes: Sequence[int] | None = None,
    block_size: BlockSize = None,
) -> Tensor:
    """SigLIP: a binary decision for every (image, text) pair of the global batch.

    ``L = -(1/B) sum_i sum_j log sigmoid(z_ij (logit_scale <x_i, y_j> + logit_bias))`` with
    ``z_ij = 1`` for matching pairs and -1 otherwise, cosine similarities (``normalize=False``:
    the features as given). ``logit_scale`` and ``logit_bias`` may be tensors that require grad
    (pass ``t.exp()`` for a learnable log-scale); they sit where open_clip's
    ``SigLipLoss()(image_features, text_features, logit_scale, logit_bias)`` has them. The
    keywords ``scale=`` and ``bias=`` of earlier releases still work and warn (FutureWarning).

    Communication: forward 1 all_gather of the texts [B_l, D] and a scalar all_reduce;
    backward 1 reduce-scatter. Memory: one [B_l, B] logits block. Compute: 3 matmuls of
    B_l x D x B.

    Args:
        image: this rank's image embeddings, [B_l, D].
        text: this rank's text embeddings, [B_l, D]; row i pairs with ``image[i]``.
        logit_scale: the scale of the cosine similarities, a number or a tensor that requires grad.
        logit_bias: the bias added to every logit, a number or a tensor that requires grad.
        normalize: L2-normalise the embeddings first (``False``: take them as given).
        group: the process group (default: the default group) or a DeviceMesh dimension.
        sizes: every rank's row count, the same list on every rank (``[B_l] * world_size``); given,
            the loss sends nothing but the embeddings and the value.
        block_size: ``None`` the dense path; an int the ring path, which never holds more than
            ``[B_l, block_size]`` logits per rank; ``"auto"`` the dense path unless its logits
            would be too large.

    Returns:
        The global batch's loss, a scalar, the same on every rank.

    Raises:
        CollectiveArgumentError: an invalid argument on some rank (``image`` and ``text`` of
            different shapes, ``sizes`` that are not every rank's row count, a ``block_size`` that
            is not positive); raised on every rank of the group.
        CollectiveMismatchError: the ranks' embeddings do not fit together (another dim or dtype),
            found while the group's first calls are checked and in debug mode.
        torch.distributed.DistBackendError: a peer died or never came (docs/faults.md).

    Example:
        >>> g = torch.Generator().manual_seed(0)
        >>> image, text = torch.randn(2, 8, 16, dtype=torch.float64, generator=g)
        >>> round(dg.losses.siglip_loss(image, text).item(), 4)  # one process, the whole batch
        10.1753
        >>> dg.testing.check_against_single_process(  # 4 ranks of 2 rows, simulated here
        ...     dg.losses.siglip_loss, {"image": image, "text": text}, world_size=4, simulate=True
        ... ).ok  # the same value and gradients
        True
    """
    call = SIGLIP_LOSS.bind(
        group, text, image=image, block_size=block_size, logit_scale=logit_scale, sizes=sizes
    )
    g, rows = call.group, batch_sizes(call, text)
    with _float32(text):
        x, y = _unit(image, normalize), _unit(text, normalize)
        s, b = _scalar(logit_scale, x), _scalar(logit_bias, x)
        block = choose_block(block_size, rows, x)
        if block is not None:
            return _ring_siglip(x, y, s, b, g, rows, block)
        all_y = apply_all_gather(y, g, rows, 0)  # [B, D]
        logits = torch.addmm(b, s * x, all_y.T)  # [B_l, B]
        # Every pair counted as a negative, then each positive corrected, as the ring does:
        # -log sigmoid(l) = softplus(l) - l. No sign matrix, and softplus saves only the
        # logits for backward (-logsigmoid(signs * logits) saved the signs, their product and
        # a buffer: three [B_l, B] tensors).
        positive = s * (x * y).sum(1) + b  # [B_l]: l_ii, from the local texts
        return global_mean(F.softplus(logits).sum() - positive.sum(), sum(rows), g)


# The memory-efficient paths: the same losses through distgrad.losses._blockwise, which never
# holds more than [block_size, block_size] logits per tile. Each returns the same value and
# gradients as the dense path (tests/losses/test_blockwise.py).


def _ring_info_nce(
    q: Tensor, k: Tensor, scale: Tensor, g: Group, rows: tuple[int, ...], block: int
) -> Tensor:
    """``(1/B) sum_i [logsumexp_j s <q_i, k_j> - s <q_i, k_i>]`` with the keys on a ring."""
    lse = ring_reduce(q, k, scale, scale.new_zeros(()), rows, g, kind="lse", block=block)
    positive = scale * (q * k).sum(1)  # [B_l]: the positive of row i is the local key i
    return global_mean((lse - positive).sum(), sum(rows), g)


def _ring_clip(
    x: Tensor, y: Tensor, scale: Tensor, g: Group, rows: tuple[int, ...], block: int
) -> Tensor:
    """Both directions from one ring pass: image i's logsumexp over all texts, text j's over
    all images (the columns of the same logits blocks)."""
    per_image, per_text = ring_clip(x, y, scale, rows, g, block=block)
    positive = scale * (x * y).sum(1)  # [B_l]: pair i's logit, in both directions
    local = ((per_image - positive).sum() + (per_text - positive).sum()) / 2
    return global_mean(local, sum(rows), g)


def _ring_nt_xent(
    z1: Tensor, z2: Tensor, scale: Tensor, g: Group, rows: tuple[int, ...], block: int
) -> Tensor:
    """Anchors and keys are both ``[z1; z2]``; the ring leaves out each anchor's own column."""
    both = torch.cat([z1, z2])  # [2 B_l, D]
    both_rows = tuple(2 * r for r in rows)
    zero = scale.new_zeros(())
    lse = ring_reduce(
        both, both, scale, zero, both_rows, g, kind="lse", block=block, mask_self=True
    )
    positive = scale * (both * torch.cat([z2, z1])).sum(1)
    return global_mean((lse - positive).sum(), sum(both_rows), g)


def _ring_siglip(
    x: Tensor, y: Tensor, scale: Tensor, bias: Tensor, g: Group, rows: tuple[int, ...], block: int
) -> Tensor:
    """Every pair counted as a negative, ``softplus(l_ij)``, then each positive corrected:
    ``-log sigmoid(l) = softplus(-l) = softplus(l) - l``."""
    negatives = ring_reduce(x, y, scale, bias, rows, g, kind="softplus", block=block)
    positive = scale * (x * y).sum(1) + bias  # [B_l]: l_ii
    return global_mean((negatives - positive).sum(), sum(rows), g)
