"""The public distributed backward: checks its arguments, then runs FAST or SMART."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal

import torch
from torch import Tensor

from distgrad.errors import RpcAutogradError
from distgrad.rpc import _identity, fast, smart
from distgrad.rpc._context import lookup
from distgrad.rpc._pass import pass_error
from distgrad.rpc._storage import memory_of

__all__ = ["backward"]

# torch's TypeError for a call of its C++ backward with arguments of the wrong types: programs
# and torch's own tests match these words, so they come first.
_TORCH_WORDS = "incompatible function arguments"


def backward(
    context_id: int,
    roots: Sequence[Tensor],
    retain_graph: bool = False,
    *,
    grad_tensors: Sequence[Tensor | None] | None = None,
    mode: Literal["fast", "smart"] = "fast",
    timeout: float | None = None,
) -> None:
    """Run a distributed backward pass from ``roots``, which must live on this worker.

    The positional signature is torch's: ``backward(context_id, roots, retain_graph=False)``.
    Every root must be a scalar that has a gradient function, unless ``grad_tensors[i]`` gives
    the gradient of ``roots[i]`` (a distgrad extension; ``None`` means ones, allowed for scalars
    only). Gradients of every worker's leaves accumulate in the context (:func:`get_gradients`
    on that worker); ``.grad`` is never written. With ``retain_graph=False`` the context's
    graph may not be back-propagated again.

    ``mode="fast"`` (the default) ships every gradient on as it arrives; ``mode="smart"`` first
    finds which send/recv pairs lie on a path to the roots and runs every node of every worker
    once (see docs/rpc.md). ``timeout`` (seconds, default: the RPC timeout) bounds the pass.

    Cost (FAST): one RPC per recv node the pass reaches, except those whose gradients ride back
    in the answer to a gradient message; no extra messages. SMART adds one lineage query per
    worker per round of the lineage search.

    Raises :class:`~distgrad.errors.RpcAutogradError` (a ``RuntimeError``) for invalid roots,
    naming the worker where a failure started (an exception in a backward function, a dead or
    unreachable worker, a timeout), and :class:`~distgrad.errors.UnknownContextError` for an
    unknown context id; ``TypeError`` and ``ValueError`` for arguments of the wrong type or
    shape. A refused call changes nothing in the context.

    Args:
        context_id: the context's id, as ``context()`` gave it.
        roots: the tensors to back-propagate from, on this worker.
        retain_graph: keep the context's graph for another backward.
        grad_tensors: the gradient of each root (None: ones, for a scalar root).
        mode: ``"fast"`` or ``"smart"`` (docs/rpc.md).
        timeout: seconds the pass may take (default: the RPC timeout).

    Returns:
        None; the gradients are in the context (``get_gradients`` on each worker).

    Raises:
        RpcAutogradError: invalid roots, or the pass failed (an exception in a backward function, a
            dead or unreachable worker, a timeout), naming the worker where it started.
        UnknownContextError: the id is not a live context on this worker.
        TypeError: an argument of the wrong type.
        ValueError: an unknown ``mode``; ``grad_tensors`` of another length than ``roots``, or
            an entry of another shape than its root.

    Example:
        >>> x = torch.tensor([1.0, 2.0], requires_grad=True)
        >>> with dg.rpc.context() as context_id:
        ...     y = dg.rpc.rpc_sync("worker0", torch.exp, args=(x,))
        ...     dg.rpc.backward(context_id, [y], grad_tensors=[torch.ones(2)], mode="smart")
        ...     torch.allclose(dg.rpc.get_gradients(context_id)[x], x.exp())
        True
    """
    if isinstance(context_id, bool) or not isinstance(context_id, int):
        raise TypeError(
            f"{_TORCH_WORDS}: backward: context_id must be an int, got {type(context_id).__name__}"
        )
    if not isinstance(retain_graph, bool):
        raise TypeError(
            f"backward: retain_graph must be a bool, got {type(retain_graph).__name__}; the "
            "third positional argument is retain_graph, as in torch.distributed.autograd."
            "backward: pass gradients of non-scalar roots as grad_tensors=[...]"
        )
    if mode not in ("fast", "smart"):
        raise ValueError(f"backward: mode must be 'fast' or 'smart', got {mode!r}")
    ctx = lookup(context_id)
    outputs, grads, given = _check_roots(roots, grad_tensors)
    with ctx.lock:
        if ctx.graph_freed:
            raise RpcAutogradError(
                f"backward: context {context_id}'s graph was already back-propagated with "
                "retain_graph=False; pass retain_graph=True to the first backward to run another"
            )
    budget = _identity.rpc_timeout() if timeout is None else timeout
    foreign = frozenset(k for g in given for k in memory_of(g))
    pass_id = _identity.new_id()
    try:
        if mode == "smart":
            smart.run_from_roots(ctx, pass_id, budget, outputs, grads, retain_graph, foreign)
        else:
            fast.run_from_roots(ctx, pass_id, budget, outputs, grads, foreign)
    except Exception as exc:
        raise pass_error(exc, _identity.worker_name()) from None
    if not retain_graph:
        with ctx.lock:
            ctx.graph_freed = True


def _check_roots(
    roots: Sequence[Tensor], grad_tensors: Sequence[Tensor | None] | None
) -> tuple[list[Tensor], list[Tensor], list[Tensor]]:
    """The roots, their gradients, and the gradients the user gave (which they still hold)."""
    if isinstance(roots, Tensor):
        roots = [roots]
    if not isinstance(roots, (list, tuple)):
        raise TypeError(
            f"{_TORCH_WORDS}: backward: roots must be a list of tensors, got {type(roots).__name__}"
        )
    if not roots:
        raise RpcAutogradError(
            "backward: no tensors provided for gradient computation (roots is empty)"
        )
    if grad_tensors is None:
        grad_tensors = [None] * len(roots)
    elif isinstance(grad_tensors, Tensor):
        grad_tensors = [grad_tensors]
    if len(grad_tensors) != len(roots):
        raise ValueError(f"backward: got {len(roots)} roots but {len(grad_tensors)} grad_tensors")
    outputs: list[Tensor] = []
    grads: list[Tensor] = []
    for i, (root, grad) in enumerate(zip(roots, grad_tensors, strict=True)):
        outputs.append(_check_root(i, root))
        grads.append(_grad_of(i, root, grad))
    return outputs, grads, [g for g in grad_tensors if g is not None]


def _check_root(i: int, root: Tensor) -> Tensor:
    if not isinstance(root, Tensor):
        raise TypeError(f"backward: roots[{i}] is a {type(root).__name__}, not a Tensor")
    if not root.requires_grad:
        raise RpcAutogradError(f"backward: requires_grad not set on roots[{i}]")
    if root.grad_fn is None:
        raise RpcAutogradError(
            f"backward: roots[{i}] does not have a valid gradient function: it is a leaf, and a "
            "distributed backward starts from tensors computed from others"
        )
    return root


def _grad_of(i: int, root: Tensor, grad: Tensor | None) -> Tensor:
    if grad is None:
        if root.numel() != 1:
            raise RpcAutogradError(
                f"backward: roots[{i}] has shape {tuple(root.shape)}, not a scalar; all roots "
                "need to be scalars unless grad_tensors gives their gradients"
            )
        return torch.ones_like(root)
    if grad.shape != root.shape:
        raise ValueError(
            f"backward: grad_tensors[{i}] has shape {tuple(grad.shape)} but roots[{i}] "
            f"has shape {tuple(root.shape)}"
        )
    return grad
