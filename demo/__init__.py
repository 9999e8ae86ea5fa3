"""``make demo``: mixed-precision training with a real float16 overflow episode.

A small MLP on synthetic data (generated in-process) is trained with float16 compute and
dynamic loss scaling, starting from a loss scale of ``2**24`` so that the float16 backward pass
overflows: the scaler skips those steps and halves the scale, later doubles it again, overflows
again at the top, and so on. A float32 run of the same model, data and seed is the reference.
The run ends with a table and a PNG plot of loss and loss scale per step.

Structure, so that more implementations plug in:

* :mod:`demo.problem`: the shared :class:`Problem` (data, initial weights, batches,
  hyperparameters) as numpy arrays.
* :mod:`demo.registry`: path name -> ``run(problem, options) -> list[RunRecord]``.
* :mod:`demo.jax_path`: the JAX-native path (``amp_core.with_loss_scaling``).
* :mod:`demo.torch_path`: the same training through the ``cstorch.amp`` facade (torch, Adam,
  ``GradScaler``), listed as ``"torch"``; its loss-scale trajectory equals the JAX path's.
* :mod:`demo.report`: table and plot of any list of :class:`RunRecord`.
* :mod:`demo.cli`: the command line (``--steps``, ``--seed``, ``--out-dir``, ``--path``).
"""

from demo.problem import FLOAT16_MAX, Problem, RunOptions, ScalerSettings, make_problem
from demo.records import RunRecord
from demo.registry import PATHS, PathRunner, load_paths, register_path

__all__ = [
    "FLOAT16_MAX",
    "PATHS",
    "PathRunner",
    "Problem",
    "RunOptions",
    "RunRecord",
    "ScalerSettings",
    "load_paths",
    "make_problem",
    "register_path",
]
