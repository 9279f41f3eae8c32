"""``torch.distributed.rpc`` with distgrad's calls and lifecycle in place of torch's, for
running torch's own RPC tests against distgrad by substitution (test_torch_spec.py,
test_torch_ddp_spec.py)."""

from __future__ import annotations

from typing import Any

from torch.distributed import rpc as torch_rpc

import distgrad.rpc as dgrpc


class DistgradRpc:
    """``torch.distributed.rpc`` with distgrad's calls and lifecycle; the rest is torch's."""

    init_rpc = staticmethod(dgrpc.init_rpc)
    shutdown = staticmethod(dgrpc.shutdown)
    rpc_sync = staticmethod(dgrpc.rpc_sync)
    rpc_async = staticmethod(dgrpc.rpc_async)
    remote = staticmethod(dgrpc.remote)
    RRef = dgrpc.RRef

    def __getattr__(self, name: str) -> Any:
        return getattr(torch_rpc, name)
