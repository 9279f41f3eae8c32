"""``python -m examples.rpc_programs``: every program with torch, then with distgrad (FAST,
and SMART where distributed autograd runs), compared step by step; exits 1 on a difference."""

from __future__ import annotations

import sys

from examples.rpc_programs import PROGRAMS
from examples.rpc_programs.runner import differences, launch, modes_for


def main() -> int:
    bad = 0
    for name in PROGRAMS:
        want = launch(name, "torch")
        for mode in modes_for(name)[1:]:
            found = differences(want, launch(name, mode))
            bad += bool(found)
            print(f"{name:17} {mode:6} " + (found[0] if found else "equal at every step"))
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
