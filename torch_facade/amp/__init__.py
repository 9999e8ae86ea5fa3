"""``cstorch.amp``: the documented Cerebras mixed-precision API over ordinary torch optimizers.

Example:
    >>> import torch_facade as cstorch
    >>> scaler = cstorch.amp.GradScaler(loss_scale="dynamic")
"""

from torch_facade.amp._amp_state import (
    autocast,
    enable_mixed_precision,
    get_floating_point_dtype,
    get_half_dtype,
    get_half_dtype_str,
    is_cbfloat16_tensor,
    mixed_precision,
    set_half_dtype,
)
from torch_facade.amp.cbfloat16 import cast_to_cbfloat16, cbfloat16_numerics, round_to_cbfloat16
from torch_facade.amp.diagnostics import OverflowReport, scaler_metrics
from torch_facade.amp.grad_scaler import GradScaler, LossScaleStalledError
from torch_facade.amp.optimizer_step import optimizer_step

__all__ = [
    "GradScaler",
    "LossScaleStalledError",
    "OverflowReport",
    "autocast",
    "cast_to_cbfloat16",
    "cbfloat16_numerics",
    "enable_mixed_precision",
    "get_floating_point_dtype",
    "get_half_dtype",
    "get_half_dtype_str",
    "is_cbfloat16_tensor",
    "mixed_precision",
    "optimizer_step",
    "round_to_cbfloat16",
    "scaler_metrics",
    "set_half_dtype",
]
