"""``python -m distgrad``: the same as the ``distgrad`` command."""

from __future__ import annotations

import sys

from distgrad._cli import main

if __name__ == "__main__":
    sys.exit(main())
