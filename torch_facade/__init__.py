"""A PyTorch facade with the documented ``cerebras.pytorch`` mixed-precision calls.

Use it as ``import torch_facade as cstorch`` and call ``cstorch.amp.GradScaler``,
``cstorch.amp.optimizer_step``, ``cstorch.amp.set_half_dtype``, ... as documented. It needs
PyTorch, which a plain install of ``cstorch-amp`` leaves out: ``pip install "cstorch-amp[torch]"``.

Example:
    >>> import torch_facade as cstorch
    >>> scaler = cstorch.amp.GradScaler(loss_scale="dynamic")
    >>> scaler.get_scale()
    tensor(32768.)
"""

try:
    import torch  # noqa: F401
except ModuleNotFoundError as error:  # torch is an extra: the JAX front door needs none
    if error.name != "torch":
        raise
    raise ImportError(
        "torch_facade needs PyTorch, which a plain install of cstorch-amp leaves out (the JAX "
        'front door, amp_core, needs none): pip install "cstorch-amp[torch]"'
    ) from error

from amp_core import __version__ as __version__
from torch_facade import amp

__all__ = ["amp"]
