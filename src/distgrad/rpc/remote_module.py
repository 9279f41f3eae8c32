"""``RemoteModule``: a module made and run on another worker, used like a local one.

What people used ``torch.distributed.nn.RemoteModule`` for, on distgrad's calls: the module
lives on its worker behind an :class:`~distgrad.rpc.RRef`; ``forward`` is an
:func:`~distgrad.rpc.rpc_sync` to it (recorded inside a context, so gradients reach its
parameters there), ``forward_async`` an :func:`~distgrad.rpc.rpc_async`, and
``remote_parameters()`` gives RRefs of its parameters for
:class:`~distgrad.rpc.DistributedOptimizer`. CPU only.

It travels over RPC as torch's does (an argument of ``rpc_sync``/``rpc_async``/``remote``, or
in a returned value: the receiver gets a RemoteModule of the same module, usable there), by a
reducer registered on torch's RPC pickler, which distgrad's calls use too; plain ``pickle`` and
``torch.save`` refuse it with torch's message. Only torch's own attributes of a RemoteModule
travel (which worker, the module's RRef, ...); one added after construction stays behind, and
the received module holds those attributes and its two forward methods, nothing else, as
torch's: no nn.Module state, so calling it runs ``forward`` directly.

Cost: creating one is one RPC; each forward is one RPC (a round trip).
"""

from __future__ import annotations

import types
from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.distributed import rpc as torch_rpc
from torch.distributed.rpc import internal as torch_rpc_internal
from torch.futures import Future

from distgrad.rpc.calls import RRef, remote, rpc_async, rpc_sync

__all__ = ["RemoteModule"]


class RemoteModule(nn.Module):
    """``module_cls(*args, **kwargs)`` made on ``remote_device`` (``"worker1"`` or
    ``"worker1/cpu"``) and run there by :meth:`forward`.

    Args:
        remote_device: the worker, with ``/cpu`` or nothing after it.
        module_cls: the module's class.
        args: its constructor's positional arguments.
        kwargs: its constructor's keyword arguments.

    Raises:
        ValueError: a device other than the CPU.
        Exception: what the module's constructor raised on the worker.

    Example:
        >>> layer = dg.rpc.RemoteModule("worker0", torch.nn.Linear, args=(2, 1))
        >>> layer(torch.ones(3, 2)).shape  # run on worker0
        torch.Size([3, 1])
    """

    on: str
    device: str
    is_device_map_set: bool
    is_scriptable: bool
    generated_methods: tuple[Callable[..., Any], ...]
    module_rref: RRef[nn.Module]

    def __init__(
        self,
        remote_device: str,
        module_cls: type[nn.Module],
        args: tuple[Any, ...] | None = None,
        kwargs: dict[str, Any] | None = None,
    ) -> None:
        super().__init__()
        worker, _, device = remote_device.partition("/")
        if device not in ("", "cpu"):
            raise ValueError(
                f"RemoteModule: distgrad.rpc runs modules on CPU only, got device {device!r} "
                f"in remote_device={remote_device!r}"
            )
        self._describe(worker, remote(worker, _instantiate, (module_cls, args or (), kwargs or {})))

    def _describe(self, worker: str, module_rref: RRef[nn.Module]) -> None:
        # torch's RemoteModule's own attributes, in torch's order, with their values here: what
        # travels over RPC, and all a received RemoteModule holds. The instance holds its
        # forward methods too, bound to it, as torch's does (torch's test of a module sent
        # over the wire lists the received one's attributes, these included).
        self.on = worker
        self.device = "cpu"
        self.is_device_map_set = False
        self.is_scriptable = False
        self.generated_methods = (type(self).forward_async, type(self).forward)
        self.module_rref = module_rref
        method: Callable[..., Any]
        for method in self.generated_methods:
            setattr(self, method.__name__, types.MethodType(method, self))

    @staticmethod
    def init_from_module_rref(
        remote_device: str, module_rref: RRef[nn.Module] | torch_rpc.RRef[nn.Module]
    ) -> RemoteModule:
        """A RemoteModule for a module already made on ``remote_device`` (torch's
        ``RemoteModule.init_from_module_rref``): no RPC, the module is shared, not copied."""
        worker, _, device = remote_device.partition("/")
        if device not in ("", "cpu"):
            raise ValueError(
                f"RemoteModule: distgrad.rpc runs modules on CPU only, got device {device!r} "
                f"in remote_device={remote_device!r}"
            )
        made = RemoteModule.__new__(RemoteModule)
        nn.Module.__init__(made)
        made._describe(
            worker, module_rref if isinstance(module_rref, RRef) else RRef._wrap(module_rref)
        )
        return made

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        """``forward``: through nn.Module's call (and its global hooks) on the worker that made
        this RemoteModule; directly on one received over RPC, which has no nn.Module state."""
        if "_forward_hooks" in self.__dict__:
            return super().__call__(*args, **kwargs)
        return self.forward(*args, **kwargs)

    def train(self, mode: bool = True) -> RemoteModule:
        """Set the remote module's training mode (one RPC), as torch's RemoteModule does;
        ``training`` here records the mode this RemoteModule last set."""
        rpc_sync(self._owner(), _set_training, (self.module_rref.torch_rref, mode))
        self.training = mode
        return self

    def eval(self) -> RemoteModule:
        """``train(False)`` on the remote module (one RPC)."""
        return self.train(False)

    # Plain pickle (torch.save) refuses it, in torch's words; RPC uses _reduce (registered below).
    def __getstate__(self) -> Any:
        raise RuntimeError(
            "Cannot pickle RemoteModule in python pickler. RemoteModule can only be pickled "
            "when using RPC"
        )

    def __setstate__(self, state: Any) -> None:
        raise RuntimeError(
            "Cannot unpickle RemoteModule in python pickler. RemoteModule can only be unpickled "
            "when using RPC"
        )

    def _owner(self) -> str:
        # Where the module is: its RRef's owner, as torch's calls go (``on`` is what was passed,
        # which init_from_module_rref does not check against the owner, as torch's does not).
        return self.module_rref.owner_name()

    def __repr__(self) -> str:
        # nn.Module's repr would call extra_repr, which is refused below.
        return f"RemoteModule(on={self.on!r})"

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        """The module's forward on its worker (one RPC; recorded inside a context)."""
        return rpc_sync(self._owner(), _forward, (self.module_rref.torch_rref, args, kwargs))

    def forward_async(self, *args: Any, **kwargs: Any) -> Future[Any]:
        """A future of the module's forward on its worker."""
        return rpc_async(self._owner(), _forward, (self.module_rref.torch_rref, args, kwargs))

    def remote_parameters(self, recurse: bool = True) -> list[RRef[torch.Tensor]]:
        """RRefs of the module's parameters (owned by its worker), for DistributedOptimizer."""
        found = rpc_sync(self._owner(), _parameter_rrefs, (self.module_rref.torch_rref, recurse))
        return [RRef._wrap(r) for r in found]

    def get_module_rref(self) -> RRef[nn.Module]:
        """The RRef of the module on its worker."""
        return self.module_rref


# nn.Module's methods that would act on the local shell, not on the module (parameters() would
# be empty, so an optimizer over it would silently step nothing): refused, in torch's words
# (torch's RemoteModule refuses the same ones), then where the module is.
_REFUSED = [
    "register_buffer",
    "register_parameter",
    "add_module",
    "apply",
    "cuda",
    "ipu",
    "xpu",
    "cpu",
    "type",
    "float",
    "double",
    "half",
    "bfloat16",
    "to",
    "register_backward_hook",
    "register_forward_pre_hook",
    "register_forward_hook",
    "state_dict",
    "load_state_dict",
    "parameters",
    "named_parameters",
    "buffers",
    "named_buffers",
    "children",
    "named_children",
    "modules",
    "named_modules",
    "requires_grad_",
    "zero_grad",
    "share_memory",
    "extra_repr",
]


def _refuse(name: str) -> Any:
    def refused(self: RemoteModule, *args: Any, **kwargs: Any) -> Any:
        instead = " Please use ``remote_parameters`` instead." if name == "parameters" else ""
        raise ValueError(
            f"Method ``{name}`` not supported for RemoteModule.{instead} (distgrad: the module "
            f"lives on {self._owner()}; call its methods there through get_module_rref())"
        )

    refused.__name__ = name
    refused.__doc__ = f"Refused, as torch's RemoteModule refuses ``{name}``."
    return refused


for _name in _REFUSED:
    setattr(RemoteModule, _name, _refuse(_name))


def _reduce(module: RemoteModule) -> tuple[Any, tuple[Any, ...]]:
    """How a RemoteModule travels over RPC: which worker, and its module's (torch) RRef, which
    the RPC pickler sends as torch sends any RRef; its other attributes are constants here."""
    return _receive, (module.on, module.module_rref.torch_rref)


def _receive(on: str, module_rref: torch_rpc.RRef[nn.Module]) -> RemoteModule:
    # As torch's receiver: the RemoteModule's own attributes, no nn.Module state (its hooks,
    # parameters and flags belong to the worker that made it, and the module is elsewhere).
    made: RemoteModule = object.__new__(RemoteModule)
    made._describe(on, RRef._wrap(module_rref))
    return made


# As torch registers its RemoteModule's reducer: on torch's RPC pickler, whose registered
# reducers distgrad's calls use as well. Plain pickle has no such entry and meets __getstate__.
torch_rpc_internal._internal_rpc_pickler._register_reducer(RemoteModule, _reduce)  # type: ignore[no-untyped-call]


def _instantiate(module_cls: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> nn.Module:
    module = module_cls(*args, **kwargs)
    if not isinstance(module, nn.Module):
        # torch's words (its tests match them), raised when the module is made, as torch does.
        raise ValueError(
            "Expect `module_cls(*args, **kwargs)` returns an instance of <class nn.Module>, "
            f"but it returns an instance of {type(module)}."
        )
    return module


def _set_training(rref: torch_rpc.RRef[nn.Module], mode: bool) -> None:
    rref.local_value().train(mode)


def _forward(rref: torch_rpc.RRef[nn.Module], args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    return rref.local_value()(*args, **kwargs)


def _parameter_rrefs(
    rref: torch_rpc.RRef[nn.Module], recurse: bool
) -> list[torch_rpc.RRef[torch.Tensor]]:
    return [torch_rpc.RRef(p) for p in rref.local_value().parameters(recurse)]
