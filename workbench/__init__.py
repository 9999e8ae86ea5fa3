"""What the application rooms share: ``demo/``, ``benchmarks/`` and ``device_check/`` import
nothing of each other, only this package and the library (``amp_core``, ``torch_facade``,
``hardware``). It imports none of them, and it is not part of the wheel.

Modules (import them directly; this ``__init__`` imports nothing, so that a room pays only for
what it uses):

* :mod:`workbench.tables`: markdown tables and their cells;
* :mod:`workbench.jsonsafe`: strict JSON, undefined numbers written ``null``;
* :mod:`workbench.processes`: a free port, a child environment that imports this repository, a
  comma-separated command-line list;
* :mod:`workbench.timing`: interleaved timing, statistics, a JAX compile counter;
* :mod:`workbench.sizes`: the benchmark sizes and their GPT-2-like torch model;
* :mod:`workbench.whole_loop`: whole iterations of the documented loop (bench and device check)
  and their rows and table;
* :mod:`workbench.call_timers`: each call of an iteration timed on the host;
* :mod:`workbench.byte_gpt` and :mod:`workbench.byte_gpt_jax`: the demo's byte-level GPT-2, its
  settings and weights, and its flax NNX model and step (the cbfloat16 bench times it);
* :mod:`workbench.internals`: the only door to the library's private names (see ``README.md``
  beside this file: internal, no stability promise).
"""
