"""The library's private names that the application rooms use, reached through this module only.

Internal, with no stability promise: these are the engine's own modules and functions, renamed
or split whenever the engine changes. When they move, this file is the one import to follow;
``workbench/README.md`` lists who uses what. No room imports an underscore module or name of
``amp_core``, ``torch_facade`` or ``hardware`` except through here.

* ``dlpack``, ``carry``, ``cores``, ``gradients``: the facade's crossing between torch and JAX,
  the packed carry, the jitted cores and the gradient reader. The host-side profile patches
  their functions to time them; the whole-iteration floor calls the same import and multiply
  the facade uses; the device check names the crossing in use.
* ``crossing_cuda``: the CUDA crossing's last failure (the device check reports it).
* ``host_side``: the facade's graph-break reason under ``torch.compile`` (the device check
  counts the breaks it causes).
* ``placed_for(scaler)``: the torch device whose JAX device a ``GradScaler``'s state is on (the
  scaler engine's ``placed_for``; the device check names the crossing for it).
* ``in_step_sum_of_unscaled_squares``: ``amp_core``'s in-step overflow check, which the JAX
  step bench times beside the public transforms.
"""

from __future__ import annotations

import torch

import torch_facade as cstorch
from amp_core.scaling import in_step_sum_of_unscaled_squares
from torch_facade.amp import _host_side as host_side
from torch_facade.amp._engine import _carry as carry
from torch_facade.amp._engine import _cores as cores
from torch_facade.amp._engine import _crossing_cuda as crossing_cuda
from torch_facade.amp._engine import _dlpack as dlpack
from torch_facade.amp._engine import _gradients as gradients

__all__ = [
    "carry",
    "cores",
    "crossing_cuda",
    "dlpack",
    "gradients",
    "host_side",
    "in_step_sum_of_unscaled_squares",
    "placed_for",
]


def placed_for(scaler: cstorch.amp.GradScaler) -> torch.device | None:
    """The torch device whose JAX device ``scaler``'s state is on (``None``: on the host).

    Example:
        >>> import torch_facade as cstorch
        >>> from workbench.internals import placed_for
        >>> placed_for(cstorch.amp.GradScaler(loss_scale="dynamic")) is None  # nothing decided yet
        True
    """
    return scaler._engine.placed_for
