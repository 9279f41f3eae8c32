"""Names of earlier releases that still work: keyword arguments renamed to open_clip's.

A renamed keyword keeps working and warns with a ``FutureWarning`` (shown to users by default,
as torch does for its own deprecations) that names the new keyword; passing both is an error.
"""

from __future__ import annotations

import functools
import warnings
from collections.abc import Callable
from typing import Any, TypeVar, cast

__all__ = ["renamed"]

F = TypeVar("F", bound=Callable[..., Any])


def renamed(**old_to_new: str) -> Callable[[F], F]:
    """Accept each old keyword of the decorated function as its new one, with a warning."""

    def decorate(fn: F) -> F:
        name = fn.__qualname__.replace(".__init__", "")

        @functools.wraps(fn)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            used = [old for old in old_to_new if old in kwargs]
            for old in used:
                new = old_to_new[old]
                if new in kwargs:
                    raise TypeError(f"{name}() got both {old}= and {new}=; pass {new}= only")
                kwargs[new] = kwargs.pop(old)
            if used:  # one warning per call, naming every old keyword used
                olds = ", ".join(f"{old}=" for old in used)
                news = ", ".join(f"{old_to_new[old]}=" for old in used)
                warnings.warn(
                    f"{name}({olds}...) is deprecated and will be removed in a future release; "
                    f"use {news} (open_clip's names)",
                    FutureWarning,
                    stacklevel=2,
                )
            return fn(*args, **kwargs)

        return cast(F, wrapper)

    return decorate
