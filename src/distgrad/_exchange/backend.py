"""Backend choices: which c10d call moves the data on each backend, at which size, and the quirks
each backend has. Every exchange of ``distgrad._exchange.ops`` takes its choices from here, so
no backward ever branches on the backend and the CPU tests exercise the code that runs on GPUs.

Backend gaps handled with what is here:

* On gloo, ``reduce_scatter`` runs one ``all_to_all`` (each rank sends every other rank that
  rank's slice, (N-1)/N of the tensor) and sums the N slices it receives locally, at every
  size. gloo's own reduce-scatter is never used: a wait on its work does not return at the
  wait's timeout, so the dead-peer watch could not run (``ops/reduce_scatter.py``). NCCL's
  native reduce-scatter is used where it applies (equal sizes).
* gloo's ``all_gather`` is slower than the same exchange written as concurrent point-to-point
  pairs, so on gloo it is a batch of isend/irecv (which also takes unequal sizes as they are),
  except below :data:`GLOO_COLLECTIVE_BELOW_BYTES` per rank with equal sizes, where latency,
  not bandwidth, sets the time and gloo's own is faster. gloo's ``all_to_all`` is used below
  :data:`GLOO_ALL_TO_ALL_BELOW_BYTES`, pairs above.
* gloo's ``gather``/``scatter`` (and NCCL's ``all_gather``) reject unequal sizes; unequal sizes
  are padded to the largest and trimmed after (:func:`pad_rows`, :func:`trim_cat`).
* On gloo every exchange calls the process group's own methods (``pg.send``, ``pg.allreduce``,
  ...) with group ranks and the option objects made once here, not the ``torch.distributed``
  wrappers: ``dist.P2POp`` with ``dist.batch_isend_irecv`` cost about 250 us of Python per
  exchange and ``dist.all_reduce`` about 24 us over ``pg.allreduce``, for checks distgrad has
  already made. NCCL keeps the wrappers (``batch_isend_irecv`` groups its pairs into one NCCL
  group call).
* gloo moves CUDA tensors through host memory for some collectives and not at all for others
  (point-to-point sends abort the process, some reduce ops are refused), so on gloo every
  exchange of a CUDA tensor is staged (:func:`on_host`; ``distgrad._exchange.inflight``).
* gloo moves real numbers: a complex tensor travels as its real view (:func:`real`).
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor
from torch._C._distributed_c10d import AllgatherOptions, AllreduceOptions, AllToAllOptions

from distgrad._exchange.group import Group

__all__ = [
    "ALL_GATHER_OPTIONS",
    "ALL_REDUCE_OPTIONS",
    "ALL_TO_ALL_OPTIONS",
    "GLOO_ALL_TO_ALL_BELOW_BYTES",
    "GLOO_COLLECTIVE_BELOW_BYTES",
    "GLOO_COLLECTIVE_DTYPES",
    "REDUCE_OPS",
    "all_gather_single",
    "leading",
    "metadata_device",
    "nbytes",
    "on_host",
    "options",
    "pad_rows",
    "real",
    "reduce_scatter_single",
    "trim_cat",
    "use_gloo_all_gather",
]

REDUCE_OPS = {
    "sum": dist.ReduceOp.SUM,
    "prod": dist.ReduceOp.PRODUCT,
    "max": dist.ReduceOp.MAX,
    "min": dist.ReduceOp.MIN,
}


@functools.cache
def options(kind: Any, **fields: Any) -> Any:
    """A c10d options object for an asynchronous call, made once per kind and fields and
    reused (the backends read it and keep nothing of it; making one costs 0.7-1.1 us)."""
    opts = kind()
    opts.asyncOp = True
    for name, value in fields.items():
        setattr(opts, name, value)
    return opts


ALL_REDUCE_OPTIONS = {op: options(AllreduceOptions, reduceOp=rop) for op, rop in REDUCE_OPS.items()}
ALL_GATHER_OPTIONS = options(AllgatherOptions)
ALL_TO_ALL_OPTIONS = AllToAllOptions()


# torch 2.13 renamed the tensor forms of all_gather and reduce_scatter (the old names warn);
# torch >= 2.3 without the new names keeps working through the old ones.
all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def metadata_device(group: Group) -> torch.device:
    """Where small bookkeeping tensors must live for this group's backend."""
    if group.is_nccl:
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def nbytes(x: Tensor) -> int:
    return x.numel() * x.element_size()


def real(x: Tensor) -> Tensor:
    """gloo moves real numbers: a complex tensor travels as its (..., 2) real view."""
    return torch.view_as_real(x) if x.is_complex() else x


def pad_rows(x: Tensor, rows: int) -> Tensor:
    """``x`` with zero rows after its own, ``rows`` in all."""
    if not isinstance(x.shape[0], int):
        # A per-rank row count (simulate=True: one SymInt holding every rank's): each rank
        # pads by its own, with no branch on which ranks need it.
        return torch.cat([x, x.new_zeros((rows - x.shape[0], *x.shape[1:]))])
    if x.shape[0] == rows:
        return x.contiguous()
    out = x.new_zeros((rows, *x.shape[1:]))
    out[: x.shape[0]] = x
    return out


def trim_cat(padded: Tensor, sizes: Sequence[int]) -> Tensor:
    """[N * max, ...] padded blocks -> the concatenation of the first sizes[i] rows of block i."""
    width = max(sizes)
    if all(s == width for s in sizes):
        return padded
    blocks = padded.view(len(sizes), width, *padded.shape[1:])
    return torch.cat([blocks[i, :s] for i, s in enumerate(sizes)])


def on_host(group: Group, device: torch.device) -> bool:
    """Whether a tensor on ``device`` is staged through host memory to cross ``group``."""
    return group.pg is not None and not group.is_nccl and device.type != "cpu"


# Below this many bytes per rank, gloo's all_gather finishes sooner than concurrent
# point-to-point pairs; from there on the pairs win. Measured on 2 ranks over loopback,
# forward+backward, 300-400 paired rounds: an all_gather of 64-128 KB per rank 0.87x-0.94x the
# pairs' time; at 256 KB 0.94x-1.05x, at 512 KB 1.16x, at 2 MB 1.29x-1.35x.
# (docs/semantics.md, "How the data moves on gloo".)
GLOO_COLLECTIVE_BELOW_BYTES = 256 * 1024

# The dtypes gloo's all_gather and all_to_all take; others go as pairs (which move any dtype).
GLOO_COLLECTIVE_DTYPES = frozenset(
    {
        torch.float32,
        torch.float64,
        torch.float16,
        torch.bfloat16,
        torch.int32,
        torch.int64,
        torch.int8,
        torch.uint8,
    }
)


def use_gloo_all_gather(piece: Tensor, sizes: Sequence[int]) -> bool:
    """Whether an all_gather on gloo whose per-rank piece is ``piece`` goes through gloo's own
    all_gather: small, equal sizes, a dtype gloo takes."""
    return (
        piece.dtype in GLOO_COLLECTIVE_DTYPES
        and nbytes(piece) < GLOO_COLLECTIVE_BELOW_BYTES
        and sizes.count(sizes[0]) == len(sizes)
    )


# Below this many bytes of input per rank, gloo's own all_to_all beats concurrent
# point-to-point pairs (uneven sizes included); at 64 MB they are even. Measured raw, forward
# only, 10-30 paired rounds, gloo's time over the pairs': 2 ranks 0.82x at 256 KB, 0.60x at
# 1 MB, 0.69x at 4 MB, 0.74x at 16 MB, 1.08x at 64 MB; 4 ranks 0.74x, 0.91x, 0.74x, 0.73x,
# 1.01x. (An earlier note had the pairs at half gloo's time at 16 MB on 2 ranks: not reproduced.)
GLOO_ALL_TO_ALL_BELOW_BYTES = 32 * 1024 * 1024


def leading(flat: Tensor, shape: Sequence[int]) -> Tensor:
    """The first entries of the flat, contiguous ``flat`` as a tensor of ``shape``: the data
    before a guard's tag (``as_strided``: 1.5 us where slicing and ``view`` take 6-9 us)."""
    strides, stride = [], 1
    for size in reversed(shape):
        strides.append(stride)
        stride *= max(size, 1)
    return flat.as_strided(tuple(shape), strides[::-1])
