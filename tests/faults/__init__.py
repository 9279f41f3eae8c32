"""Fault injection: what every surviving rank sees, and within how long, when a peer dies,
raises, never arrives, or passes something wrong. Every case runs real processes through
``dg.testing.run_on_ranks`` with a short process-group timeout.

Where each case of issue 12 lives:

* a peer SIGKILLed as it enters the forward or backward of every op, killed inside a 32 MB
  transfer (both exchange styles; every op under ``-m slow``), exiting, or raising:
  ``test_dead_peer.py``;
* issue 37: a killed peer named dead in tens of milliseconds at 2 and 3 ranks, never as
  running (``test_dead_peer.py``; 20 kills per op under ``-m slow``: ``test_kill_loop.py``);
  how a peer's process is judged gone, running or unknown (/proc, the liveness connection):
  ``tests/exchange/test_alive.py``; a peer described at the call where it was:
  ``test_blame_the_right_call.py``;
* a rank that never arrives (a skipped backward, another group) and requires_grad on some
  ranks only: ``test_never_arrives.py``;
* every mistake past the checked calls (docs/semantics.md's table, and docs/faults.md's for
  reduce_scatter, all_to_all and broadcast): ``test_past_the_checked_calls.py``;
* NaN/Inf, zero-size inputs, more than 2 GiB (slow), 10,000 calls (slow): ``test_inputs.py``;
* mismatched shapes, dtypes, ops, sizes and every invalid argument on one rank, a rank that
  raises before a collective, a skipped call, non-members of a group:
  ``tests/collectives/test_bad_input.py``;
* an RPC worker killed mid-backward, a dead root, remote raises in forward and backward, and
  1,000 contexts: ``tests/rpc/test_faults.py``.

Run them all: ``pytest tests/faults tests/collectives/test_bad_input.py tests/rpc/test_faults.py``
(add ``-m slow`` for the slow ones).
"""
