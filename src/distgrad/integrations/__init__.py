"""Drop-in losses for open_clip, sentence-transformers and lightly, exact over the global batch.

Each class takes its peer's constructor arguments and forward signature, so a training script
changes one import line::

    from open_clip.loss import ClipLoss                      # before
    from distgrad.integrations.open_clip import ClipLoss     # after

and computes the loss of one process on the whole global batch, whatever the peer's
distributed flags say (``local_loss``, ``gather_with_grad``, ``gather_across_devices``,
``gather_distributed``): every rank returns the global mean loss, and DistributedDataParallel's
averaging gives exactly the single-process gradient (docs/losses.md, "The gradient contract").
An option that cannot be honoured exactly (a memory bank, a hardness weighting, horovod) is
refused when the loss is built, with :class:`distgrad.errors.UnsupportedOptionError`.

No peer library is imported, here or in the submodules: they are written against the peers'
documented signatures (open_clip_torch 3.3, sentence-transformers 6.2, lightly 1.6) and tested
against the installed classes (docs/integrations.md).
"""

from __future__ import annotations

from distgrad.integrations import lightly, open_clip, sentence_transformers

__all__ = ["lightly", "open_clip", "sentence_transformers"]
