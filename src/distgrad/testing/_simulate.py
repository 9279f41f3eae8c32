"""Every rank in this process: torch's ``LocalTensorMode`` over a ``fake`` process group.

One Python program runs for all ranks. A tensor is a ``LocalTensor`` holding each rank's
value (a *slot* per rank); an aten op runs on each slot in turn, and a c10d collective is done
among the slots by ``torch.distributed._local_tensor._c10d``. distgrad's exchanges call the
ProcessGroup's methods (``pg.allreduce``, ``pg._allgather_base``, ``pg.alltoall_base``, ...),
which reach the dispatcher as ``c10d::allreduce_``, ``c10d::_allgather_base_``, ... and are
intercepted there like ``torch.distributed.all_reduce``. No process starts, no byte moves.

Python itself runs once, so a Python decision that depends on the rank is the hard part:
``if rank == 0``, ``sizes[group.rank]`` (distgrad's own exchanges do that), ``int()`` of a
per-rank value. Left alone, the fake group answers rank 0 to every slot and the other slots
silently follow rank 0's path: a wrong answer. Here:

* ``dist.get_rank()`` is a per-rank int (torch's ``LocalIntNode``, as LocalTensorMode already
  makes DeviceMesh coordinates): ``torch.arange(n) + rank * n`` is right in every slot.
* When Python needs one value of a per-rank int (an ``int()``, an index, a comparison whose
  answer differs between slots), a *run for rank p* answers with rank p's value: every slot
  follows rank p's Python path. If a run needed no such answer, it is exact and the only
  one. Otherwise there is one run per rank, each keeping only its own rank's results, and the
  runs are checked against each other: collective by collective, the same op on the same
  group with the same arguments, and each slot sending the same data in every run as in its
  own rank's run. By induction over the collectives every slot then receives what it would
  on processes, so each rank's results are its true ones; if any collective differs, the
  check is refused (``_Refused``), never answered.
* The fake group is made with ``error_on_collective``: a collective that LocalTensorMode did
  not intercept raises instead of returning the fake group's invented result. A plain tensor
  (one Python value, so the same in every slot) in a collective is lifted to a LocalTensor of
  equal slots; an in-place op that would write per-slot values into one plain tensor is refused.
"""

from __future__ import annotations

import contextlib
import functools
import os
import sys
import threading
import traceback
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

import torch
import torch.distributed as dist
from torch import Tensor
from torch.utils import _pytree

from distgrad._exchange import group as _group
from distgrad.errors import CheckArgumentError, DistgradError

__all__ = ["DROP", "local", "per_rank", "run_simulated", "run_spmd", "stacked"]

DROP = "drop simulate=True (distgrad check: without --simulate) to check it on processes"

_R = TypeVar("_R")


class _Refused(DistgradError):
    """What the simulation cannot answer truthfully (internal: the caller words the error)."""


@dataclass
class _Run:
    """One simulated run: whose Python path it follows, and what its collectives did."""

    rank: int
    world_size: int
    answered: bool = False  # a per-rank int was answered with rank ``rank``'s value
    where: str = ""  # the line of code that first needed one (file:line in function)
    calls: list[tuple[str, list[Tensor | None]]] = field(default_factory=list)


_run: _Run | None = None
# Above zero while torch itself works on LocalTensors (LocalTensorMode running an op, a
# LocalTensor being made): a per-rank int compared there is torch's bookkeeping (the strides
# of a tensor whose ranks' shapes differ), answered by torch's rule, not a Python branch of
# the code under check.
_inside_torch = 0


def run_simulated(body: Callable[[], list[_R]], world_size: int, who: str) -> list[_R]:
    """Each rank's result of ``body`` (which returns one result per slot), simulated.

    Raises CheckArgumentError when the code cannot be simulated truthfully."""
    if dist.is_initialized():
        raise CheckArgumentError(
            f"{who}: simulate=True runs every rank in this process and needs it without a "
            f"process group, but one is initialised here; {DROP}"
        )
    if threading.current_thread() is not threading.main_thread():
        raise CheckArgumentError(f"{who}: simulate=True runs on the main thread only; {DROP}")
    rng = torch.get_rng_state()
    try:
        first, results = _one_run(body, _Run(0, world_size), who)
        if not first.answered:
            return results
        runs, kept = [first], [results[0]]
        for rank in range(1, world_size):
            torch.set_rng_state(rng)
            run, results = _one_run(body, _Run(rank, world_size), who)
            runs.append(run)
            kept.append(results[rank])
        _check_runs(runs)
        return kept
    except _Refused as exc:
        raise CheckArgumentError(
            f"{who}: simulate=True cannot check this code: {exc}; {DROP}"
        ) from exc
    finally:
        torch.set_rng_state(rng)


def run_spmd(fn: Callable[..., Any], world_size: int, args: Sequence[Any], who: str) -> list[Any]:
    """Each rank's return value of ``fn(rank, world_size, *args)``, every rank simulated in
    this process: ``rank`` is one per-rank int (a SymInt holding each rank's value), so ``fn``
    runs once for all ranks where it uses the rank as data (arithmetic, ``torch.arange(n) +
    rank * n``, ``Group.offset``); the tensors it returns are split into each rank's value."""

    def body() -> list[Any]:
        out = fn(dist.get_rank(), world_size, *args)
        ranks = range(world_size)
        return [_pytree.tree_map(functools.partial(_value_on, rank=r), out) for r in ranks]

    return run_simulated(body, world_size, who)


def _value_on(value: Any, *, rank: int) -> Any:
    """Rank ``rank``'s value of one leaf of a simulated result."""
    if isinstance(value, Tensor):
        return local(value, rank).detach().clone()
    if isinstance(value, torch.SymInt) and isinstance(value.node, _lt().LocalIntNode):
        return int(value.node._local_ints[rank])
    return value


def _one_run(body: Callable[[], list[_R]], run: _Run, who: str) -> tuple[_Run, list[_R]]:
    global _run
    with _world(run.world_size):
        _run = run
        try:
            return run, body()
        except RuntimeError as exc:
            if "error_on_collective" in str(exc):
                raise _Refused(
                    "a collective reached the fake process group without passing through "
                    f"LocalTensorMode ({exc})"
                ) from exc
            if "LocalRunnerMode is not enabled" in str(exc):
                raise _Refused(
                    "a point-to-point send or receive (LocalTensorMode simulates those only "
                    "with threads per rank, LocalRunnerMode)"
                ) from exc
            if str(exc) == "NYI":  # torch: an op with no rule for per-rank sizes
                raise _Refused(
                    "torch cannot run an op on sizes that differ between the ranks simulated "
                    "(NYI; F.cross_entropy's nll_loss is one: write it as log_softmax and a "
                    f"pick){_where(',', exc.__traceback__)}"
                ) from exc
            if run.answered:
                raise _path_failed(run, exc) from exc
            raise
        except _Refused:
            raise
        except NotImplementedError as exc:  # LocalTensorMode has no rule for this op
            raise _Refused(f"LocalTensorMode does not simulate it ({exc})") from exc
        except Exception as exc:  # after an answer, maybe only the other slots' data failed
            if "statically_known_true" in str(exc):  # torch: a slice by a per-rank size
                raise _Refused(
                    "torch cannot index a tensor by a size that differs between the ranks "
                    f"simulated (x[:n], x[:, None]: write x.narrow(0, 0, n), x.unsqueeze(1))"
                    f"{_where(',', exc.__traceback__)}"
                ) from exc
            if run.answered:
                raise _path_failed(run, exc) from exc
            raise
        finally:
            _run = None


def _path_failed(run: _Run, exc: BaseException) -> _Refused:
    """An error once the slots follow rank ``run.rank``'s path: maybe only because another
    rank's data cannot take that path (uneven shards), so no answer, not the user's error."""
    return _Refused(
        f"the ranks take different Python paths (a per-rank value was needed as one Python "
        f"value{run.where}), and following rank {run.rank}'s path on every rank's data failed: "
        f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
    )


def _check_runs(runs: Sequence[_Run]) -> None:
    """Refuse unless every run made the same collectives and every slot sent, in each, what
    it sent in its own rank's run (then every slot received its true data: induction)."""
    own = {run.rank: run for run in runs}
    for run in runs:
        if [c[0] for c in run.calls] != [c[0] for c in runs[0].calls]:
            raise _Refused(
                f"the ranks take different paths through the code{runs[0].where}: rank "
                f"{run.rank}'s collectives ({_listing(run)}) are not rank 0's "
                f"({_listing(runs[0])})"
            )
    for index, (what, _) in enumerate(runs[0].calls):
        for run in runs:
            for slot, sent in enumerate(run.calls[index][1]):
                truth = own[slot].calls[index][1][slot]
                if not _same(sent, truth):
                    raise _Refused(
                        f"the ranks take different paths through the code{runs[0].where}: "
                        "collective "
                        f"{index + 1} ({what}) gets other data from rank {slot} when every "
                        f"rank follows rank {run.rank}'s Python path than on rank {slot}'s own"
                    )


# Where SymInt's Python operators live: a Python ``a == b`` on a per-rank int passes through
# them on its way to the node.
_OPERATORS = (
    os.path.join(os.path.dirname(torch.__file__), "__init__.py"),
    os.path.join(os.path.dirname(torch.__file__), "fx", "experimental", "sym_node.py"),
)
_TORCH_DIR = os.path.dirname(torch.__file__) + os.sep


def _from_torch(caller: Any) -> bool:
    """Whether torch itself compares a per-rank size (its C++ autograd engine checking a
    gradient's shape, called from the Python frame that started it), not Python code: a
    Python comparison reaches the node through SymInt's operators, called from its own line."""
    while caller is not None and caller.f_code.co_filename in _OPERATORS:
        caller = caller.f_back
    return caller is not None and caller.f_code.co_filename.startswith(_TORCH_DIR)


def _answered(run: _Run) -> None:
    """Note that ``run`` answered a per-rank value with its rank's, and, the first time, the
    line that asked, for the message."""
    if not run.answered:
        run.where = _where(", first")
    run.answered = True


def _where(lead: str = "", stack: Any = None) -> str:
    """``{lead} at file:line in function``: the innermost frame outside torch and this module
    (of the current stack, or of an exception's ``stack``), or nothing."""
    frames = traceback.extract_stack()[:-2] if stack is None else traceback.extract_tb(stack)
    for frame in reversed(frames):
        if frame.filename != __file__ and f"{os.sep}torch{os.sep}" not in frame.filename:
            return f"{lead} at {os.path.basename(frame.filename)}:{frame.lineno} in {frame.name}"
    return ""


def _listing(run: _Run) -> str:
    names = [c[0].split("(")[0] for c in run.calls]
    return ", ".join(names[:6]) + (", ..." if len(names) > 6 else "") if names else "none"


def _same(a: Tensor | None, b: Tensor | None) -> bool:
    if a is None or b is None:
        return a is b
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    if a.is_floating_point() or a.is_complex():
        return bool(((a == b) | (a.isnan() & b.isnan())).all())
    return torch.equal(a, b)


@contextlib.contextmanager
def _world(world_size: int) -> Iterator[Any]:
    """A fake default group of ``world_size`` ranks and LocalTensorMode over them."""
    lt = _lt()
    from torch.testing._internal.distributed.fake_pg import FakeStore

    undo: list[Callable[[], None]] = []
    try:
        undo.append(_strict_fake_backend())
        dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world_size)
        # What distgrad kept while no group existed (the reference run's call shapes, each
        # bound to "this process alone") must not serve the simulated group's calls: distgrad
        # forgets it when a group is destroyed, not when one is created.
        _group._forget([], True)
        undo.append(_per_rank_get_rank(world_size))
        undo.append(_answered_local_ints(lt.LocalIntNode))
        undo.append(_construction_is_bookkeeping(lt.LocalTensor))
        with _mode_class()(world_size) as mode:
            yield mode
    finally:
        for step in reversed(undo):
            step()
        if dist.is_initialized():
            dist.destroy_process_group()


def _lt() -> Any:
    from torch.distributed import _local_tensor

    return _local_tensor


_MODE: type | None = None


def _mode_class() -> type:
    """LocalTensorMode, plus: collectives recorded and plain tensors in them lifted, and
    per-slot values written into one plain tensor refused. Made on first use, so that
    importing distgrad does not import _local_tensor."""
    global _MODE
    if _MODE is not None:
        return _MODE
    lt = _lt()

    class SimulatedRanks(lt.LocalTensorMode):  # type: ignore[misc,name-defined]
        def __torch_dispatch__(
            self, func: Any, types: Any, args: Any = (), kwargs: Any = None
        ) -> Any:
            kwargs = kwargs or {}
            if not self._disable:
                if func.namespace == "c10d" or (
                    func.namespace == "_c10d_functional" and func not in _WAITS
                ):
                    return _collective(super().__torch_dispatch__, func, types, args, kwargs)
                flat = _pytree.tree_leaves((args, kwargs))
                if any(isinstance(a, torch.Generator) for a in flat):
                    return _drawn_alike(func, args, kwargs, flat)
                if not any(isinstance(a, lt.LocalTensor) for a in flat) and (
                    func.overloadpacket in _LIKE
                    or any(
                        isinstance(a, torch.SymInt) and isinstance(a.node, lt.LocalIntNode)
                        for a in flat
                    )
                ):
                    # A plain tensor and a per-rank int (``sizes[:rank]``): per slot, not
                    # with the run's rank for every slot, as LocalTensorMode would. A new
                    # tensor like a plain one (an accumulator, ``zeros_like(scale)``): one
                    # per rank, as torch.zeros(...) is, so each rank's sums can go in.
                    return lt._for_each_rank_run_func(func, self.ranks, args, kwargs, alias=False)
                first = args[0] if args else None
                if (
                    type(first) in (Tensor, torch.nn.Parameter)
                    and len(self.ranks) > 1  # (one rank's value fits a plain tensor)
                    and lt._is_inplace_op(func)
                    and any(isinstance(a, lt.LocalTensor) for a in flat)
                ):
                    raise _Refused(
                        f"{func} writes each rank's value into one tensor shared by every "
                        f"rank (made outside the simulation, or from Python data){_where(',')}"
                    )
            with _torch_bookkeeping():
                return super().__torch_dispatch__(func, types, args, kwargs)

    _MODE = SimulatedRanks
    return _MODE


def _drawn_alike(func: Any, args: Any, kwargs: Any, flat: list[Any]) -> Any:
    """A random op given its own ``torch.Generator``. On processes each rank holds its own
    generator in this state (seeded alike), so every rank draws the same numbers: drawn once,
    a plain tensor (the same on every rank). LocalTensorMode would draw once per rank from the
    one shared object, giving each rank the next numbers. With a per-rank input as well, one
    draw cannot stand for every rank's: refused."""
    lt = _lt()
    if any(
        isinstance(a, lt.LocalTensor)
        or (isinstance(a, torch.SymInt) and isinstance(a.node, lt.LocalIntNode))
        for a in flat
    ):
        raise _Refused(
            f"{func} draws from a torch.Generator with a per-rank input (one shared generator "
            "cannot stand for each rank's own)"
        )
    return func(*args, **kwargs)


# New tensors shaped like another: made per rank even from a plain tensor (see the dispatch).
_LIKE = {
    torch.ops.aten.zeros_like,
    torch.ops.aten.ones_like,
    torch.ops.aten.empty_like,
    torch.ops.aten.full_like,
    torch.ops.aten.new_zeros,
    torch.ops.aten.new_ones,
    torch.ops.aten.new_empty,
    torch.ops.aten.new_full,
}

# The arguments each c10d op reads (the rest it writes); a root's only at the root.
_READS = {"tensors", "input_tensor", "input", "input_tensors"}
_AT_ROOT = {"broadcast_": "tensors", "scatter_": "input_tensors", "broadcast": "input"}
# A functional collective's wait moves nothing (the collective before it did).
_WAITS = (torch.ops._c10d_functional.wait_tensor.default,)


def _collective(dispatch: Callable[..., Any], func: Any, types: Any, args: Any, kwargs: Any) -> Any:
    """Run a collective among the slots (c10d's, or a functional one: a simulated group's
    exchanges take their functional form, ``Group.rank_is_data``), recording what it is and
    what each slot sends.

    A plain tensor is the same in every slot (one Python value serves them all): it is lifted
    to a LocalTensor of equal slots, and, if written, gets the result back when that is again
    equal in every slot (an all_gather or all_reduce of equal values); otherwise refused.
    distgrad's metadata handshake (``_exchange.handshake.share``) makes its tensors from
    Python ints with ``torch.tensor``, which LocalTensorMode leaves plain."""
    lt = _lt()
    world = dist.get_world_size()
    schema = func._schema.arguments
    named = dict(zip((a.name for a in schema), args, strict=False)) | kwargs
    lifted: list[tuple[Tensor, Any]] = []

    def lift(x: Any) -> Any:
        if isinstance(x, Tensor) and not isinstance(x, lt.LocalTensor):
            local = lt.LocalTensor({r: x.detach().clone() for r in range(world)})
            lifted.append((x, local))
            return local
        return x

    named = {k: _pytree.tree_map(lift, v) for k, v in named.items()}
    if _run is not None:
        _run.calls.append((_signature(func, named), _sent(func, named, world)))
    positional = [a.name for a in schema][: len(args)]
    out = dispatch(
        func,
        types,
        tuple(named[k] for k in positional),
        {k: v for k, v in named.items() if k not in positional},
    )
    back = {id(local): plain for plain, local in lifted}
    for plain, local in lifted:
        values = [local._local_tensors[r] for r in range(world)]
        if not all(_same(v, values[0]) for v in values[1:]):
            raise _Refused(f"{func} left a tensor shared by every rank different on each rank")
        if not _same(plain, values[0]):
            with torch.no_grad():
                plain.copy_(values[0])
    return _pytree.tree_map(lambda x: back.get(id(x), x), out)


def _signature(func: Any, named: dict[str, Any]) -> str:
    """The op and its arguments other than tensors: the same in every run, or refused."""
    shown = []
    for name, value in named.items():
        if _pytree.tree_any(lambda x: isinstance(x, Tensor), value):
            continue
        shown.append(f"{name}={_describe(value)}")
    return f"{func._schema.name}({', '.join(shown)})"


def _describe(value: Any) -> str:
    if isinstance(value, torch.ScriptObject):
        from torch.distributed import ProcessGroup

        with contextlib.suppress(Exception):
            return f"group {ProcessGroup.unbox(value).group_name}"
        with contextlib.suppress(Exception):
            return f"op {value.op()}"  # type: ignore[attr-defined]  # a ReduceOp
    return repr(value)


def _sent(func: Any, named: dict[str, Any], world: int) -> list[Tensor | None]:
    """What each slot sends: its values of the arguments the op reads, flattened."""
    name = func._schema.name.split("::")[-1]
    root = _root(named) if name in _AT_ROOT else None
    sent: list[Tensor | None] = []
    for slot in range(world):
        pieces = [
            local(t, slot).detach().reshape(-1).clone()
            for key, value in named.items()
            if key in _READS and (root is None or (key != _AT_ROOT[name] or slot == root))
            for t in _pytree.tree_leaves(value)
            if isinstance(t, Tensor)
        ]
        same_dtype = len({p.dtype for p in pieces}) <= 1
        if not pieces:
            sent.append(None)
        elif same_dtype:
            sent.append(torch.cat(pieces))
        else:
            sent.append(torch.cat([p.view(torch.uint8) for p in pieces]))
    return sent


def _root(named: dict[str, Any]) -> int:
    if "src" in named:  # a functional broadcast: a group rank, the group by name
        by_name = dist.distributed_c10d._resolve_process_group  # type: ignore[attr-defined]
        members = dist.get_process_group_ranks(by_name(named["group_name"]))
        return int(members[named["src"]])
    root = named.get("root_rank", 0)
    group = named.get("process_group")
    if group is not None:
        from torch.distributed import ProcessGroup

        with contextlib.suppress(Exception):
            return int(dist.get_process_group_ranks(ProcessGroup.unbox(group))[root])
    return int(root)


def _strict_fake_backend() -> Callable[[], None]:
    """Make every fake group (the default one and any sub-group) raise on a collective that
    reaches it: only one LocalTensorMode did not intercept gets there."""
    from torch._C._distributed_c10d import FakeProcessGroup

    plugins = dist.Backend._plugins  # type: ignore[attr-defined]
    original = plugins["FAKE"]

    def create(common_opts: Any, backend_opts: Any) -> Any:
        options = FakeProcessGroup.Options()  # type: ignore[call-arg]
        options.error_on_collective = True  # type: ignore[attr-defined]
        return FakeProcessGroup._create_internal(  # type: ignore[call-arg]
            common_opts.group_rank, common_opts.group_size, options
        )

    plugins["FAKE"] = original._replace(creator_fn=create)

    def undo() -> None:
        plugins["FAKE"] = original

    return undo


def _per_rank_get_rank(world_size: int) -> Callable[[], None]:
    """``dist.get_rank(group)``: each slot's rank in ``group`` (-1 outside it)."""
    lt = _lt()
    c10d = dist.distributed_c10d
    original = c10d.get_rank

    def get_rank(group: Any = None) -> Any:
        if group is None or group is dist.group.WORLD:
            ranks = list(range(world_size))
        else:
            members = dist.get_process_group_ranks(group)
            ranks = [members.index(r) if r in members else -1 for r in range(world_size)]
        if len(set(ranks)) == 1:  # one rank (torch would make a constant node with no int())
            return ranks[0]
        return torch.SymInt(lt.LocalIntNode(dict(enumerate(ranks))))  # type: ignore[no-untyped-call]

    c10d.get_rank = get_rank
    dist.get_rank = get_rank

    def undo() -> None:
        c10d.get_rank = original
        dist.get_rank = original

    return undo


@contextlib.contextmanager
def _torch_bookkeeping() -> Iterator[None]:
    """While torch itself works on LocalTensors (see ``_inside_torch``)."""
    global _inside_torch
    _inside_torch += 1
    try:
        yield
    finally:
        _inside_torch -= 1


def _construction_is_bookkeeping(cls: type) -> Callable[[], None]:
    """A LocalTensor made anywhere (an op's result, ``contiguous()``, ``stacked``) compares
    its ranks' sizes to lay out its strides: torch's bookkeeping, not a branch of the code."""
    original = cls.__dict__["__new__"]

    def new(*args: Any, **kwargs: Any) -> Any:
        with _torch_bookkeeping():
            return original.__func__(*args, **kwargs)

    cls.__new__ = staticmethod(new)  # type: ignore[assignment]

    def undo() -> None:
        cls.__new__ = original  # type: ignore[assignment]

    return undo


def _answered_local_ints(node: type) -> Callable[[], None]:
    """Per-rank ints that Python must see as one value (``int()``, an index, a comparison
    whose answer differs between slots) take the value of the run's rank, and the run says
    so. torch's own ``LocalIntNode`` answers ``==`` with "equal in every slot" (rank 0's path
    for ``rank == 0`` is then never taken) and has no ``int()``."""
    lt = _lt()
    names = (*_HOW, "int_", "guard_int")
    saved = {name: node.__dict__.get(name) for name in names}

    def answer(self: Any) -> int:
        if _run is None:
            raise _Refused(f"a per-rank int, {self}, was needed as one Python int")
        _answered(_run)
        return int(self._local_ints[_run.rank])

    def compare(name: str, how: Callable[[int, int], bool]) -> Callable[..., Any]:
        def method(self: Any, other: Any) -> Any:
            if _inside_torch or _from_torch(sys._getframe(1)):  # torch's bookkeeping: its rule
                return saved[name](self, other)  # type: ignore[misc]
            answers = {r: how(v, lt._int_on_rank(other, r)) for r, v in self._local_ints.items()}
            if len(set(answers.values())) == 1:
                return torch._C._get_constant_bool_symnode(answers[0])
            if _run is None:
                raise _Refused(f"a comparison of the per-rank int {self} differs between ranks")
            _answered(_run)
            return torch._C._get_constant_bool_symnode(answers[_run.rank])

        return method

    for name, how in _HOW.items():
        setattr(node, name, compare(name, how))
    node.int_ = lambda self: answer(self)  # type: ignore[attr-defined]
    node.guard_int = lambda self, *args: answer(self)  # type: ignore[attr-defined]

    def undo() -> None:
        for name, value in saved.items():
            if value is None:
                with contextlib.suppress(AttributeError):
                    delattr(node, name)
            else:
                setattr(node, name, value)

    return undo


_HOW: dict[str, Callable[[int, int], bool]] = {
    "eq": lambda a, b: a == b,
    "ne": lambda a, b: a != b,
    "lt": lambda a, b: a < b,
    "le": lambda a, b: a <= b,
    "gt": lambda a, b: a > b,
    "ge": lambda a, b: a >= b,
}


def stacked(values: Sequence[Tensor]) -> Tensor:
    """One LocalTensor holding ``values[r]`` in slot ``r`` (detached copies)."""
    return _lt().LocalTensor({r: v.detach().clone() for r, v in enumerate(values)})  # type: ignore[no-any-return]


def per_rank(t: Tensor, world_size: int) -> list[Tensor]:
    """Each slot's value of ``t`` (a plain tensor is the same in every slot)."""
    inner = getattr(t, "_local_tensors", None)
    if inner is None:
        return [t] * world_size
    return [inner[r] for r in range(world_size)]


def local(t: Tensor, rank: int) -> Tensor:
    """Slot ``rank``'s value of ``t``."""
    inner = getattr(t, "_local_tensors", None)
    return t if inner is None else inner[rank]  # type: ignore[no-any-return]
