"""PyTorch's own tests of DDP under dist autograd, run against distgrad.rpc (slow).

``DdpUnderDistAutogradTest`` and ``DdpComparisonTest`` from the installed
``torch/testing/_internal/distributed/ddp_under_dist_autograd_test.py`` (8 tests, 6 processes
each for the first class), unchanged, with their module's ``dist_autograd`` and ``rpc`` (and
``dist_utils``'s ``rpc``, which starts and stops the group) pointed at distgrad.rpc: contexts,
backward in FAST or SMART, get_gradients, rpc_sync, rpc_async, remote, init_rpc, shutdown,
and its ``RemoteModule``; every other name stays torch's. torch's test internals need
``expecttest``; without it the module is skipped. About 25 s per test here; run with
``pytest -m slow``.
"""

from __future__ import annotations

from typing import Any

import pytest

pytest.importorskip("expecttest", reason="torch's distributed test internals need expecttest")

from torch.testing._internal import dist_utils
from torch.testing._internal.distributed import ddp_under_dist_autograd_test as spec
from torch.testing._internal.distributed.rpc.tensorpipe_rpc_agent_test_fixture import (
    TensorPipeRpcAgentTestFixture,
)
from torch.testing._internal.distributed.rpc_utils import generate_tests

import distgrad.rpc as dgrpc
from tests.rpc._torch_rpc import DistgradRpc

pytestmark = pytest.mark.slow

_mode = {"now": "fast"}  # set in each spawned rank before its test runs


class _Autograd:
    """``torch.distributed.autograd`` as the spec uses it, served by distgrad."""

    context = staticmethod(dgrpc.context)
    get_gradients = staticmethod(dgrpc.get_gradients)

    @staticmethod
    def backward(context_id: int, roots: Any, retain_graph: bool = False) -> None:
        dgrpc.backward(context_id, roots, retain_graph, mode=_mode["now"])  # type: ignore[arg-type]


spec.dist_autograd = _Autograd  # type: ignore[assignment]
spec.RemoteModule = dgrpc.RemoteModule  # type: ignore[assignment,misc]
spec.rpc = DistgradRpc()  # type: ignore[assignment]
dist_utils.rpc = DistgradRpc()  # type: ignore[assignment]


def _in_mode(cls: type, mode: str) -> type:
    original = cls._run  # type: ignore[attr-defined]

    # Named _run: the spawned rank finds the method by name on the class.
    def _run(klass: type, *args: Any, **kwargs: Any) -> None:
        _mode["now"] = mode
        original.__func__(klass, *args, **kwargs)

    cls._run = classmethod(_run)  # type: ignore[attr-defined]
    return cls


def _generate() -> dict[str, type]:
    classes = {}
    for mode in ("fast", "smart"):
        for name, cls in generate_tests(
            f"Distgrad{mode.title()}",
            TensorPipeRpcAgentTestFixture,
            [spec.DdpUnderDistAutogradTest, spec.DdpComparisonTest],
            __name__,
        ).items():
            classes[name] = _in_mode(cls, mode)
    return classes


globals().update(_generate())
