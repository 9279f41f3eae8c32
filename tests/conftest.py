"""Shared test setup: loopback gloo, seeded randomness."""

from __future__ import annotations

import os

os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
# The fused tile kernels (distgrad/losses/_triton.py) run on CPU tensors under Triton's
# interpreter. Set before anything imports triton: torch's compiler imports it when installed,
# and what triton reads of this at import is not read again (measured: kernels built after an
# earlier import fail with "Cannot call @triton.jit'd outside of the scope of a kernel").
# Nothing else here runs Triton: inductor compiles CPU code in C++.
os.environ.setdefault("TRITON_INTERPRET", "1")
