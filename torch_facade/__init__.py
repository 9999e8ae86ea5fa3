"""A PyTorch facade with the documented ``cerebras.pytorch`` mixed-precision calls.

Use it as ``import torch_facade as cstorch`` and call ``cstorch.amp.GradScaler``,
``cstorch.amp.optimizer_step``, ``cstorch.amp.set_half_dtype``, ... as documented.
"""

from torch_facade import amp

__all__ = ["amp"]
