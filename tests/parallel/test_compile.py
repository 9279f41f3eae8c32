"""torch.compile(fullgraph=True): the tensor-parallel layers, ring attention and the
synchronized batch norm each trace into one graph with no break and no recompilation, and
give eager's values and gradients.

Semantics asserted: the compiled step is the same function as the eager step, so its loss and
input gradients equal eager's (float64; 1e-9 relative, as tests/compile allows the compiler
to reorder arithmetic); ``fullgraph=True`` makes a graph break an error and dynamo's counters
show one graph per step; after the first compilation a second one is an error, and each step
runs on fresh data twice. The
default suite compiles with the ``aot_eager`` backend (AOTAutograd traces forward and
backward, no code generation: seconds); the inductor variant is marked slow (minutes on 2
cores). MoE routing is not compiled: ``route`` reads the split sizes on the host
(docs/patterns.md).
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor

import distgrad as dg
from distgrad import parallel as P
from distgrad.testing import run_on_ranks
from tests._support import COMPILED, seeded

Step = Callable[..., Tensor]


def _steps(rank: int, n: int) -> dict[str, tuple[Step, list[tuple[int, ...]]]]:
    """Each pattern's step and its inputs' shapes (4 rows per rank, 2 hidden features each)."""
    sizes = [4] * n
    cols = slice(2 * rank, 2 * rank + 2)
    norm = P.SyncBatchNorm(3, dtype=torch.float64)

    def tensor_parallel(x: Tensor, w1: Tensor, w2: Tensor, v: Tensor) -> Tensor:
        h = P.column_parallel_linear(x, w1[cols], None, sequence_parallel=True, sizes=sizes)
        y = P.row_parallel_linear(F.gelu(h), w2[:, cols], sequence_parallel=True, sizes=sizes)
        whole = dg.all_gather(x, sizes=sizes, objective="replicated")
        h2 = P.column_parallel_linear(whole, w1[cols], objective="replicated")
        z = P.row_parallel_linear(F.gelu(h2), w2[:, cols], objective="replicated")
        return (y * v).sum() + (z[4 * rank : 4 * rank + 4] * v).sum()

    def ring(q: Tensor, k: Tensor, v: Tensor, cot: Tensor) -> Tensor:
        full = P.ring_attention(q, k, v, sizes=sizes)
        causal = P.ring_attention(q, k, v, causal=True, sizes=sizes)
        return (full * cot).sum() + (causal * cot.flip(-1)).sum()

    def batch_norm(x: Tensor, v: Tensor) -> Tensor:
        return (norm(x) * v).sum()

    return {
        "tensor_parallel": (tensor_parallel, [(4, 5), (2 * n, 5), (5, 2 * n), (4, 5)]),
        "ring_attention": (ring, [(1, 2, 4, 3)] * 4),
        "sync_batch_norm": (batch_norm, [(4, 3, 2), (4, 3, 2)]),
    }


def _compiled_matches_eager(rank: int, n: int, backend: str) -> dict[str, int]:
    # Two ranks on two cores: inductor's pool of compile workers costs more than it saves.
    torch._inductor.config.compile_threads = 1
    gen = seeded(rank)
    found = {}
    for name, (step, shapes) in _steps(rank, n).items():
        torch._dynamo.reset()
        torch._dynamo.utils.counters.clear()
        torch._dynamo.config.error_on_recompile = False

        def inputs(shapes: list[tuple[int, ...]] = shapes) -> list[Tensor]:
            return [
                torch.randn(s, dtype=torch.float64, generator=gen, requires_grad=True)
                for s in shapes
            ]

        # fullgraph=True: a graph break raises, so each step compiles to exactly one graph.
        compiled = torch.compile(step, fullgraph=True, backend=backend)
        for i in range(2):
            args = inputs()
            want = step(*args)
            want_grads = torch.autograd.grad(want, args)
            got = compiled(*args)
            got_grads = torch.autograd.grad(got, args)
            torch.testing.assert_close(
                got, want, **COMPILED, msg=lambda m, c=f"{name} {i}": f"{c}: {m}"
            )
            for g, w in zip(got_grads, want_grads, strict=True):
                torch.testing.assert_close(
                    g, w, **COMPILED, msg=lambda m, c=name: f"{c} gradient: {m}"
                )
            torch._dynamo.config.error_on_recompile = True  # a second compilation raises
        found[name] = torch._dynamo.utils.counters["stats"]["unique_graphs"]
        torch._dynamo.utils.counters.clear()
    return found


def test_parallel_patterns_compile_to_one_graph_and_match_eager() -> None:
    for found in run_on_ranks(_compiled_matches_eager, 2, args=("aot_eager",), timeout=100):
        assert found == dict.fromkeys(found, 1) and len(found) == 3, found


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_parallel_patterns_compile_with_inductor_and_match_eager() -> None:
    for found in run_on_ranks(_compiled_matches_eager, 2, args=("inductor",), timeout=800):
        assert found == dict.fromkeys(found, 1) and len(found) == 3, found
