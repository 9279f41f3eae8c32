"""Six canonical RPC programs, each written once and run on torch or on distgrad by switching
the import alone.

Each program module has ``run(rank, world_size, api, folder) -> Result`` (a function for
``distgrad.testing.run_on_ranks(..., init="none")``): it joins RPC itself through
``api.rpc.init_rpc``, trains for a few steps with ``api.rpc``, ``api.dist_autograd`` and
``api.DistributedOptimizer``, leaves with ``api.rpc.shutdown()``, and returns what it computed
at every step (losses, parameters) and each step's time. ``api`` is ``"torch"`` (torch's
``torch.distributed.rpc``, ``torch.distributed.autograd`` and
``torch.distributed.optim.DistributedOptimizer``), ``"fast"`` (``distgrad.rpc`` for all three)
or ``"smart"`` (the same, with ``backward(..., mode="smart")``).

* ``parameter_server``: trainers run a model's forward on a parameter server through RPC,
  backward through it and step it with a DistributedOptimizer, taking turns.
* ``rnn``: an RNN whose embedding table and decoder live on a parameter server (``remote``
  modules, RRefs), the LSTM on the trainer.
* ``pipeline``: a model split over two workers, fed in two micro-batches with ``rpc_async`` and
  RRef proxies, the master concatenating the outputs.
* ``ddp_rpc``: trainers, each a DistributedDataParallel head over a gloo group, looking up an
  embedding on a parameter server through RPC; one DistributedOptimizer over both.
* ``batch_ps``: a batch-updating parameter server: trainers send local gradients, the server
  (``async_execution``) steps once every trainer's have arrived and answers all with the model.
* ``agent_observer``: reinforcement learning: an agent's policy chooses the actions of
  observers that run episodes of a toy environment through RRefs; the agent learns with
  REINFORCE.

``python -m examples.rpc_programs`` runs all six in each mode and compares every step.
"""

PROGRAMS = ("parameter_server", "rnn", "pipeline", "ddp_rpc", "batch_ps", "agent_observer")
# the programs that use distributed autograd, where SMART differs from FAST
AUTOGRAD_PROGRAMS = ("parameter_server", "rnn", "pipeline", "ddp_rpc")
