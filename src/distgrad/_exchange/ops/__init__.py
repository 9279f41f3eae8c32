"""The exchanges, one file each: its steps and its declaration (``distgrad._exchange.declare``).

Every function here works along dim 0 of a tensor, returns a new tensor and never writes to its
input. The differentiable ops in ``distgrad.collectives`` call these in both their forward and
backward passes; which c10d call each makes on each backend is chosen in
``distgrad._exchange.backend``.
"""

from __future__ import annotations

from typing import Any

from distgrad._exchange.declare import Exchange
from distgrad._exchange.inflight import InFlight
from distgrad._exchange.ops.all_gather import all_gather
from distgrad._exchange.ops.all_reduce import all_reduce
from distgrad._exchange.ops.all_to_all import all_to_all
from distgrad._exchange.ops.broadcast import broadcast
from distgrad._exchange.ops.gather import gather
from distgrad._exchange.ops.permute import permute
from distgrad._exchange.ops.reduce import reduce
from distgrad._exchange.ops.reduce_scatter import reduce_scatter
from distgrad._exchange.ops.scatter import scatter
from distgrad._exchange.ops.shift import shift

__all__ = [
    "EXCHANGES",
    "InFlight",
    "all_gather",
    "all_reduce",
    "all_to_all",
    "broadcast",
    "gather",
    "permute",
    "reduce",
    "reduce_scatter",
    "scatter",
    "shift",
]

# Every exchange, for the tests that check each one (tests/exchange/test_exchanges.py).
EXCHANGES: tuple[Exchange[..., Any], ...] = (
    all_gather,
    reduce_scatter,
    all_to_all,
    all_reduce,
    broadcast,
    reduce,
    gather,
    scatter,
    permute,
    shift,
)
