"""The distributed autograd design note's example, written against distgrad.rpc.

worker0 sends t1 and t2 to worker1, which adds them; worker0 multiplies the result by t4 and
runs a distributed backward. Gradients land in the context on the worker that owns each tensor
(here all on worker0), and are checked against plain autograd in one process.

Run: python examples/rpc_design_note.py
"""

from __future__ import annotations

import torch

import distgrad.rpc as dgrpc
from distgrad.testing import run_on_ranks


def my_add(t1: torch.Tensor, t2: torch.Tensor) -> torch.Tensor:
    return torch.add(t1, t2)


def worker(rank: int, world_size: int) -> str:
    if rank != 0:
        return ""  # worker1 only serves requests until every worker shuts down
    g = torch.Generator().manual_seed(0)
    t1 = torch.rand((3, 3), generator=g, requires_grad=True)
    t2 = torch.rand((3, 3), generator=g, requires_grad=True)
    t4 = torch.rand((3, 3), generator=g, requires_grad=True)
    with dgrpc.context() as context_id:
        t3 = dgrpc.rpc_sync("worker1", my_add, args=(t1, t2))  # records send/recv pairs
        t5 = torch.mul(t3, t4)
        loss = t5.sum()
        dgrpc.backward(context_id, [loss])
        grads = dgrpc.get_gradients(context_id)  # {t1: ..., t2: ..., t4: ...}
    assert t1.grad is None  # a distributed backward never writes .grad
    # The same computation in one process.
    r1, r2, r4 = (t.detach().clone().requires_grad_() for t in (t1, t2, t4))
    (torch.add(r1, r2) * r4).sum().backward()
    for _name, mine, ref in (("t1", t1, r1), ("t2", t2, r2), ("t4", t4, r4)):
        torch.testing.assert_close(grads[mine], ref.grad)
    return f"gradients of t1, t2, t4 match local autograd; dloss/dt1 =\n{grads[t1]}"


if __name__ == "__main__":
    print(run_on_ranks(worker, 2, init="rpc")[0])
