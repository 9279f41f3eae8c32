"""Mixture-of-experts dispatch and combine over an expert-parallel group.

Legend: ``N`` ranks; ``E`` experts in all, ``E_r`` of them on rank r (global expert ids are
numbered rank by rank: rank 0 holds experts ``0..E_0-1``, and so on); ``T_r`` tokens on rank
r; ``k`` experts chosen per token; an *assignment* is one (token, choice) pair; ``A_r`` the
assignments rank r keeps and sends; ``R_r`` the rows rank r receives for its experts.

A step is three calls::

    routing = route(logits, k=2, capacity=8)            # [T_r, E] router logits -> decision
    rows = dispatch(x, routing)                         # [R_r, D], grouped by local expert
    outs = [experts[e](part) for e, part in zip(routing.local_experts,
                                                rows.split(routing.expert_sizes))]
    y = combine(torch.cat(outs), routing)               # [T_r, D_out]

The decision is the same whether the batch sits on one process or is sharded in rank order,
so the distributed layer equals the single-process one: an expert with ``capacity`` keeps the
first ``capacity`` assignments of the *global* batch, in token order (a token's second choice
can take a place before a later token's first) or, with ``order="choice"``, GShard's order
(every first choice before any second), which takes one small exchange of every rank's
per-expert counts. A decision made elsewhere (``route(experts=..., weights=...)``) goes
through the same capacity rule, or keeps what its ``kept`` mask says.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Literal

import torch
import torch.nn.functional as F
from torch import Tensor

from distgrad._exchange.group import Group, ProcessGroup
from distgrad._mesh import GroupLike
from distgrad.collectives._bound import Bound
from distgrad.collectives.all_gather import all_gather
from distgrad.collectives.all_to_all import all_to_all
from distgrad.parallel._checks import COMBINE, DISPATCH, ROUTE, as_process_group

__all__ = ["Routing", "combine", "dispatch", "route"]


@dataclass(frozen=True)
class Routing:
    """One step's routing decision on this rank, made by :func:`route`.

    Only ``weights`` carries gradient (to the router's logits); everything else is integer
    bookkeeping, computed once and used by both :func:`dispatch` and :func:`combine`.

    Attributes:
        group: the expert-parallel group.
        experts: ``[T_r, k]`` the expert each token chose (global ids).
        kept: ``[T_r, k]`` whether each choice was kept (False: the expert was full).
        tokens: ``[A_r]`` the token of each kept assignment, in the order they are sent.
        weights: ``[A_r]`` each kept assignment's gate weight, differentiable.
        send_sizes: the assignments sent to each rank.
        recv_sizes: the rows received from each rank.
        by_expert: ``[R_r]`` where each received row goes once grouped by local expert.
        local_experts: this rank's experts (global ids).
        expert_sizes: the rows each local expert receives, in ``local_experts`` order.
        dispatched: what ``dispatch`` returned, so that ``combine`` can tie an empty output to it.

    Example:
        >>> routing = dg.parallel.route(torch.tensor([[2.0, 0.0], [0.0, 3.0]]), k=1)
        >>> routing.local_experts, routing.send_sizes
        (range(0, 2), (2,))
    """

    group: ProcessGroup | None
    #: [T_r, k] the expert each token chose, global ids; [T_r, k] whether the choice was kept
    #: (False: the expert was full; that choice contributes nothing).
    experts: Tensor
    kept: Tensor
    #: [A_r] the token of each kept assignment, in the order they are sent (by expert); its
    #: gate weight, differentiable.
    tokens: Tensor
    weights: Tensor
    send_sizes: tuple[int, ...]  # assignments sent to each rank
    recv_sizes: tuple[int, ...]  # rows received from each rank
    #: [R_r] which received row goes where once grouped by local expert (sources in rank order
    #: within an expert).
    by_expert: Tensor
    #: This rank's experts (global ids) and the rows each receives, in that order.
    local_experts: range
    expert_sizes: tuple[int, ...]
    #: What dispatch returned, so that combine can tie an empty output to it (below).
    dispatched: list[Tensor] = field(default_factory=list, repr=False, compare=False)


Order = Literal["token", "choice"]


def route(
    logits: Tensor | None = None,
    k: int = 1,
    group: GroupLike = None,
    *,
    capacity: int | None = None,
    experts_per_rank: Sequence[int] | None = None,
    normalize: bool = True,
    order: Order = "token",
    experts: Tensor | None = None,
    weights: Tensor | None = None,
    kept: Tensor | None = None,
    num_experts: int | None = None,
) -> Routing:
    """Choose ``k`` experts per token from router ``logits`` ``[T_r, E]`` (this rank's tokens),
    or take a decision made elsewhere (``experts=``).

    Gate weights are the softmax over all ``E`` experts of each token's logits, taken at its
    top ``k`` (renormalised to sum to 1 over the ``k`` when ``normalize``). ``capacity``: the
    most assignments an expert takes from the whole global batch (``None``: no limit); the
    first ones in the global ``order`` are kept, the rest dropped:

    * ``"token"`` (default): every rank's tokens in rank order, each token's choices in order
      (a token's second choice goes ahead of a later token's first);
    * ``"choice"`` (GShard's and DeepSpeed's rule): every token's first choice, in global token
      order, before any second choice, and so on.

    ``experts_per_rank``: ``E_r`` for every rank (default: as even as possible, larger first; a
    rank may hold none). ``logits`` is not modified.

    A decision made by your own router: ``experts`` ``[T_r, k]`` (global expert ids, int64) and
    ``weights`` ``[T_r, k]`` (the gate weights, differentiable; default ones), with
    ``num_experts`` (``E``) and without ``logits``. Either ``capacity`` and ``order`` decide
    what is kept, as above, or ``kept`` ``[T_r, k]`` (bool) says it (then no ``capacity``).

    Gradient: through ``Routing.weights`` only (the choice itself is not differentiable).

    Communication: 1 all_gather of every rank's per-expert counts (``E`` int64 each; ``k E``
    with ``order="choice"``), read on the host: the split sizes change every step.

    Args:
        logits: this rank's router logits ``[T_r, E]``, or None with ``experts=``.
        k: the experts each token chooses.
        group: the tensor- or sequence-parallel group (default: the default group) or a DeviceMesh
            dimension.
        capacity: the most assignments an expert takes from the global batch (None: no limit).
        experts_per_rank: every rank's expert count (default: as even as possible).
        normalize: renormalise each token's ``k`` gate weights to sum to 1.
        order: ``"token"`` or ``"choice"``: which assignments a full expert keeps.
        experts: a decision made elsewhere, ``[T_r, k]`` global expert ids (int64).
        weights: with ``experts``, the gate weights ``[T_r, k]`` (default ones).
        kept: with ``experts``, ``[T_r, k]`` bools saying which choices are kept.
        num_experts: with ``experts``, the number of experts ``E``.

    Returns:
        A ``Routing``: what ``dispatch`` and ``combine`` need.

    Raises:
        CollectiveArgumentError: ``k`` not between 1 and the experts, ``logits`` and ``experts``
            both or neither given, an unknown ``order``; raised on every rank of the group.
        torch.distributed.DistBackendError: a peer died or never came (docs/faults.md).

    Example:
        >>> logits = torch.tensor([[2.0, 0.0], [0.0, 3.0], [1.0, 0.5]])  # 3 tokens, 2 experts
        >>> routing = dg.parallel.route(logits, k=1)
        >>> routing.experts.flatten().tolist(), routing.expert_sizes
        ([0, 1, 0], (2, 1))
    """
    call = ROUTE.bind(
        group,
        None,
        order=order,
        capacity=capacity,
        logits=logits,
        experts=experts,
        weights=weights,
        kept=kept,
        num_experts=num_experts,
        k=k,
        experts_per_rank=experts_per_rank,
    )
    g, num_experts, split = call.group, call["num_experts"], list(call["experts_per_rank"])
    if experts is None:
        assert logits is not None
        top_e, top_w = _top_k(logits, k, normalize)
    else:
        top_e, top_w = _given(call, experts, weights, num_experts)
    group = as_process_group(group, "route")
    hits = F.one_hot(top_e, num_experts)  # [T_r, k, E]
    if kept is not None:
        counts = (hits * kept[..., None]).sum((0, 1))  # [E] kept assignments per expert
        kept_table = all_gather(counts[None], group, sizes=[1] * g.size).cpu()  # [N, E]
        kept = kept.clone()
    elif order == "token":
        kept, kept_table = _token_order(g, group, top_e, hits, capacity)
    else:
        kept, kept_table = _choice_order(g, group, top_e, hits, capacity)
    flat = top_e.reshape(-1)  # [T_r k]: token-major, then choice
    chosen = torch.nonzero(kept.reshape(-1)).squeeze(1)
    sent = chosen[torch.argsort(flat[chosen], stable=True)]  # kept, grouped by expert
    return _plan(g, group, split, top_e, kept, sent, top_w, kept_table)


def _top_k(logits: Tensor, k: int, normalize: bool) -> tuple[Tensor, Tensor]:
    gates = torch.softmax(logits, dim=-1)
    top_w, top_e = gates.topk(k, dim=-1)  # [T_r, k]
    if normalize:
        top_w = top_w / top_w.sum(-1, keepdim=True)
    return top_e, top_w


def _given(
    call: Bound, experts: Tensor, weights: Tensor | None, num_experts: int
) -> tuple[Tensor, Tensor]:
    # The ids themselves are data: read on every call (a host synchronisation), past the door.
    if experts.numel() and not bool(((experts >= 0) & (experts < num_experts)).all()):
        raise call.error(f"experts must be expert ids in [0, {num_experts}), got {experts}")
    if weights is None:
        weights = torch.ones(tuple(experts.shape), device=experts.device)
    return experts.long(), weights


def _token_order(
    g: Group, group: ProcessGroup | None, top_e: Tensor, hits: Tensor, capacity: int | None
) -> tuple[Tensor, Tensor]:
    """Capacity in token-major global order; (kept [T_r, k], kept table [N, E])."""
    flat = top_e.reshape(-1)
    flat_hits = hits.reshape(-1, hits.shape[-1])  # [T_r k, E]
    counts = flat_hits.sum(0)  # [E] assignments per expert on this rank
    # table[s, e]: rank s's assignments to expert e; one exchange gives every rank the sizes.
    table = all_gather(counts[None], group, sizes=[1] * g.size).cpu()  # [N, E]
    before = table.cumsum(0) - table  # [N, E]: assignments from earlier ranks
    limit = int(table.sum()) if capacity is None else capacity
    kept_table = (limit - before).clamp(0, None).minimum(table)  # [N, E]
    place = (flat_hits.cumsum(0) - 1).gather(1, flat[:, None]).squeeze(1)  # among this rank's
    place = place + before[g.rank].to(flat.device)[flat]  # ... and in the global order
    return (place < limit).view_as(top_e), kept_table


def _choice_order(
    g: Group, group: ProcessGroup | None, top_e: Tensor, hits: Tensor, capacity: int | None
) -> tuple[Tensor, Tensor]:
    """Capacity in choice-major global order (GShard): every first choice of the global batch,
    in token order, before any second choice; (kept [T_r, k], kept table [N, E])."""
    k, num_experts = hits.shape[1], hits.shape[2]
    counts = hits.sum(0)  # [k, E]: this rank's assignments per choice and expert
    table = all_gather(counts.reshape(1, -1), group, sizes=[1] * g.size).cpu()
    blocks = table.view(g.size, k, num_experts).transpose(0, 1)  # [k, N, E], global order
    flat_blocks = blocks.reshape(k * g.size, num_experts)
    start = (flat_blocks.cumsum(0) - flat_blocks).view(k, g.size, num_experts)
    limit = int(table.sum()) if capacity is None else capacity
    kept_table = (limit - start).clamp(0, None).minimum(blocks).sum(0)  # [N, E]
    local = (hits.cumsum(0) - 1).gather(2, top_e[..., None]).squeeze(2)  # [T_r, k]
    mine = start[:, g.rank, :].to(top_e.device)  # [k, E]
    place = local + mine.gather(1, top_e.T.contiguous()).T
    return place < limit, kept_table


def _plan(
    g: Group,
    group: ProcessGroup | None,
    split: list[int],
    top_e: Tensor,
    kept: Tensor,
    order: Tensor,
    top_w: Tensor,
    kept_table: Tensor,
) -> Routing:
    """Sizes and orders from the kept-assignment table ``kept_table`` [N, E]."""
    k = top_e.shape[1]
    first = [sum(split[:r]) for r in range(g.size + 1)]
    per_rank = torch.stack(
        [kept_table[:, first[r] : first[r + 1]].sum(1) for r in range(g.size)], 1
    )  # [N source, N destination]
    mine = kept_table[:, first[g.rank] : first[g.rank + 1]]  # [N source, E_r]
    # Received rows come source by source, each source's rows by expert; regroup by expert
    # (stable: a segment's rows keep their order).
    sources, experts = mine.shape
    segment = torch.repeat_interleave(torch.arange(sources * experts), mine.reshape(-1))
    source, expert = segment // max(experts, 1), segment % max(experts, 1)
    by_expert = torch.argsort(expert * sources + source, stable=True)
    return Routing(
        group=group,
        experts=top_e,
        kept=kept,
        tokens=(order // k),
        weights=top_w.reshape(-1)[order],
        send_sizes=tuple(int(n) for n in per_rank[g.rank].tolist()),
        recv_sizes=tuple(int(n) for n in per_rank[:, g.rank].tolist()),
        by_expert=by_expert.to(top_e.device),
        local_experts=range(first[g.rank], first[g.rank + 1]),
        expert_sizes=tuple(int(n) for n in mine.sum(0).tolist()),
    )


def dispatch(x: Tensor, routing: Routing) -> Tensor:
    """Send each kept assignment's token row to the rank of its expert.

    ``x`` is this rank's ``[T_r, D]`` tokens; returns ``[R_r, D]``, the rows for this rank's
    experts grouped by expert (``routing.expert_sizes`` rows each, in
    ``routing.local_experts`` order; within an expert, source ranks in order). A token chosen
    by two experts is sent twice; a dropped choice is not sent. ``x`` is not modified.

    Gradient: each received row's gradient goes back to its source token; a token's gradients
    from its several experts add up.

    Communication: forward 1 all_to_all of [A_r, D] with the routing's sizes (no size
    exchange); backward 1 all_to_all of [R_r, D].

    Args:
        x: this rank's ``[T_r, D]`` tokens; not modified.
        routing: the step's ``Routing``, from ``route``.

    Returns:
        ``[R_r, D]``: the rows for this rank's experts, grouped by expert.

    Raises:
        torch.distributed.DistBackendError: a peer died or never came (docs/faults.md). ``x``
            is not checked against the routing: pass the tokens ``route`` saw.

    Example:
        >>> logits = torch.tensor([[2.0, 0.0], [0.0, 3.0], [1.0, 0.5]])
        >>> routing = dg.parallel.route(logits, k=1)
        >>> dg.parallel.dispatch(torch.tensor([[10.0], [20.0], [30.0]]), routing)
        tensor([[10.],
                [30.],
                [20.]])
    """
    DISPATCH.bind(routing.group, x)
    rows = x.index_select(0, routing.tokens)  # [A_r, D], by destination expert
    got = all_to_all(
        rows, routing.group, input_sizes=routing.send_sizes, output_sizes=routing.recv_sizes
    )
    rows = got.index_select(0, routing.by_expert)
    routing.dispatched[:] = [rows]
    return rows


def combine(y: Tensor, routing: Routing) -> Tensor:
    """Bring the experts' outputs home and add them up per token, weighted by the gates.

    ``y`` is ``[R_r, D_out]``, the outputs for the rows :func:`dispatch` returned, in the same
    order (a rank that holds no experts passes an empty ``[0, D_out]`` tensor). Returns
    ``[T_r, D_out]``: for each token, the sum over its kept choices of gate
    weight times expert output (zeros for a token whose every choice was dropped). ``y`` is
    not modified.

    Gradient: to ``y`` (each expert output's gradient goes back to the expert's rank) and to
    ``routing.weights`` (and through it to the router's logits).

    Communication: forward 1 all_to_all of [R_r, D_out]; backward 1 all_to_all of
    [A_r, D_out].

    Args:
        y: the experts' outputs ``[R_r, D_out]`` for the rows ``dispatch`` returned, in order.
        routing: the step's ``Routing``, from ``route``.

    Returns:
        ``[T_r, D_out]``: for each token, its experts' outputs weighted by the gates.

    Raises:
        CollectiveArgumentError: ``y`` whose row count is not what ``dispatch`` returned; raised on
            every rank of the group.
        torch.distributed.DistBackendError: a peer died or never came (docs/faults.md).

    Example:
        >>> logits = torch.tensor([[2.0, 0.0], [0.0, 3.0], [1.0, 0.5]])
        >>> routing = dg.parallel.route(logits, k=1)  # normalised: every gate weight is 1
        >>> rows = dg.parallel.dispatch(torch.tensor([[10.0], [20.0], [30.0]]), routing)
        >>> dg.parallel.combine(2 * rows, routing)  # each token's expert output, home again
        tensor([[20.],
                [40.],
                [60.]])
    """
    COMBINE.bind(routing.group, y, routing=routing)
    if y.shape[0] == 0 and routing.dispatched:
        # No rows here (a rank that holds no experts, or whose experts got no tokens): an
        # empty y made from scratch would leave dispatch's output out of the loss, so this
        # rank would skip dispatch's backward all_to_all, which its peers run. Tie it in.
        y = y + routing.dispatched[0].sum().to(y.dtype)
    if not y.requires_grad and torch.is_grad_enabled() and routing.weights.requires_grad:
        # Every rank's all_to_all input must require grad, or none's.
        y = y.detach().requires_grad_(True)
    by_source = torch.empty_like(routing.by_expert)
    by_source[routing.by_expert] = torch.arange(len(by_source), device=by_source.device)
    back = all_to_all(
        y.index_select(0, by_source),
        routing.group,
        input_sizes=routing.recv_sizes,
        output_sizes=routing.send_sizes,
    )  # [A_r, D_out], in the order dispatch sent them
    out = back.new_zeros((routing.kept.shape[0], *back.shape[1:]))
    weighted = back * routing.weights.to(back.dtype).view(-1, *[1] * (back.dim() - 1))
    return out.index_add(0, routing.tokens, weighted)
