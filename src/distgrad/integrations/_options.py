"""What every drop-in loss does with a peer option: check it, refuse it, or say it is moot."""

from __future__ import annotations

import torch.distributed as dist

from distgrad.errors import UnsupportedOptionError

__all__ = ["check_rank_and_size", "refuse"]


def refuse(loss: str, argument: str, passed: object, instead: str) -> UnsupportedOptionError:
    """The error for a peer option ``loss`` cannot honour exactly, worded for the user."""
    return UnsupportedOptionError(
        f"{loss}: {argument}={passed!r} is not supported by distgrad's drop-in loss; {instead}"
    )


def check_rank_and_size(loss: str, rank: int, world_size: int) -> None:
    """open_clip's ``rank``/``world_size`` arguments, where the caller passed them: they must
    name this process's place in the default group (distgrad reads both from the group, so a
    value that disagrees means the script thinks of another group than the one in use)."""
    if world_size == 1 and rank == 0:  # the defaults: nothing was said
        return
    actual = (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)
    if (rank, world_size) != actual:
        raise UnsupportedOptionError(
            f"{loss}: rank={rank}, world_size={world_size} were passed, but this process is "
            f"rank {actual[0]} of {actual[1]} in the default process group, which distgrad "
            "uses; pass the group's own rank and size (or leave both out), or pass group= "
            "for another group"
        )
