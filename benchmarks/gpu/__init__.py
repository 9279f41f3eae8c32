"""The parts of ``benchmarks/gpu_check.py``, one module each; that file is the command.

* ``gradients``, ``losses``, ``sync``, ``guard``, ``compile``, ``memory``, ``timing``: each
  part's work on the ranks and its table, ``part(device, gpus) -> Section``;
* ``step``: every op's name, and the calls of a training step that ``sync`` and ``compile`` run;
* ``ranks``: where a part's ranks run (``Setup``), and the row it writes when they fail;
* ``report``: the results file (a ``Section`` per part, a summary on top).

Imported as ``gpu`` (``benchmarks/gpu_check.py`` puts its own folder on ``sys.path``), so that
the ranks ``run_on_ranks`` starts find a part's functions by name.
"""
