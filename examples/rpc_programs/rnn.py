"""An RNN whose embedding table and decoder live on a parameter server: worker1 holds both
(created with ``rpc.remote``, used through RRefs passed to RPCs), worker0 the LSTM and the
training loop, with distributed autograd and one DistributedOptimizer over all three."""

from __future__ import annotations

import threading
from typing import Any

import torch
from examples.rpc_programs._api import Api, Result, api, join
from torch import nn

STEPS = 4
TOKENS, WIDTH, HIDDEN = 20, 6, 8
_api: list[Api] = []
# The table and the decoder are made by two ``rpc.remote`` calls that worker1 may serve at once,
# on two threads: each seeds the global generator, so one at a time.
_seeding = threading.Lock()


def _call_method(method: Any, rref: Any, *args: Any) -> Any:
    return method(rref.local_value(), *args)


def _remote_method(method: Any, rref: Any, *args: Any) -> Any:
    return _api[0].rpc.rpc_sync(rref.owner(), _call_method, args=(method, rref, *args))


def _parameter_rrefs(module: nn.Module) -> list[Any]:
    return [_api[0].rpc.RRef(p) for p in module.parameters()]


class EmbeddingTable(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        with _seeding:
            torch.manual_seed(1)
            self.encoder = nn.Embedding(TOKENS, WIDTH)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.encoder(tokens)  # type: ignore[no-any-return]


class Decoder(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        with _seeding:
            torch.manual_seed(2)
            self.decoder = nn.Linear(HIDDEN, TOKENS)

    def forward(self, output: torch.Tensor) -> torch.Tensor:
        return self.decoder(output)  # type: ignore[no-any-return]


class RNNModel(nn.Module):
    def __init__(self, ps: str) -> None:
        super().__init__()
        rpc = _api[0].rpc
        self.emb_table_rref = rpc.remote(ps, EmbeddingTable)
        torch.manual_seed(3)
        self.rnn = nn.LSTM(WIDTH, HIDDEN, batch_first=True)
        self.decoder_rref = rpc.remote(ps, Decoder)

    def forward(self, tokens: torch.Tensor, hidden: Any) -> tuple[torch.Tensor, Any]:
        emb = _remote_method(EmbeddingTable.forward, self.emb_table_rref, tokens)
        output, hidden = self.rnn(emb, hidden)
        return _remote_method(Decoder.forward, self.decoder_rref, output), hidden

    def parameter_rrefs(self) -> list[Any]:
        return [
            *_remote_method(_parameter_rrefs, self.emb_table_rref),
            *_parameter_rrefs(self.rnn),
            *_remote_method(_parameter_rrefs, self.decoder_rref),
        ]


def train(a: Api) -> Result:
    model = RNNModel("worker1")
    opt = a.DistributedOptimizer(torch.optim.SGD, model.parameter_rrefs(), lr=0.1)
    g = torch.Generator().manual_seed(0)
    hidden = (torch.zeros(1, 2, HIDDEN), torch.zeros(1, 2, HIDDEN))
    result = Result()
    for _ in range(STEPS):
        tokens = torch.randint(0, TOKENS, (2, 5), generator=g)
        target = torch.randint(0, TOKENS, (2, 5), generator=g)
        with result.timed(), a.dist_autograd.context() as context_id:
            hidden = (hidden[0].detach(), hidden[1].detach())
            output, hidden = model(tokens, hidden)
            loss = nn.functional.cross_entropy(output.reshape(-1, TOKENS), target.reshape(-1))
            a.dist_autograd.backward(context_id, [loss])
            opt.step(context_id)
        result.record(loss=loss, lstm=list(model.rnn.parameters()))
    return result


def run(rank: int, world_size: int, mode: str, folder: str) -> Result:
    _api[:] = [api(mode)]
    join(_api[0], rank, world_size, folder)
    result = train(_api[0]) if rank == 0 else Result()
    _api[0].rpc.shutdown()
    return result
