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
    g = torch.Generator().manual_seed(seed)
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
    g = torch.Generator().manual_seed(11)
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
