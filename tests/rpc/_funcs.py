"""Functions the RPC tests run on remote workers (module level, so they pickle)."""

from __future__ import annotations

import gc
import weakref
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

import distgrad.rpc as dgrpc
from distgrad.errors import UnknownContextError
from tests._support import leaf, seeded, sparse_leaf

Call = Callable[..., Any]


def local_call(_to: str, fn: Call, args: tuple[Any, ...] = ()) -> Any:
    return fn(*args)


def remote_call(to: str, fn: Call, args: tuple[Any, ...] = ()) -> Any:
    return dgrpc.rpc_sync(to, fn, args=args)


def chain(x: Tensor, hops: list[str], local: bool) -> Tensor:
    """x -> x * 1.5 + sin(x) on each hop in turn; the last hop squares."""
    if not hops:
        return x * x
    call = local_call if local else remote_call
    return call(hops[0], chain, (x * 1.5 + torch.sin(x), hops[1:], local))  # type: ignore[no-any-return]


def scale_then_call_back(x: Tensor, back_to: str, local: bool) -> Tensor:
    """A -> B -> A: B scales, A multiplies by itself, B adds a cosine."""
    call = local_call if local else remote_call
    y = call(back_to, torch.mul, (x * 3.0, x))
    return y + torch.cos(x)  # type: ignore[no-any-return]


def two_outputs(x: Tensor, y: Tensor) -> tuple[Tensor, Tensor, int]:
    return x @ y, torch.tanh(x), 7


def raise_in_backward(x: Tensor) -> Tensor:
    return _Boom.apply(x)  # type: ignore[no-any-return]


class _Boom(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: Tensor) -> Tensor:
        return x.clone()

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> Tensor:
        raise ValueError("boom in a backward function")


_store: dict[str, Tensor] = {}


def make_param(name: str, seed: int, shape: tuple[int, ...]) -> dgrpc.RRef[Tensor]:
    g = seeded(seed)
    _store[name] = torch.randn(*shape, dtype=torch.float64, generator=g, requires_grad=True)
    return dgrpc.RRef(_store[name])


def param_grad(context_id: int, name: str) -> Tensor | None:
    grads = dgrpc.get_gradients(context_id)
    return grads.get(_store[name])


def context_known(context_id: int) -> tuple[bool, int, int]:
    try:
        from distgrad.rpc._context import lookup

        ctx = lookup(context_id)
    except UnknownContextError:
        return False, 0, 0
    return True, len(ctx.sends), len(ctx.recvs)


def state() -> dict[str, int]:
    return dgrpc.debug_state()


def chain_boom(x: Tensor, hops: list[str]) -> Tensor:
    """Like ``chain``, but the last hop's backward raises."""
    if not hops:
        return raise_in_backward(x * x)
    return remote_call(hops[0], chain_boom, (x + 1.0, hops[1:]))  # type: ignore[no-any-return]


def open_context_id() -> int:
    with dgrpc.context() as context_id:
        return context_id


def add_plain(x: Tensor, y: Tensor) -> Tensor:
    return x + y


_hook_calls: list[int] = [0]


def fan_out_and_back(x: Tensor, to: str) -> Tensor:
    """On B: h = 2x is sent to ``to`` twice; a hook on h counts how often its gradient is made."""
    h = x * 2.0
    h.register_hook(lambda g: _count_hook(g))
    r1 = remote_call(to, torch.sin, (h,))
    r2 = remote_call(to, torch.cos, (h,))
    return r1 * r2


def fan_out_local(x: Tensor) -> Tensor:
    h = x * 2.0
    return torch.sin(h) * torch.cos(h)


def _count_hook(g: Tensor) -> None:
    _hook_calls[0] += 1


def hook_calls() -> int:
    return _hook_calls[0]


def die_soon() -> None:
    import os
    import threading

    threading.Timer(0.2, lambda: os._exit(0)).start()


def apply_param(rref: dgrpc.RRef[Tensor], x: Tensor) -> Tensor:
    return torch.tanh(x @ rref.local_value())


class FailingSGD(torch.optim.SGD):
    def step(self, closure: Any = None) -> Any:
        raise RuntimeError("this optimizer always fails")


def drive_loop(mode: str, peer: str) -> float:
    """Run a loop (here -> peer -> here) with its root on this worker; the largest error."""
    g = seeded(11)
    x = torch.randn(3, dtype=torch.float64, generator=g, requires_grad=True)
    v = torch.randn(3, dtype=torch.float64, generator=g)
    me = _me()
    local = scale_then_call_back(x * 1.0, me, local=True)
    (ref,) = torch.autograd.grad((local * v).sum(), x)
    with dgrpc.context() as cid:
        out = remote_call(peer, scale_then_call_back, (x * 1.0, me, False))
        dgrpc.backward(cid, [out], grad_tensors=[v], mode=mode)
        got = dgrpc.get_gradients(cid)[x]
    return float((got - ref).abs().max())


def _me() -> str:
    from torch.distributed import rpc as torch_rpc

    return str(torch_rpc.get_worker_info().name)


_results: list[Any] = []  # weak references to results this worker returned


def add_and_watch(x: Tensor, y: Tensor) -> Tensor:
    """x + y, remembering the result weakly (to see whether anything keeps its data alive)."""
    out = x + y
    _results.append(weakref.ref(out))
    return out


def last_result_alive() -> bool:
    gc.collect()
    return _results[-1]() is not None


# --- Cases ported from torch's dist_autograd_test.py (own code) -----------------------------


def py_add(t1: Tensor, t2: Tensor) -> Tensor:
    return torch.add(t1, t2)


def nested_python_udf(t1: Tensor, t2: Tensor, dst: str, local: bool = False) -> Tensor:
    """t3, t4 are computed here, sent to ``dst`` and used here again (SMART's old failure)."""
    t3 = t1 * t2
    t4 = t1 + t2
    res = (local_call if local else remote_call)(dst, py_add, (t3, t4))
    return t1 * t2 * t3 * t4 * res


def complex_python_udf(t1: Tensor, t2: Tensor) -> Tensor:
    t3 = torch.nn.functional.linear(t1, t2)
    t4 = torch.nn.functional.linear(t2, t3)
    t5 = torch.nn.functional.linear(t3, t4)
    return torch.linalg.multi_dot([t1, t2, t3, t4, t5])


def mixed_requires_grad_op(t1: Tensor, t2: Tensor) -> Tensor:
    return t1 - t2 if t2.requires_grad else t1 * t2


def rref_add(rref: Any, t2: Tensor) -> Tensor:
    return torch.add(rref.local_value(), t2)


def nested_rref_add(owner: str, rref: Any, t2: Tensor) -> Tensor:
    return dgrpc.rpc_sync(owner, rref_add, args=(rref, t2))  # type: ignore[no-any-return]


def owned_leaf(seed: int, sparse: bool) -> Tensor:
    """A leaf requiring grad, made on the worker that runs this (an RRef's value)."""
    return sparse_leaf(seed) if sparse else leaf(seed, 4, 4)


def owner_grad(context_id: int, rref: Any) -> Tensor | None:
    """On the owner: the gradient of an RRef's value in the context."""
    return dgrpc.get_gradients(context_id).get(rref.local_value())


_returned = torch.ones(3, 3, dtype=torch.float64, requires_grad=True)


def ret_requires_grad() -> Tensor:
    return _returned


def returned_grad(context_id: int) -> Tensor | None:
    return dgrpc.get_gradients(context_id).get(_returned)


def slow_add(t1: Tensor, t2: Tensor) -> Tensor:
    import time

    time.sleep(0.2)
    return (t1 + t2).requires_grad_()


class SimulateBackwardError(torch.autograd.Function):
    """Identity whose backward raises while ``_fail[0]`` is set (on the worker that runs it)."""

    @staticmethod
    def forward(ctx: Any, x: Tensor) -> Tensor:
        return x.clone()

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> Tensor:
        if _fail[0]:
            raise RuntimeError("simulated error in a backward function")
        return grad


_fail = [True]


def set_backward_error(fail: bool) -> None:
    _fail[0] = fail


def udf_with_backward_error(t1: Tensor, t2: Tensor) -> Tensor:
    t3 = t1 + t2
    t4 = SimulateBackwardError.apply(t3)
    return torch.linalg.multi_dot([t1, t2, t3, t4])


def nested_udf_with_backward_error(t1: Tensor, t2: Tensor, dst: str) -> Tensor:
    t1 = t1 * t2
    t2 = t1 + t2
    res = dgrpc.rpc_sync(dst, udf_with_backward_error, args=(t1, t2))
    return torch.linalg.multi_dot([t1, t2, res])


def raise_value_error(message: str) -> None:
    raise ValueError(message)


def call_torch_rpc(dst: str) -> Tensor:
    """Calls torch's own rpc_sync (refused inside a distgrad context)."""
    from torch.distributed import rpc as torch_rpc

    return torch_rpc.rpc_sync(dst, torch.add, args=(torch.ones(1), 1))  # type: ignore[no-any-return]


def embedding_forward(rref: Any, inputs: Tensor, offsets: Tensor, weights: Tensor) -> Tensor:
    return rref.local_value()(inputs, offsets, weights)  # type: ignore[no-any-return]


def embedding_grad(rref: Any, context_id: int) -> Tensor | None:
    return dgrpc.get_gradients(context_id).get(rref.local_value().weight)


def embedding_bag(seed: int) -> torch.nn.EmbeddingBag:
    torch.manual_seed(seed)
    return torch.nn.EmbeddingBag(16, 4, mode="sum", sparse=True)


def trainer(rref: Any, t2: Tensor, ps: str, mode: str, sparse: bool) -> bool:
    """One trainer of a parameter server: forward and backward in its own context; the server
    checks the gradient it holds in that context before the context is released."""
    with dgrpc.context() as context_id:
        ret = dgrpc.rpc_sync(ps, rref_add, args=(rref, t2))
        loss = torch.sparse.sum(ret) if sparse else ret.sum()
        dgrpc.backward(context_id, [loss], mode=mode)  # type: ignore[arg-type]
        return bool(dgrpc.rpc_sync(ps, ps_grad_is_right, args=(context_id, rref, t2.detach())))


def ps_grad_is_right(context_id: int, rref: Any, t2: Tensor) -> bool:
    """On the server: the trainer's gradient equals local autograd of the same step."""
    value = rref.local_value()
    out = torch.add(value, t2)
    (want,) = torch.autograd.grad(torch.sparse.sum(out) if out.is_sparse else out.sum(), value)
    got = dgrpc.get_gradients(context_id)[value]
    return got.is_sparse == want.is_sparse and bool(torch.equal(got.to_dense(), want.to_dense()))


def hammer(mode: str) -> None:
    """Four chained calls to worker0 and a backward (run by many threads at once)."""
    g = seeded(0)
    t1 = torch.rand(3, 3, generator=g, requires_grad=True)
    t2 = torch.rand(3, 3, generator=g, requires_grad=True)
    with dgrpc.context() as context_id:
        t3 = dgrpc.rpc_sync("worker0", torch.add, args=(t1, t2))
        t4 = dgrpc.rpc_sync("worker0", torch.mul, args=(t2, t3))
        t5 = dgrpc.rpc_sync("worker0", torch.matmul, args=(t3, t4))
        t6 = dgrpc.rpc_sync("worker0", torch.add, args=(t4, t5))
        dgrpc.backward(context_id, [t6.sum()], mode=mode)  # type: ignore[arg-type]
        assert set(dgrpc.get_gradients(context_id)) == {t1, t2}


def remote_ref_call(to: str, fn: Call, args: tuple[Any, ...] = ()) -> Any:
    return dgrpc.remote(to, fn, args=args).to_here()


def async_call(to: str, fn: Call, args: tuple[Any, ...] = ()) -> Any:
    return dgrpc.rpc_async(to, fn, args=args).wait()


class ThreeByThree:
    """A parameter server's module: ``w`` (3x3, from a seeded generator) times the input."""

    def __init__(self, requires_grad: bool = True) -> None:
        g = seeded(0)
        self.w = torch.rand((3, 3), requires_grad=requires_grad, generator=g)

    def forward(self, t1: Tensor) -> Tensor:
        return torch.mm(self.w, t1)

    def get_w(self) -> Tensor:
        return self.w


def call_method(method: Callable[..., Any], rref: Any, *args: Any) -> Any:
    return method(rref.local_value(), *args)


class FailingOptimizer(torch.optim.Optimizer):
    def __init__(self, params: Any) -> None:
        super().__init__(params, {})

    def step(self, closure: Any = None) -> Any:
        raise ValueError("Error running optimizer.")


class OptimizerFailingOnConstructor(torch.optim.Optimizer):
    def __init__(self, params: Any) -> None:
        super().__init__(params, {})
        raise ValueError("Error creating optimizer.")

    def step(self, closure: Any = None) -> Any:
        raise NotImplementedError


def bag_parameters(rref: Any) -> list[dgrpc.RRef[Tensor]]:
    return [dgrpc.RRef(p) for p in rref.local_value().parameters()]


def bag_weight(rref: Any) -> Tensor:
    return rref.local_value().weight.detach().clone()


class _KillInBackward(torch.autograd.Function):
    """Identity whose backward SIGKILLs the process it runs in."""

    @staticmethod
    def forward(ctx: Any, x: Tensor) -> Tensor:
        return x.clone()

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> Tensor:
        import os
        import signal

        os.kill(os.getpid(), signal.SIGKILL)
        return grad


def killed_in_backward(x: Tensor) -> Tensor:
    return _KillInBackward.apply(x * 2)  # type: ignore[no-any-return]


backward_started: list[float] = []


class _SlowBackward(torch.autograd.Function):
    """Identity whose backward notes when it started, then takes ``seconds``."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, seconds: float) -> Tensor:
        ctx.seconds = seconds
        return x.clone()

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None]:
        import time

        backward_started.append(time.monotonic())
        time.sleep(ctx.seconds)
        return grad, None


def slow_in_backward(x: Tensor, seconds: float) -> Tensor:
    return _SlowBackward.apply(x * 2, seconds)  # type: ignore[no-any-return]


def kill_me_after(seconds: float) -> None:
    import os
    import signal
    import threading

    threading.Timer(seconds, lambda: os.kill(os.getpid(), signal.SIGKILL)).start()


def recorded(context_id: int) -> dict[str, Any]:
    """What this worker recorded in a context: counts, known workers, and for each send the
    names of the nodes its tensors' gradients enter."""
    from distgrad.rpc._context import lookup
    from distgrad.rpc._records import node_of

    ctx = lookup(context_id)
    return {
        "sends": len(ctx.sends),
        "recvs": len(ctx.recvs),
        "known": sorted(ctx.known_workers),
        "targets": [[node_of(t).name() for t in s.targets] for s in ctx.sends.values()],
    }


def set_lineage_walk(nodes: int) -> int:
    """How far a send's lineage is looked for when it is sent (0: never; SMART then asks);
    returns the previous setting."""
    from distgrad.rpc import send_recv

    previous = send_recv._LINEAGE_WALK_NODES
    send_recv._LINEAGE_WALK_NODES = nodes
    return previous


def deep(x: Tensor, ops: int) -> Tensor:
    for _ in range(ops):
        x = torch.sin(x) * 1.01
    return x


# --- Intra-op threads ---------------------------------------------------------------------

_conv_stage: list[torch.nn.Module] = []


def conv_stage() -> torch.nn.Module:
    """A seeded float32 convolution stage, made once per worker (its weight gradient is a
    reduction whose last bits depend on the number of intra-op threads)."""
    if not _conv_stage:
        g = seeded(0)
        stage = torch.nn.Sequential(
            torch.nn.Conv2d(4, 8, 3), torch.nn.ReLU(), torch.nn.Conv2d(8, 8, 3), torch.nn.Flatten()
        )
        with torch.no_grad():
            for p in stage.parameters():
                p.copy_(torch.randn(p.shape, generator=g) * 0.2)
        _conv_stage.append(stage)
    return _conv_stage[0]


def run_conv_stage(x: Tensor) -> Tensor:
    return conv_stage()(x)  # type: ignore[no-any-return]


def conv_stage_grads(context_id: int, torch_engine: bool) -> list[Tensor]:
    """The stage's parameter gradients in a context (torch's or distgrad's)."""
    if torch_engine:
        import torch.distributed.autograd as torch_autograd

        found = torch_autograd.get_gradients(context_id)
    else:
        found = dgrpc.get_gradients(context_id)
    return [found[p] for p in conv_stage().parameters()]


def set_threads(n: int) -> int:
    """The process's intra-op threads (set from an RPC thread: the setting is process-wide)."""
    torch.set_num_threads(n)
    return torch.get_num_threads()


# --- Threads sharing leaves -----------------------------------------------------------------


class Identity(torch.autograd.Function):
    """x, through a Python-defined node: applying it takes the input's autograd mutex while
    holding the GIL (what made a thread deadlock with another one taking a view of a leaf)."""

    @staticmethod
    def forward(ctx: Any, x: Tensor) -> Tensor:
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> Tensor:
        return grad


_server_leaf: list[Tensor] = []


def server_leaf() -> Tensor:
    """A leaf on the worker that runs this, shared by every call (a parameter server's)."""
    if not _server_leaf:
        _server_leaf.append(torch.randn(3, 3, dtype=torch.float64, generator=seeded(7)))
        _server_leaf[0].requires_grad_(True)
    return _server_leaf[0]


def times_server_leaf(x: Tensor) -> Tensor:
    """x * w for the server's shared leaf w, one use of it through a Python-defined node."""
    w = server_leaf()
    return x * Identity.apply(w)


def server_leaf_grad(context_id: int) -> Tensor:
    return dgrpc.get_gradients(context_id)[server_leaf()]


# --- DDP inside a context ---------------------------------------------------------------------

_ps_table: list[torch.nn.EmbeddingBag] = []


def ps_table() -> torch.nn.EmbeddingBag:
    """A parameter server's seeded embedding table (dense gradients), made once."""
    if not _ps_table:
        torch.manual_seed(5)
        _ps_table.append(torch.nn.EmbeddingBag(16, 4, mode="sum"))
    return _ps_table[0]


def ps_lookup(indices: Tensor, offsets: Tensor) -> Tensor:
    return ps_table()(indices, offsets)  # type: ignore[no-any-return]


def ps_table_grad(context_id: int, torch_engine: bool) -> Tensor | None:
    if torch_engine:
        import torch.distributed.autograd as torch_autograd

        return torch_autograd.get_gradients(context_id).get(ps_table().weight)
    return dgrpc.get_gradients(context_id).get(ps_table().weight)


# --- torch's other RPC names ------------------------------------------------------------------


@dgrpc.functions.async_execution
def async_double_add(to: str, x: Tensor, y: Tensor) -> Any:
    """Marked async_execution: asks ``to`` for x + y and answers 2 * (x + y) when that arrives
    (the doubling runs in the future's callback, recorded in the context)."""
    return dgrpc.rpc_async(to, torch.add, args=(x, y)).then(lambda done: done.wait() * 2)


class AsyncScaler:
    """A value whose method is marked async_execution (an RRef proxy must notice)."""

    def __init__(self) -> None:
        self.w = torch.full((3,), 3.0, dtype=torch.float64, requires_grad=True)

    @dgrpc.functions.async_execution
    def scaled(self, x: Tensor) -> Any:
        fut: torch.futures.Future[Tensor] = torch.futures.Future()
        fut.set_result(x * self.w)
        return fut

    def get_w(self) -> Tensor:
        return self.w


def weighted_squared_sum(x: Tensor, v: Tensor) -> Tensor:
    """<v, x * x>: its gradient is 2 * v * x."""
    return (v * x * x).sum()


def local_leaf_sum() -> Tensor:
    """A scalar from a leaf made here, kept for owner_leaf_grad."""
    leaf = torch.ones(3, dtype=torch.float64, requires_grad=True)
    _owned_leaves.append(leaf)
    return (leaf * 3).sum()


_owned_leaves: list[Tensor] = []


def owner_leaf_grad() -> Tensor | None:
    return _owned_leaves[-1].grad


def leaf_grad_under(rref: Any) -> Tensor | None:
    """On the owner of local_leaf_sum's RRef: its leaf's .grad, once the value is made (the
    RRef's creation may still be on its way when this is asked)."""
    rref.local_value()  # waits for the value
    return owner_leaf_grad()


def owner_rref_local_backward() -> Tensor | None:
    """On the owner, outside any context: RRef.backward() of a scalar made from a leaf here
    (torch's local backward); the leaf's .grad."""
    dgrpc.RRef(local_leaf_sum()).backward()
    return owner_leaf_grad()


def leaf_grad_in(context_id: int, rref: Any) -> Tensor | None:
    """On the owner of a ThreeByThree: its weight's gradient in the context."""
    return dgrpc.get_gradients(context_id).get(rref.local_value().w)


def leaf_grad_in_scaler(context_id: int, rref: Any) -> Tensor | None:
    return dgrpc.get_gradients(context_id).get(rref.local_value().w)


def seeded_linear(seed: int) -> torch.nn.Linear:
    torch.manual_seed(seed)
    return torch.nn.Linear(4, 2, dtype=torch.float64)


def module_training(rref: Any) -> bool:
    """On a module's owner: its training flag."""
    return bool(rref.local_value().training)


def module_grads(context_id: int, rref: Any) -> list[Tensor]:
    found = dgrpc.get_gradients(context_id)
    return [found[p] for p in rref.local_value().parameters()]
