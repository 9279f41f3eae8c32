"""A RemoteModule travels over RPC as torch's does (torch's test_send_remote_module_over_the_
wire): passed to another worker by rpc_sync, rpc_async and remote, or returned from one, it
arrives as a RemoteModule of the same module, holding torch's attributes of a RemoteModule and
nothing else, whose forward runs on the module's worker and whose train()/eval() set that
module's mode; inside a context, a forward made on the receiver is recorded, and the gradients
equal local autograd's (both modes). nn.Module's methods that would act on the local shell are
refused in torch's words. Plain pickle and torch.save refuse it with torch's message, and an
attribute added after construction stays behind (torch's test_send_remote_module_with_a_new_
attribute_not_pickled_over_the_wire)."""

from __future__ import annotations

import io
import pickle
from typing import Any

import pytest
import torch
from torch import Tensor
from torch.distributed.nn.api.remote_module import _REMOTE_MODULE_PICKLED_ATTRIBUTES

import distgrad.rpc as dgrpc
from distgrad.testing import run_on_ranks
from tests import _support as support
from tests.rpc import _funcs as F
from tests.rpc import _helpers as H


def _forward_there(module: dgrpc.RemoteModule, x: Tensor) -> Tensor:
    """On the receiver: the received module is a RemoteModule, called like a local one."""
    assert type(module) is dgrpc.RemoteModule and module.on == "worker1"
    out: Tensor = module(x)
    return out


def _forward_async_there(module: dgrpc.RemoteModule, x: Tensor) -> Tensor:
    out: Tensor = module.forward_async(x).wait()
    return out


def _attributes(module: dgrpc.RemoteModule) -> dict[str, Any]:
    return vars(module)


def _eval_there(module: dgrpc.RemoteModule) -> bool:
    """On the receiver: eval() sets the module's mode on its worker; what it answers there."""
    module.eval()
    return bool(dgrpc.rpc_sync(module.on, F.module_training, args=(module.module_rref.torch_rref,)))


# What a received RemoteModule holds, in order: torch's pickled attributes of a RemoteModule,
# then its two forward methods, bound to it (torch's test_send_remote_module_over_the_wire).
_RECEIVED = [
    "on",
    "device",
    "is_device_map_set",
    "is_scriptable",
    "generated_methods",
    "module_rref",
    "forward_async",
    "forward",
]


def _made_there(module_rref: dgrpc.RRef[torch.nn.Module], x: Tensor) -> Tensor:
    """[torch's test_create_remote_module_from_module_rref] On worker2, a RemoteModule from
    worker1's module RRef, given worker2's name as torch's test does: it runs on the owner."""
    out: Tensor = dgrpc.RemoteModule.init_from_module_rref("worker2", module_rref)(x)
    return out


def _send_back(module: dgrpc.RemoteModule) -> dgrpc.RemoteModule:
    return module


def _refused_methods(layer: dgrpc.RemoteModule) -> None:
    """[torch's test_unsupported_methods] nn.Module's methods that would act on the local
    shell are refused in torch's words (parameters() would be empty: an optimizer over it
    would step nothing); its repr still works."""
    with pytest.raises(
        ValueError,
        match=r"^Method ``parameters`` not supported for "
        r"RemoteModule\. Please use ``remote_parameters`` instead\. \(distgrad: .* worker1",
    ):
        layer.parameters()
    for name, args in (("to", ("cpu",)), ("state_dict", ()), ("zero_grad", ()), ("apply", (id,))):
        with pytest.raises(ValueError, match=rf"^Method ``{name}`` not supported for RemoteModule"):
            getattr(layer, name)(*args)
    assert repr(layer) == "RemoteModule(on='worker1')"


def _over_the_wire(rank: int, world_size: int) -> None:
    if rank != 0:
        return
    layer = dgrpc.RemoteModule("worker1/cpu", F.seeded_linear, args=(3,))
    local = F.seeded_linear(3)
    x = support.leaf(1, 5, 4)
    want = local(x).detach()
    # Outside a context: torch's calls, with the reducer registered on torch's RPC pickler.
    got = [
        dgrpc.rpc_sync("worker2", _forward_there, args=(layer, x)),
        dgrpc.rpc_async("worker2", _forward_async_there, args=(layer, x)).wait(),
        dgrpc.remote("worker2", _forward_there, args=(layer, x)).to_here(),
        dgrpc.rpc_sync("worker2", _send_back, args=(layer,))(x),
        dgrpc.rpc_sync("worker2", _made_there, args=(layer.get_module_rref(), x)),
    ]
    for i, g in enumerate(got):
        H.assert_close(g, want, f"forward on the receiver, path {i}")
    attrs = dgrpc.rpc_sync("worker2", _attributes, args=(layer,))
    assert list(attrs) == _RECEIVED
    assert [*_REMOTE_MODULE_PICKLED_ATTRIBUTES, "forward_async", "forward"] == _RECEIVED
    assert (attrs["on"], attrs["device"], attrs["is_device_map_set"], attrs["is_scriptable"]) == (
        "worker1",
        "cpu",
        False,
        False,
    )
    assert attrs["module_rref"].owner_name() == "worker1"
    H.assert_close(attrs["forward"](x), want, "the received forward, sent back")
    _refused_methods(layer)
    layer.new_attr = 1
    assert "new_attr" not in dgrpc.rpc_sync("worker2", _attributes, args=(layer,))
    assert dgrpc.rpc_sync("worker2", _eval_there, args=(layer,)) is False
    layer.train()
    assert H.query("worker1", F.module_training, layer.get_module_rref().torch_rref) is True
    for save in (lambda: pickle.dumps(layer), lambda: torch.save(layer, io.BytesIO())):
        with pytest.raises(RuntimeError, match="Cannot pickle RemoteModule in python pickler"):
            save()
    # Inside a context: worker0 -> worker2 (the module and x) -> worker1 (the forward).
    v = support.cotangent(2, want)
    for mode in H.MODES:
        with dgrpc.context() as cid:
            y = dgrpc.rpc_sync("worker2", _forward_there, args=(layer, x))
            y2 = dgrpc.rpc_async("worker2", _forward_async_there, args=(layer, x)).wait()
            dgrpc.backward(cid, [((y + y2) * v).sum()], mode=mode)  # type: ignore[arg-type]
            got_x = dgrpc.get_gradients(cid)[x]
            got_w = H.query("worker1", F.module_grads, cid, layer.get_module_rref().torch_rref)
        xx = x.detach().requires_grad_()
        grads = torch.autograd.grad((2 * local(xx) * v).sum(), [*local.parameters(), xx])
        for i, (g, w) in enumerate(zip([*got_w, got_x], grads, strict=True)):
            H.assert_close(g, w, f"{mode}: gradient {i} through the received module")


def test_a_remote_module_sent_over_rpc_runs_on_the_receiver() -> None:
    run_on_ranks(_over_the_wire, 3, init="rpc")
