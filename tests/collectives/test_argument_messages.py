"""Every op's bad-argument messages read alike, because each comes from the argument's declared
field (``distgrad.collectives._fields``), not from the op.

Semantics asserted, for every argument of every op, in a real call on 2 gloo ranks (a first
call on a fresh group, so checked across ranks): every rank raises, and its message

* starts with the call as that rank made it, named by the same rule for every op: the op's
  name and its shown arguments in declared order, ``op`` by its name even when passed as a
  ``dist.ReduceOp`` (``reduce(dst=0, op='sum')``), then ``on rank <r>:``;
* for an argument this rank can check alone: ``invalid arguments; rank <b>: <argument> must
  <what is expected>, got <what was passed>``, naming the rank that passed it;
* for an argument the ranks must pass alike: ``ranks disagree on <argument> (<each rank's
  value>); every rank must pass the same <argument>``;
* for an argument checked against the other ranks' (a size one rank sends and another
  expects), the argument's name and the ranks involved.

A last test checks that the tables below name every argument every op declares.
"""

from __future__ import annotations

import re
import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

import distgrad as dg
from distgrad import collectives
from distgrad.collectives._list_fields import Shape
from distgrad.collectives._signature import Signature
from distgrad.errors import CollectiveArgumentError, CollectiveMismatchError
from distgrad.testing import run_on_ranks
from tests.collectives.reference import outcome

Call = Callable[[int, Any], object]  # (rank, group) -> the op's call on that rank

SUM = dist.ReduceOp.SUM


def _rows(n: int) -> torch.Tensor:
    return torch.ones(n, 2)


@dataclass(frozen=True)
class Local:
    """An argument one rank gets wrong: its message, on every rank, is ``sentence``."""

    op: str
    argument: str  # the declared argument
    call: Call
    descs: tuple[str, str]  # how rank 0 and rank 1 name their call
    bad: int  # the rank whose argument is wrong
    sentence: str  # "<argument> must <expected>, got <passed>"


@dataclass(frozen=True)
class Disagree:
    """An argument the ranks pass differently: ``shown`` lists each rank's value."""

    op: str
    argument: str
    call: Call
    descs: tuple[str, str]
    shown: str


@dataclass(frozen=True)
class Relation:
    """An argument checked against the other ranks' arguments: ``says`` is in every message."""

    op: str
    argument: str
    call: Call
    desc: str
    says: str


def _one(rank: int, good: object, bad: object, on: int = 1) -> Any:
    return bad if rank == on else good


LOCAL = [
    Local(
        "all_gather",
        "dim",
        lambda r, g: dg.all_gather(_rows(4), g, dim=_one(r, 0, 5)),
        ("all_gather(dim=0)", "all_gather(dim=5)"),
        1,
        "dim must be in [-2, 2) for a tensor with 2 dims, got 5",
    ),
    Local(
        "all_gather",
        "x",
        lambda r, g: dg.all_gather(_one(r, _rows(1)[0], torch.tensor(1.0)), g),
        ("all_gather(dim=0)", "all_gather(dim=0)"),
        1,
        "x must have at least 1 dim, got a 0-dim tensor",
    ),
    Local(
        "all_gather",
        "objective",
        lambda r, g: dg.all_gather(_rows(4), g, objective=_one(r, "sum", "once")),
        ("all_gather(dim=0)", "all_gather(dim=0)"),
        1,
        "objective must be one of ['replicated', 'sum'], got 'once'",
    ),
    Local(
        "all_gather",
        "sizes",
        lambda r, g: dg.all_gather(_rows(4), g, sizes=_one(r, [4, 4], [4])),
        ("all_gather(dim=0)", "all_gather(dim=0)"),
        1,
        "sizes must be 2 non-negative ints (one per rank), got [4]",
    ),
    Local(
        "all_gather",
        "sizes",
        lambda r, g: dg.all_gather(_rows(4), g, sizes=_one(r, [4, 4], [4, 3])),
        ("all_gather(dim=0)", "all_gather(dim=0)"),
        1,
        "sizes[1] must be 4, the entries of this rank's x along dim 0, got 3",
    ),
    Local(
        "reduce_scatter",
        "op",
        lambda r, g: dg.reduce_scatter(_rows(4), _one(r, SUM, "mean"), g),
        ("reduce_scatter(op='sum', dim=0)", "reduce_scatter(op='mean', dim=0)"),
        1,
        "op must be one of ['avg', 'max', 'min', 'prod', 'sum'] (or their dist.ReduceOp), "
        "got 'mean'",
    ),
    Local(
        "reduce_scatter",
        "dim",
        lambda r, g: dg.reduce_scatter(_rows(4), "sum", g, dim=_one(r, 0, -3)),
        ("reduce_scatter(op='sum', dim=0)", "reduce_scatter(op='sum', dim=-3)"),
        1,
        "dim must be in [-2, 2) for a tensor with 2 dims, got -3",
    ),
    Local(
        "reduce_scatter",
        "sizes",
        lambda r, g: dg.reduce_scatter(_rows(4), group=g, sizes=_one(r, [2, 2], [1, 2])),
        ("reduce_scatter(op='sum', dim=0)", "reduce_scatter(op='sum', dim=0)"),
        1,
        "sizes must add up to 4, the entries of x along dim 0, got [1, 2]",
    ),
    Local(
        "reduce_scatter",
        "sizes",
        lambda r, g: dg.reduce_scatter(_rows(5), group=g),
        ("reduce_scatter(op='sum', dim=0)", "reduce_scatter(op='sum', dim=0)"),
        1,
        "sizes must be given to split x unevenly (x has 5 entries along dim 0, which does not "
        "divide evenly over 2 ranks), got None",
    ),
    Local(
        "all_reduce",
        "op",
        lambda r, g: dg.all_reduce(_rows(2), _one(r, "sum", "mean"), g),
        ("all_reduce(op='sum')", "all_reduce(op='mean')"),
        1,
        "op must be one of ['avg', 'max', 'min', 'prod', 'sum'] (or their dist.ReduceOp), "
        "got 'mean'",
    ),
    Local(
        "all_reduce",
        "op",
        lambda r, g: dg.all_reduce(torch.ones(2, dtype=torch.complex64), "max", g),
        ("all_reduce(op='max')", "all_reduce(op='max')"),
        0,
        "op must be a reduction torch computes on x's dtype, got 'max'",
    ),
    Local(
        "all_reduce",
        "objective",
        lambda r, g: dg.all_reduce(_rows(2), group=g, objective=_one(r, "sum", "once")),
        ("all_reduce(op='sum')", "all_reduce(op='sum')"),
        1,
        "objective must be one of ['replicated', 'sum'], got 'once'",
    ),
    Local(
        "all_to_all",
        "dim",
        lambda r, g: dg.all_to_all(_rows(4), g, dim=_one(r, 0, 2)),
        ("all_to_all(dim=0)", "all_to_all(dim=2)"),
        1,
        "dim must be in [-2, 2) for a tensor with 2 dims, got 2",
    ),
    Local(
        "all_to_all",
        "input_sizes",
        lambda r, g: dg.all_to_all(_rows(4), g, input_sizes=_one(r, [2, 2], [1, 2])),
        ("all_to_all(dim=0)", "all_to_all(dim=0)"),
        1,
        "input_sizes must add up to 4, the entries of x along dim 0, got [1, 2]",
    ),
    Local(
        "all_to_all",
        "output_sizes",
        lambda r, g: dg.all_to_all(_rows(4), g, output_sizes=_one(r, [2, 2], [-1, 5])),
        ("all_to_all(dim=0)", "all_to_all(dim=0)"),
        1,
        "output_sizes must be 2 non-negative ints (one per rank), got [-1, 5]",
    ),
    Local(
        "broadcast",
        "src",
        lambda r, g: dg.broadcast(_rows(2), _one(r, 0, 2), g),
        ("broadcast(src=0)", "broadcast(src=2)"),
        1,
        "src must be a group rank in [0, 2), got 2",
    ),
    Local(
        "broadcast",
        "objective",
        lambda r, g: dg.broadcast(_rows(2), 0, g, objective=_one(r, "sum", "once")),
        ("broadcast(src=0)", "broadcast(src=0)"),
        1,
        "objective must be one of ['replicated', 'sum'], got 'once'",
    ),
    Local(
        "reduce",
        "dst",
        lambda r, g: dg.reduce(_rows(2), _one(r, 0, 2), SUM, g),
        ("reduce(dst=0, op='sum')", "reduce(dst=2, op='sum')"),
        1,
        "dst must be a group rank in [0, 2), got 2",
    ),
    Local(
        "reduce",
        "op",
        lambda r, g: dg.reduce(_rows(2), 0, _one(r, "sum", "mean"), g),
        ("reduce(dst=0, op='sum')", "reduce(dst=0, op='mean')"),
        1,
        "op must be one of ['avg', 'max', 'min', 'prod', 'sum'] (or their dist.ReduceOp), "
        "got 'mean'",
    ),
    Local(
        "gather",
        "dst",
        lambda r, g: dg.gather(_rows(2), _one(r, 0, -1), g),
        ("gather(dst=0, dim=0)", "gather(dst=-1, dim=0)"),
        1,
        "dst must be a group rank in [0, 2), got -1",
    ),
    Local(
        "gather",
        "dim",
        lambda r, g: dg.gather(_rows(2), 0, g, dim=_one(r, 0, 2)),
        ("gather(dst=0, dim=0)", "gather(dst=0, dim=2)"),
        1,
        "dim must be in [-2, 2) for a tensor with 2 dims, got 2",
    ),
    Local(
        "gather",
        "sizes",
        lambda r, g: dg.gather(_rows(2), 0, g, sizes=_one(r, [2, 2], [2, 3])),
        ("gather(dst=0, dim=0)", "gather(dst=0, dim=0)"),
        1,
        "sizes[1] must be 2, the entries of this rank's x along dim 0, got 3",
    ),
    Local(
        "scatter",
        "src",
        lambda r, g: dg.scatter(_rows(4), _one(r, 0, 5), g),
        ("scatter(src=0, dim=0)", "scatter(src=5, dim=0)"),
        1,
        "src must be a group rank in [0, 2), got 5",
    ),
    Local(
        "scatter",
        "dim",
        lambda r, g: dg.scatter(_one(r, _rows(4), None, on=1), 0, g, dim=_one(r, 2, 0)),
        ("scatter(src=0, dim=2)", "scatter(src=0, dim=0)"),
        0,
        "dim must be in [-2, 2) for a tensor with 2 dims, got 2",
    ),
    Local(
        "scatter",
        "x",
        lambda r, g: dg.scatter(None, 0, g),
        ("scatter(src=0, dim=0)", "scatter(src=0, dim=0)"),
        0,
        "x must be the tensor to scatter on the source rank (src=0), got None",
    ),
    Local(
        "scatter",
        "sizes",
        lambda r, g: dg.scatter(_one(r, _rows(4), None), 0, g, sizes=_one(r, [1, 1], None)),
        ("scatter(src=0, dim=0)", "scatter(src=0, dim=0)"),
        0,
        "sizes must add up to 4, the entries of x along dim 0, got [1, 1]",
    ),
    Local(
        "scatter",
        "sizes",
        lambda r, g: dg.scatter(_one(r, _rows(4), _rows(3)), 0, g, sizes=[2, 2]),
        ("scatter(src=0, dim=0)", "scatter(src=0, dim=0)"),
        1,
        "sizes[1] must be 3, the entries of this rank's x along dim 0, got 2",
    ),
    Local(
        "scatter",
        "x",
        lambda r, g: dg.scatter(_one(r, _rows(4), None), 0, g, sizes=[2, 2]),
        ("scatter(src=0, dim=0)", "scatter(src=0, dim=0)"),
        1,
        "x must be a tensor shaped like this rank's part (its dtype and trailing dims, as "
        "torch.distributed.scatter's output tensor) when sizes is given, got None",
    ),
    Local(
        "permute",
        "perm",
        lambda r, g: dg.permute(_rows(2), _one(r, [1, 0], [0, 0]), g),
        ("permute", "permute"),
        1,
        "perm must be a permutation of the group ranks 0..1, got [0, 0]",
    ),
]

DISAGREE = [
    Disagree(
        "all_gather",
        "dim",
        lambda r, g: dg.all_gather(_rows(2), g, dim=r),
        ("all_gather(dim=0)", "all_gather(dim=1)"),
        "rank 0: 0; rank 1: 1",
    ),
    Disagree(
        "all_gather",
        "objective",
        lambda r, g: dg.all_gather(_rows(2), g, objective=_one(r, "sum", "replicated")),
        ("all_gather(dim=0)", "all_gather(dim=0)"),
        "rank 0: sum; rank 1: replicated",
    ),
    Disagree(
        "all_gather",
        "sizes",
        lambda r, g: dg.all_gather(_rows(2), g, sizes=_one(r, [2, 5], [7, 2])),
        ("all_gather(dim=0)", "all_gather(dim=0)"),
        "rank 0: [2, 5]; rank 1: [7, 2]",
    ),
    Disagree(
        "reduce_scatter",
        "op",
        lambda r, g: dg.reduce_scatter(_rows(2), _one(r, SUM, "max"), g),
        ("reduce_scatter(op='sum', dim=0)", "reduce_scatter(op='max', dim=0)"),
        "rank 0: sum; rank 1: max",
    ),
    Disagree(
        "reduce_scatter",
        "dim",
        lambda r, g: dg.reduce_scatter(_rows(2), group=g, dim=r),
        ("reduce_scatter(op='sum', dim=0)", "reduce_scatter(op='sum', dim=1)"),
        "rank 0: 0; rank 1: 1",
    ),
    Disagree(
        "reduce_scatter",
        "sizes",
        lambda r, g: dg.reduce_scatter(_rows(4), group=g, sizes=_one(r, [1, 3], [2, 2])),
        ("reduce_scatter(op='sum', dim=0)", "reduce_scatter(op='sum', dim=0)"),
        "rank 0: [1, 3]; rank 1: [2, 2]",
    ),
    Disagree(
        "all_reduce",
        "op",
        lambda r, g: dg.all_reduce(_rows(2), _one(r, "sum", dist.ReduceOp.MIN), g),
        ("all_reduce(op='sum')", "all_reduce(op='min')"),
        "rank 0: sum; rank 1: min",
    ),
    Disagree(
        "all_reduce",
        "objective",
        lambda r, g: dg.all_reduce(_rows(2), group=g, objective=_one(r, "replicated", "sum")),
        ("all_reduce(op='sum')", "all_reduce(op='sum')"),
        "rank 0: replicated; rank 1: sum",
    ),
    Disagree(
        "all_to_all",
        "dim",
        lambda r, g: dg.all_to_all(torch.ones(2, 2), g, dim=r),
        ("all_to_all(dim=0)", "all_to_all(dim=1)"),
        "rank 0: 0; rank 1: 1",
    ),
    Disagree(
        "broadcast",
        "src",
        lambda r, g: dg.broadcast(_rows(2), r, g),
        ("broadcast(src=0)", "broadcast(src=1)"),
        "rank 0: 0; rank 1: 1",
    ),
    Disagree(
        "broadcast",
        "objective",
        lambda r, g: dg.broadcast(_rows(2), 0, g, objective=_one(r, "sum", "replicated")),
        ("broadcast(src=0)", "broadcast(src=0)"),
        "rank 0: sum; rank 1: replicated",
    ),
    Disagree(
        "reduce",
        "dst",
        lambda r, g: dg.reduce(_rows(2), r, SUM, g),
        ("reduce(dst=0, op='sum')", "reduce(dst=1, op='sum')"),
        "rank 0: 0; rank 1: 1",
    ),
    Disagree(
        "reduce",
        "op",
        lambda r, g: dg.reduce(_rows(2), 0, _one(r, SUM, "prod"), g),
        ("reduce(dst=0, op='sum')", "reduce(dst=0, op='prod')"),
        "rank 0: sum; rank 1: prod",
    ),
    Disagree(
        "gather",
        "dst",
        lambda r, g: dg.gather(_rows(2), r, g),
        ("gather(dst=0, dim=0)", "gather(dst=1, dim=0)"),
        "rank 0: 0; rank 1: 1",
    ),
    Disagree(
        "gather",
        "dim",
        lambda r, g: dg.gather(_rows(2), 0, g, dim=r),
        ("gather(dst=0, dim=0)", "gather(dst=0, dim=1)"),
        "rank 0: 0; rank 1: 1",
    ),
    Disagree(
        "gather",
        "sizes",
        lambda r, g: dg.gather(_rows(2), 0, g, sizes=_one(r, [2, 1], [1, 2])),
        ("gather(dst=0, dim=0)", "gather(dst=0, dim=0)"),
        "rank 0: [2, 1]; rank 1: [1, 2]",
    ),
    Disagree(
        "scatter",
        "src",
        lambda r, g: dg.scatter(_rows(4), r, g),
        ("scatter(src=0, dim=0)", "scatter(src=1, dim=0)"),
        "rank 0: 0; rank 1: 1",
    ),
    Disagree(
        "scatter",
        "dim",
        lambda r, g: dg.scatter(_one(r, torch.ones(2, 2), None), 0, g, dim=r),
        ("scatter(src=0, dim=0)", "scatter(src=0, dim=1)"),
        "rank 0: 0; rank 1: 1",
    ),
    Disagree(
        "permute",
        "perm",
        lambda r, g: dg.permute(_rows(2), _one(r, [0, 1], [1, 0]), g),
        ("permute", "permute"),
        "rank 0: [0, 1]; rank 1: [1, 0]",
    ),
]

RELATION = [
    Relation(
        "all_to_all",
        "output_sizes",
        lambda r, g: dg.all_to_all(_rows(4), g, output_sizes=_one(r, [2, 2], [2, 1])),
        "all_to_all(dim=0)",
        "rank 1 expects 1 entries from rank 1 (output_sizes[1]",
    ),
    Relation(
        "permute",
        "recv_shape",
        lambda r, g: dg.permute(_rows(2), [1, 0], g, recv_shape=_one(r, (2, 2), (3, 2))),
        "permute",
        "rank 1 expects to receive shape (3, 2) (recv_shape), but its source sends (2, 2)",
    ),
    Relation(
        "scatter",
        "sizes",
        lambda r, g: dg.scatter(_one(r, _rows(4), _rows(3)), 0, g, sizes=_one(r, [2, 2], [1, 3])),
        "scatter(src=0, dim=0)",
        "rank 1 passes sizes [1, 3], but the source (rank 0) splits into [2, 2]",
    ),
]


def _make_every_bad_call(rank: int, world_size: int) -> list[tuple[str, str]]:
    seen = []
    for case in [*LOCAL, *DISAGREE, *RELATION]:
        group = dist.new_group([0, 1])  # a first call on it: checked across ranks
        seen.append(outcome(case.call, rank, group))
        # Every rank raised at once: none was left inside a collective.
        assert dg.all_reduce(torch.ones(1)).item() == world_size
    return seen


def test_every_op_names_its_call_its_argument_the_rank_and_what_was_expected() -> None:
    """Every local, agreement and cross-rank argument check of every op, on 2 ranks."""
    per_rank = run_on_ranks(_make_every_bad_call, 2, timeout=60)
    cases = [*LOCAL, *DISAGREE, *RELATION]
    failures = []
    for i, case in enumerate(cases):
        for rank, (kind, message) in enumerate(seen[i] for seen in per_rank):
            if isinstance(case, Local):
                expected = CollectiveArgumentError.__name__
                prefix = f"{case.descs[rank]} on rank {rank}: invalid arguments; "
                says = f"rank {case.bad}: {case.sentence}"
            elif isinstance(case, Disagree):
                expected = CollectiveMismatchError.__name__
                prefix = f"{case.descs[rank]} on rank {rank}: ranks disagree on {case.argument} "
                says = f"({case.shown}); every rank must pass the same {case.argument}"
            else:
                expected = CollectiveMismatchError.__name__
                prefix, says = f"{case.desc} on rank {rank}: ", case.says
            where = f"{case.op} {case.argument} (case {i}), rank {rank}"
            if kind != expected:
                failures.append(f"{where}: {kind}, not {expected}: {message}")
            elif not message.startswith(prefix) or says not in message:
                failures.append(f"{where}:\n  {message}\n  expected {prefix!r} ... {says!r}")
    assert not failures, "\n".join(failures)


def test_the_cases_name_every_argument_of_every_op() -> None:
    """Each op's declared arguments (its signature's fields and lists) all have a case, and
    every argument this rank checks alone has one here for its local check."""
    declared = {
        value.op: value
        for name, module in sorted(sys.modules.items())
        if name.startswith("distgrad.collectives.")
        for value in vars(module).values()
        if isinstance(value, Signature)
    }
    assert sorted(declared) == sorted(collectives.__all__)
    named = {(c.op, c.argument) for c in [*LOCAL, *DISAGREE, *RELATION]}
    checked_alone = {(c.op, c.argument) for c in LOCAL}
    for op, signature in declared.items():
        for field in (*signature.fields, *signature.lists):
            assert not isinstance(field, str), f"{op}'s {field} is not a typed field"
            assert (op, field.name) in named, f"no case for {op}'s {field.name}"
            if not isinstance(field, Shape):  # any shape is a shape: no local check
                assert (op, field.name) in checked_alone, f"no local case: {op}'s {field.name}"


# ---------------------------------------------------------------------------------------------
# One argument, one message: the same bad argument given to a collective, a loss and a parallel
# pattern is refused in the same words, naming the group rank, with the same error type.

# (op, call on (group rank, group)). Every rank of the group passes the bad argument, so every
# rank raises: a collective and a loss in their checked call (every rank's problems listed), a
# pattern that checks on its own rank alone (handshake=False) on each rank.
Ops = list[tuple[str, Call]]


def _ones(rows: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return torch.ones(rows, 2, dtype=dtype)


def _wrong_dtype_on_rank_1(rank: int) -> torch.Tensor:
    return _ones(4, torch.float64 if rank == 1 else torch.float32)


SAME_ARGUMENT: dict[str, tuple[type[Exception], str, Ops]] = {
    "a sizes list of the wrong length": (
        CollectiveArgumentError,
        "sizes must be 2 non-negative ints (one per rank), got [4]",
        [
            ("all_gather", lambda r, g: dg.all_gather(_ones(4), g, sizes=[4])),
            ("reduce_scatter", lambda r, g: dg.reduce_scatter(_ones(4), group=g, sizes=[4])),
            ("nt_xent", lambda r, g: dg.losses.nt_xent(_ones(4), _ones(4), group=g, sizes=[4])),
            ("info_nce", lambda r, g: dg.losses.info_nce(_ones(4), _ones(4), group=g, sizes=[4])),
            (
                "split_to_sequence",
                lambda r, g: dg.parallel.split_to_sequence(_ones(4), g, sizes=[4]),
            ),
            (
                "ring_attention",
                lambda r, g: dg.parallel.ring_attention(*[_ones(4)] * 3, g, sizes=[4]),
            ),
        ],
    ),
    "a dim x does not have": (
        CollectiveArgumentError,
        "dim must be in [-2, 2) for a tensor with 2 dims, got 5",
        [
            ("all_gather", lambda r, g: dg.all_gather(_ones(4), g, dim=5)),
            ("split_to_sequence", lambda r, g: dg.parallel.split_to_sequence(_ones(4), g, dim=5)),
        ],
    ),
    "an x that is not a tensor": (
        CollectiveArgumentError,
        "x must be a torch.Tensor, got 5",
        [
            ("all_reduce", lambda r, g: dg.all_reduce(5, group=g)),  # type: ignore[arg-type]
            ("split_to_sequence", lambda r, g: dg.parallel.split_to_sequence(5, g)),  # type: ignore[arg-type]
            ("copy_to_region", lambda r, g: dg.parallel.copy_to_region(5, g)),  # type: ignore[arg-type]
        ],
    ),
    "an unknown objective": (
        CollectiveArgumentError,
        "objective must be one of ['replicated', 'sum'], got 'once'",
        [
            ("all_gather", lambda r, g: dg.all_gather(_ones(4), g, objective="once")),  # type: ignore[arg-type]
            (
                "gather_from_sequence",
                lambda r, g: dg.parallel.gather_from_sequence(_ones(4), g, objective="once"),  # type: ignore[arg-type]
            ),
            (
                "column_parallel_linear",
                lambda r, g: dg.parallel.column_parallel_linear(
                    _ones(4),
                    _ones(3),
                    group=g,
                    objective="once",  # type: ignore[arg-type]
                ),
            ),
        ],
    ),
    "a negative block size": (
        CollectiveArgumentError,
        "block_size must be None (dense), 'auto' or a positive int, got -1",
        [
            (
                "clip_loss",
                lambda r, g: dg.losses.clip_loss(_ones(4), _ones(4), group=g, block_size=-1),
            ),
            (
                "info_nce",
                lambda r, g: dg.losses.info_nce(_ones(4), _ones(4), group=g, block_size=-1),
            ),
        ],
    ),
    "a dtype that differs across ranks": (
        CollectiveMismatchError,
        "ranks disagree on dtype (rank 0: torch.float32; rank 1: torch.float64); every rank "
        "must pass the same dtype",
        [
            ("all_gather", lambda r, g: dg.all_gather(_wrong_dtype_on_rank_1(r), g)),
            (
                "nt_xent",
                lambda r, g: dg.losses.nt_xent(_ones(4), _wrong_dtype_on_rank_1(r), group=g),
            ),
            (
                "gather_from_sequence",  # its all_gather finds it
                lambda r, g: dg.parallel.gather_from_sequence(_wrong_dtype_on_rank_1(r), g),
            ),
        ],
    ),
}


def _what_this_rank_is_told(message: str, rank: int) -> str:
    """A message's words about ``rank``'s call: its own entry where a checked call lists every
    rank's problems (``invalid arguments; rank 0: ...; rank 1: ...``), else all it says."""
    _, found, body = message.partition(f" on rank {rank}: ")
    if not found:
        return f"(the message names no 'on rank {rank}': {message})"
    if body.startswith("invalid arguments; "):
        entries = re.findall(r"rank (\d+): (.*?)(?=; rank \d+: |$)", body)
        return dict(entries).get(str(rank), f"(no entry for rank {rank}: {body})")
    return body


def _same_argument_everywhere(rank: int, world_size: int) -> dict[str, list[tuple[str, str]]]:
    seen: dict[str, list[tuple[str, str]]] = {}
    for case, (_, _, ops) in SAME_ARGUMENT.items():
        for _, call in ops:
            # Global ranks 1 and 2 are group ranks 0 and 1: a message must name the group's.
            group = dist.new_group([1, 2])  # a first call on it: checked across ranks
            if rank != 0:
                here = dist.get_rank(group)
                seen.setdefault(case, []).append(outcome(call, here, group))
    return seen


def test_one_argument_gets_one_message_from_a_collective_a_loss_and_a_pattern() -> None:
    """The same bad argument passed to collectives, losses and parallel patterns, on every
    rank of a group whose ranks are not the global ranks: on every rank, the same error type
    and the same words about that rank's call, naming its group rank."""
    per_rank = run_on_ranks(_same_argument_everywhere, 3, timeout=120)
    failures = []
    for global_rank, seen in enumerate(per_rank[1:], start=1):
        group_rank = global_rank - 1
        for case, (kind, words, ops) in SAME_ARGUMENT.items():
            for (op, _), (raised, message) in zip(ops, seen[case], strict=True):
                told = _what_this_rank_is_told(message, group_rank)
                if raised != kind.__name__ or told != words:
                    failures.append(
                        f"{case}, {op}, global rank {global_rank} (group rank {group_rank}): "
                        f"{raised}: {message}\n  expected {kind.__name__}: ...on rank "
                        f"{group_rank}: ... {words}"
                    )
    assert not failures, "\n".join(failures)
