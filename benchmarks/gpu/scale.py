"""Part ``scale``: contrastive losses at the batch sizes people train, on one GPU.

CLIP and SigLIP forward+backward, world size 1, float32 features, global batch 32k, 128k and 1M
and dim 512 and 768: the fused Triton kernels (``dg.losses.set_kernels("triton")``), distgrad's
torch ring (``set_kernels("torch")``), both with ``block_size=4096``; the dense path and plain
torch (one logits matrix) where their logits fit; Inf-CL (``pip install inf_cl``, its own
package, run as a peer) for CLIP where it is installed. Each row: the median time of 3 calls
after a warm-up, and the peak memory above the inputs, per row of the batch (features'
gradients included), plus the total. CPU mode: batches 256 and 512, dim 32, block 64, and no
kernel or Inf-CL rows (the kernels are tested on CPU under Triton's interpreter instead).
"""

from __future__ import annotations

import importlib.util
import statistics
import time
from collections.abc import Callable

import torch
from torch import Tensor

import distgrad as dg

from .ranks import short
from .report import Section

Loss = Callable[[Tensor, Tensor, Tensor, Tensor], Tensor]
DENSE_LIMIT = 40 * 2**30  # bytes of logits (and their gradient) the dense rows may take


def _plain(name: str) -> Loss:
    def clip(x: Tensor, y: Tensor, s: Tensor, b: Tensor) -> Tensor:
        x, y = torch.nn.functional.normalize(x, dim=1), torch.nn.functional.normalize(y, dim=1)
        logits = s * x @ y.T
        labels = torch.arange(len(x), device=x.device)
        ce = torch.nn.functional.cross_entropy
        return (ce(logits, labels) + ce(logits.T, labels)) / 2

    def siglip(x: Tensor, y: Tensor, s: Tensor, b: Tensor) -> Tensor:
        x, y = torch.nn.functional.normalize(x, dim=1), torch.nn.functional.normalize(y, dim=1)
        logits = s * x @ y.T + b
        z = 2 * torch.eye(len(x), device=x.device) - 1
        return -torch.nn.functional.logsigmoid(z * logits).sum() / len(x)

    return clip if name == "clip" else siglip


def _distgrad(name: str, block: int | None) -> Loss:
    def loss(x: Tensor, y: Tensor, s: Tensor, b: Tensor) -> Tensor:
        if name == "clip":
            return dg.losses.clip_loss(x, y, s, sizes=[len(x)], block_size=block)
        return dg.losses.siglip_loss(x, y, s, b, sizes=[len(x)], block_size=block)

    return loss


def _inf_cl() -> Loss | None:
    if importlib.util.find_spec("inf_cl") is None:
        return None
    from inf_cl import cal_inf_loss  # type: ignore[import-not-found]

    def loss(x: Tensor, y: Tensor, s: Tensor, b: Tensor) -> Tensor:
        x, y = torch.nn.functional.normalize(x, dim=1), torch.nn.functional.normalize(y, dim=1)
        labels = torch.arange(len(x), device=x.device)
        # Inf-CL computes one direction per call: CLIP's two are two calls.
        forward = cal_inf_loss(x, y, labels, scale=s).mean()
        return (forward + cal_inf_loss(y, x, labels, scale=s).mean()) / 2

    return loss


def _measure(fn: Loss, batch: int, dim: int, device: torch.device) -> str:
    g = torch.Generator().manual_seed(0)
    x, y = (torch.randn(batch, dim, generator=g).to(device).requires_grad_() for _ in "xy")
    s = torch.tensor(10.0, device=device, requires_grad=True)
    b = torch.tensor(-10.0, device=device, requires_grad=True)
    cuda = device.type == "cuda"
    times = []
    peak_bytes = float("nan")
    for i in range(4):
        for t in (x, y, s, b):
            t.grad = None
        if cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            base = torch.cuda.memory_allocated()
        start = time.perf_counter()
        fn(x, y, s, b).backward()
        if cuda:
            torch.cuda.synchronize()
            if i == 0:  # above the inputs, plus the features themselves (x and y)
                peak_bytes = torch.cuda.max_memory_allocated() - base + 2 * x.numel() * 4
        if i:
            times.append((time.perf_counter() - start) * 1e3)
    shown = f"{statistics.median(times):.1f} ms"
    if peak_bytes == peak_bytes:  # measured (CUDA)
        shown += f", peak {peak_bytes / batch / 1024:.1f} KB/row ({peak_bytes / 2**30:.2f} GiB)"
    return shown


def part(device: str, gpus: int) -> Section:
    cuda = device == "cuda"
    batches = (32768, 131072, 1048576) if cuda else (256, 512)
    dims = (512, 768) if cuda else (32,)
    block = 4096 if cuda else 64
    section = Section(
        "scale",
        "CLIP and SigLIP forward+backward on one device at world size 1, float32 features: "
        f"the fused kernels and the torch ring (`block_size={block}`), the dense path and "
        "plain torch where their logits fit, Inf-CL where installed. Median of 3 timed calls "
        "after a warm-up; peak memory per row of the batch, the features and their gradients "
        "included (`max_memory_allocated` above the inputs, plus the inputs; CUDA only).",
        ("loss", "global batch", "dim", "variant", "result"),
    )
    where = torch.device("cuda" if cuda else "cpu")
    inf_cl = _inf_cl() if cuda else None
    for name in ("clip", "siglip"):
        for dim in dims:
            for batch in batches:
                variants: dict[str, Loss | str] = {}
                if cuda:
                    variants["fused kernels"] = "triton"
                variants["torch ring"] = "torch"
                fits = 2 * batch * batch * 4 <= DENSE_LIMIT
                variants["dense"] = _distgrad(name, None) if fits else "too big"
                variants["plain torch"] = _plain(name) if fits else "too big"
                if name == "clip":
                    variants["Inf-CL"] = inf_cl if inf_cl is not None else "absent"
                for label, how in variants.items():
                    row = (name, str(batch), str(dim), label)
                    if how == "too big":
                        gib = 2 * batch * batch * 4 / 2**30
                        section.rows.append((*row, f"not run: its logits need {gib:.0f} GiB"))
                        continue
                    if how == "absent":
                        section.rows.append((*row, "not run: inf_cl is not installed"))
                        continue
                    try:
                        if how in ("triton", "torch"):
                            dg.losses.set_kernels(how)  # type: ignore[arg-type]
                            fn = _distgrad(name, block)
                        else:
                            dg.losses.set_kernels("torch")
                            fn = how  # type: ignore[assignment]
                        section.rows.append((*row, _measure(fn, batch, dim, where)))
                    except Exception as exc:  # the other rows still run
                        section.rows.append((*row, f"FAIL: {short(exc)}"))
                    finally:
                        dg.losses.set_kernels()
                        if cuda:
                            torch.cuda.empty_cache()
    return section
