"""The peers' own loss classes, from the installed packages, loaded without their heavy imports.

None of the three is a dependency of distgrad; CI installs them without their dependencies
(``pip install --no-deps open_clip_torch==3.3.0 lightly==1.6.0 sentence-transformers==6.2.0``),
and the tests that need one skip without it. Each package's ``__init__`` pulls torchvision
(open_clip, lightly's ``lightly.loss``) or transformers (sentence-transformers), which are
not installed, so only the loss files are executed, by path:

* open_clip: ``open_clip/loss.py`` imports torch alone (horovod inside a ``try``);
* lightly: ``lightly/loss/barlow_twins_loss.py`` imports torch alone;
  ``lightly/loss/ntx_ent_loss.py`` imports ``lightly.utils.dist`` (torch alone, imported as
  it is) and ``lightly.models.modules.memory_bank``, whose module imports torchvision: it is
  given here as a bank of size 0 (``forward`` returns the output and no negatives, as
  lightly's does at size 0), the only size the drop-in accepts;
* sentence-transformers: ``tests/losses/mnrl.py`` (its stubs, and why). The cached loss,
  ``cached_multiple_negatives_ranking.py``, also imports ``base/losses/gradcache.py`` (executed
  by path too: torch, packaging) and tqdm (not installed: given as a bar that draws nothing);
  its constructor's check for a ``StaticEmbedding`` model reads the package's model modules
  (transformers), so it is replaced by ``False`` (the tests' encoder is a linear layer).
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

from torch import Tensor, nn

from tests.losses import mnrl

__all__ = [
    "LIGHTLY",
    "OPEN_CLIP",
    "installed",
    "lightly_loss",
    "open_clip_loss",
    "st_cached_loss",
    "st_loss",
]

OPEN_CLIP = "open_clip_torch==3.3.0"
LIGHTLY = "lightly==1.6.0"
_CACHE: dict[str, ModuleType] = {}


def _package_dir(name: str) -> Path | None:
    spec = importlib.util.find_spec(name)
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(next(iter(spec.submodule_search_locations)))


def installed(package: str) -> bool:
    """Whether ``package`` (open_clip, lightly, sentence_transformers) is installed."""
    if package == "sentence_transformers":
        return mnrl.loss_module_path() is not None
    return _package_dir(package) is not None


def _exec(name: str, path: Path, stubs: dict[str, ModuleType]) -> ModuleType:
    saved = {n: sys.modules.get(n) for n in stubs}
    sys.modules.update(stubs)
    try:
        spec = importlib.util.spec_from_file_location(name, path)
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    finally:
        for n, was in saved.items():
            if was is None:
                sys.modules.pop(n, None)
            else:
                sys.modules[n] = was
    return module


def open_clip_loss() -> ModuleType:
    """open_clip's ``loss.py`` (``ClipLoss``, ``SigLipLoss``)."""
    if "open_clip" not in _CACHE:
        root = _package_dir("open_clip")
        assert root is not None, f"open_clip is not installed ({OPEN_CLIP})"
        _CACHE["open_clip"] = _exec("peer_open_clip_loss", root / "loss.py", {})
    return _CACHE["open_clip"]


class _NoBank(nn.Module):
    """lightly's ``MemoryBankModule`` at size 0: the output, and no negatives."""

    def __init__(self, size: Any = 0, gather_distributed: bool = False) -> None:
        super().__init__()
        assert size in (0, (0,)), "the stand-in bank has size 0 only"

    def forward(self, output: Tensor, labels: Any = None, update: bool = False) -> Any:
        return output, None


def lightly_loss() -> ModuleType:
    """lightly's ``NTXentLoss`` and ``BarlowTwinsLoss``, as one module's attributes."""
    if "lightly" not in _CACHE:
        root = _package_dir("lightly")
        assert root is not None, f"lightly is not installed ({LIGHTLY})"
        import lightly.utils.dist  # torch alone

        bank = ModuleType("lightly.models.modules.memory_bank")
        bank.MemoryBankModule = _NoBank  # type: ignore[attr-defined]
        stubs = {"lightly.models.modules.memory_bank": bank}
        for parent in ("lightly.models", "lightly.models.modules"):
            stubs[parent] = ModuleType(parent)
        stubs["lightly.utils.dist"] = lightly.utils.dist
        ntx = _exec("peer_lightly_ntx_ent", root / "loss" / "ntx_ent_loss.py", stubs)
        bt = _exec("peer_lightly_barlow", root / "loss" / "barlow_twins_loss.py", {})
        both = ModuleType("peer_lightly_loss")
        both.NTXentLoss = ntx.NTXentLoss  # type: ignore[attr-defined]
        both.BarlowTwinsLoss = bt.BarlowTwinsLoss  # type: ignore[attr-defined]
        _CACHE["lightly"] = both
    return _CACHE["lightly"]


def st_loss() -> ModuleType:
    """sentence-transformers' ``multiple_negatives_ranking.py`` (``tests/losses/mnrl.py``)."""
    if "st" not in _CACHE:
        _CACHE["st"] = mnrl._load()
    return _CACHE["st"]


def _no_bar(iterable: Any = None, *args: Any, **kwargs: Any) -> Any:
    return iterable


def _range(*args: Any, **kwargs: Any) -> range:
    return range(*args)


def st_cached_loss() -> ModuleType:
    """sentence-transformers' ``cached_multiple_negatives_ranking.py``
    (``CachedMultipleNegativesRankingLoss``), with its gradcache module."""
    if "st_cached" not in _CACHE:
        path = mnrl.loss_module_path()
        assert path is not None, "sentence-transformers is not installed"
        root = path.parents[2]  # .../sentence_transformers
        stubs = mnrl._stubs()
        bar = ModuleType("tqdm")
        bar.tqdm = _no_bar  # type: ignore[attr-defined]
        bar.trange = _range  # type: ignore[attr-defined]
        stubs["tqdm"] = bar
        losses = "sentence_transformers.sentence_transformer.losses"
        stubs[losses] = ModuleType(losses)
        stubs[f"{losses}.multiple_negatives_ranking"] = st_loss()
        name = "sentence_transformers.base.losses.gradcache"
        stubs[name] = _exec(name, root / "base" / "losses" / "gradcache.py", stubs)
        cached = _exec(
            "peer_st_cached",
            root / "sentence_transformer" / "losses" / "cached_multiple_negatives_ranking.py",
            stubs,
        )
        cached.has_static_embedding_input = lambda model: False  # type: ignore[attr-defined]
        _CACHE["st_cached"] = cached
    return _CACHE["st_cached"]
