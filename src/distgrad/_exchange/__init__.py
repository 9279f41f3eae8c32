"""The exchange layer: everything that moves bytes between ranks, below the differentiable ops.

Its floors, bottom first (``tests/unit/test_layers.py`` keeps them):

* ``alive``: liveness sockets and ``/proc``: whether a peer's process is still there;
* ``group``: groups, ranks and sizes, and forgetting destroyed groups;
* ``wait``: how a rank waits, in ticks that notice a dead peer, and errors that say where;
* ``guard`` (the opt-in data guard's tags, carried in the data's own bytes) and ``backend``
  (which c10d call each backend gets, at which size);
* ``inflight`` (starting a c10d call, waiting for it, the steps every exchange is written as,
  and staging CUDA tensors through the host on gloo) and ``functional`` (each exchange
  written with torch's functional collectives, what a traced call emits);
* ``pairs`` (point-to-point exchanges), ``handshake`` (the checked calls' metadata and debug
  mode) and ``async_op`` (``AsyncTensor``: results that wait for their data on first use);
* ``declare``: one declaration per exchange, typed as its steps, from which come its call
  forms (blocking, in flight for ``async_op=True``, started, eager, steps; the traced form
  while ``torch.compile`` traces);
* ``ops``: the exchanges, one file each (its steps and its declaration).

A new exchange is one file in ``ops``. Its public declarations, all that ``distgrad.losses``
and ``distgrad.parallel`` may import of it (``tests/unit/test_layers.py``): ``ops`` (the
exchanges, and ``InFlight``, what a started one returns) and ``group`` (``Group``,
``ProcessGroup``, ``resolve``).
"""
