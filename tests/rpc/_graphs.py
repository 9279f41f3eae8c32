"""Random multi-worker programs for the property test, and the code that runs them.

A program is plain data (it travels over RPC): a list of ops that each append one or more
tensors to the running list ``t`` of a call, and the indices of the tensors the call returns.
Ops: ``param`` (a seeded leaf created on the worker that runs the op), ``unary`` and
``binary`` (elementwise math on earlier tensors), and ``call`` (run a sub-program on a worker,
passing some earlier tensors; its results are appended). Tensors are reused after they were
sent, sent to several workers (diamonds), sent back to a worker already in the call chain
(cycles), and some results are never used (unused outputs). Some local ops put a hook on their
result that halves its gradient and counts its calls, so a node that runs twice, or a hook
that sees a partial gradient twice, changes the result.

The same program runs locally (``call`` is a plain call, in one process) and distributed
(``call`` is ``distgrad.rpc.rpc_sync``).
"""

from __future__ import annotations

import collections
import random
import zlib
from typing import Any

import torch
from torch import Tensor

import distgrad.rpc as dgrpc
from distgrad.errors import UnknownContextError
from tests._support import seeded

Program = dict[str, Any]

UNARY = (torch.sin, torch.tanh, lambda x: x * 1.5, lambda x: torch.exp(-0.5 * x * x))
BINARY = (torch.mul, torch.add, lambda x, y: x - 0.5 * y, lambda x, y: torch.sin(x) * y)
SHAPE = (3,)

# Per process: the leaves the ``param`` ops made, and hook calls (with and without a gradient).
params: dict[str, Tensor] = {}
hook_calls: collections.Counter[str] = collections.Counter()
hook_nones: collections.Counter[str] = collections.Counter()


def make_program(rng: random.Random, workers: list[str], depth: int, n_inputs: int) -> Program:
    """A random call of ``n_inputs`` tensors that makes nested calls up to ``depth`` deep."""
    ops: list[dict[str, Any]] = []
    n = n_inputs
    made: list[int] = []  # indices of tensors computed here (not params, not inputs)
    for _ in range(rng.randint(2, 5)):
        roll = rng.random()
        hooked = rng.random() < 0.3
        if roll < 0.15:
            ops.append({"kind": "param"})
            n += 1
            continue
        if roll < 0.45:
            ops.append({"kind": "unary", "fn": rng.randrange(len(UNARY)), "x": rng.randrange(n)})
        elif roll < 0.7 or depth == 0:
            x, y = rng.randrange(n), rng.randrange(n)
            ops.append({"kind": "binary", "fn": rng.randrange(len(BINARY)), "x": x, "y": y})
        else:
            args = rng.sample(range(n), rng.randint(1, min(3, n)))
            sub = make_program(rng, workers, depth - 1, len(args))
            ops.append({"kind": "call", "to": rng.choice(workers), "sub": sub, "args": args})
            made.extend(range(n, n + len(sub["ret"])))
            n += len(sub["ret"])
            # No hook on a call's results: the caller's copy is not the callee's tensor (as it
            # is locally), so a hook there would see a different gradient by design.
            ops[-1]["hooked"] = False
            continue
        ops[-1]["hooked"] = hooked
        made.append(n)
        n += 1
    if not made:  # every call returns at least one computed tensor
        ops.append({"kind": "unary", "fn": 0, "x": rng.randrange(n), "hooked": False})
        made.append(n)
    ret = rng.sample(made, rng.randint(1, min(3, len(made))))
    return {"ops": ops, "ret": ret}


def run_program(program: Program, inputs: list[Tensor], path: str, local: bool) -> list[Tensor]:
    """Run one call of a program. ``path`` (``run|op.op...``) names its ops: hooks count per
    run, params are seeded by the part after ``|``, the same in every run."""
    t = list(inputs)
    for k, op in enumerate(program["ops"]):
        label = f"{path}.{k}"
        kind = op["kind"]
        if kind == "param":
            t.append(_param(label))
            continue
        if kind == "unary":
            out = [UNARY[op["fn"]](t[op["x"]])]
        elif kind == "binary":
            out = [BINARY[op["fn"]](t[op["x"]], t[op["y"]])]
        else:
            args = ([t[i] for i in op["args"]],)
            call_args = (op["sub"], *args, label, local)
            if local:
                out = run_program(*call_args)
            else:
                out = dgrpc.rpc_sync(op["to"], run_program, args=call_args)
        if op["hooked"]:
            for j, tensor in enumerate(out):
                tensor.register_hook(_halving_hook(f"{label}/{j}"))
        t.extend(out)
    return [t[i] for i in program["ret"]]


def _param(label: str) -> Tensor:
    g = seeded(zlib.crc32(label.split("|")[1].encode()))
    params[label] = torch.randn(*SHAPE, dtype=torch.float64, generator=g, requires_grad=True)
    return params[label]


def _halving_hook(key: str) -> Any:
    def hook(grad: Tensor | None) -> Tensor | None:
        if grad is None:  # SMART calls hooks of held nodes with None (docs/rpc.md)
            hook_nones[key] += 1
            return None
        hook_calls[key] += 1
        return grad * 0.5

    return hook


def param_grads(context_id: int, prefix: str) -> dict[str, Tensor]:
    """The gradients, in ``context_id``, of this worker's params whose labels start with
    ``prefix``."""
    try:
        grads = dgrpc.get_gradients(context_id)
    except UnknownContextError:  # the program never reached this worker
        return {}
    return {k: grads[p] for k, p in params.items() if k.startswith(prefix) and p in grads}


def counts(prefix: str) -> dict[str, int]:
    return {k: c for k, c in hook_calls.items() if k.startswith(prefix)}


def forget(prefix: str) -> None:
    for store in (params, hook_calls, hook_nones):
        for key in [k for k in store if k.startswith(prefix)]:
            del store[key]
