"""sentence-transformers' ``MultipleNegativesRankingLoss``, its own file loaded by path.

sentence-transformers is no dependency of distgrad: the tests that compare with it need its
wheel installed without its dependencies (``pip install --no-deps sentence-transformers==6.2.0``;
its ``__init__`` imports transformers, which is not installed, so the package is never
imported) and skip without it. Only ``sentence_transformer/losses/multiple_negatives_ranking.py``
is executed. Its imports from the rest of the package are given here, each the few lines of it
that ``compute_loss_from_embeddings`` reaches on dense float tensors:

* ``all_gather_with_grad``: ``torch.distributed.nn.all_gather`` and a concatenation, as
  sentence-transformers' ``util.distributed.all_gather(tensor, with_grad=True)`` does (its
  backward sums every rank's gradient of the gathered rows into their owner's, on gloo too);
* ``get_rank``: ``dist.get_rank()`` when a group is up, else 0;
* ``cos_sim``: both sides L2-normalised over the last dim, then one matmul, as its
  ``util.similarity.cos_sim`` on dense tensors;
* ``embed_columns``, ``SentenceTransformer``, ``similarity_fct_name``: never reached by
  ``compute_loss_from_embeddings`` (the model is ``None``).
"""

from __future__ import annotations

import importlib.util
import sys
import warnings
from pathlib import Path
from types import ModuleType
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor

__all__ = ["VERSION", "loss_module_path", "multiple_negatives_ranking_loss"]

VERSION = "6.2"
_FILE = "sentence_transformer/losses/multiple_negatives_ranking.py"


def loss_module_path() -> Path | None:
    """The installed file, or None when sentence-transformers is not installed (the package
    is found, not imported)."""
    spec = importlib.util.find_spec("sentence_transformers")
    if spec is None or not spec.submodule_search_locations:
        return None
    path = Path(next(iter(spec.submodule_search_locations))) / _FILE
    return path if path.is_file() else None


def _all_gather_with_grad(tensor: Tensor) -> Tensor:
    with warnings.catch_warnings():  # torch.distributed.nn is deprecated, and what it calls
        warnings.simplefilter("ignore", FutureWarning)
        import torch.distributed.nn

        return torch.cat(torch.distributed.nn.all_gather(tensor), dim=0)


def _get_rank() -> int:
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def _cos_sim(a: Tensor, b: Tensor) -> Tensor:
    return F.normalize(a, p=2, dim=-1) @ F.normalize(b, p=2, dim=-1).T


def _unreached(*args: Any, **kwargs: Any) -> Any:
    raise AssertionError("not reached by compute_loss_from_embeddings")


def _stubs() -> dict[str, ModuleType]:
    util = ModuleType("sentence_transformers.util")
    util.all_gather_with_grad = _all_gather_with_grad  # type: ignore[attr-defined]
    util.get_rank = _get_rank  # type: ignore[attr-defined]
    util.cos_sim = _cos_sim  # type: ignore[attr-defined]
    util.similarity_fct_name = _unreached  # type: ignore[attr-defined]
    merged = ModuleType("sentence_transformers.base.losses.merged_forward")
    merged.embed_columns = _unreached  # type: ignore[attr-defined]
    model = ModuleType("sentence_transformers.sentence_transformer.model")
    model.SentenceTransformer = object  # type: ignore[attr-defined]
    found = {m.__name__: m for m in (util, merged, model)}
    for name in list(found):  # the parents, empty, so that the imports resolve
        parts = name.split(".")
        for i in range(1, len(parts)):
            found.setdefault(".".join(parts[:i]), ModuleType(".".join(parts[:i])))
    return found


def _load() -> ModuleType:
    path = loss_module_path()
    assert path is not None, "sentence-transformers is not installed"
    stubs = _stubs()
    saved = {name: sys.modules.get(name) for name in stubs}
    sys.modules.update(stubs)
    try:
        spec = importlib.util.spec_from_file_location("st_multiple_negatives_ranking", path)
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    finally:
        for name, was in saved.items():
            if was is None:
                sys.modules.pop(name, None)
            else:
                sys.modules[name] = was
    return module


def multiple_negatives_ranking_loss(
    embeddings: list[Tensor],
    *,
    scale: float,
    directions: tuple[str, ...],
    partition_mode: str,
) -> Tensor:
    """sentence-transformers' loss of ``embeddings`` (queries, positives, then one tensor per
    hard-negative column), with cosine similarity and ``gather_across_devices=True``: on each
    rank, the mean over its own queries."""
    module = _load()
    loss = module.MultipleNegativesRankingLoss(
        None,
        scale=scale,
        gather_across_devices=True,
        directions=directions,
        partition_mode=partition_mode,
    )
    out: Tensor = loss.compute_loss_from_embeddings(embeddings, torch.empty(0))
    return out
