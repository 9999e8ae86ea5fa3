"""``cstorch.amp``: the documented Cerebras mixed-precision API over ordinary torch optimizers.

Example:
    >>> import torch_facade as cstorch
    >>> scaler = cstorch.amp.GradScaler(loss_scale="dynamic")
"""

from torch_facade.amp.casting import (
    disable_casts,
    float_function,
    half_function,
    init,
    promote_function,
    register_float_function,
    register_half_function,
    register_promote_function,
)
from torch_facade.amp.cbfloat16 import cast_to_cbfloat16, cbfloat16_numerics, round_to_cbfloat16
from torch_facade.amp.conditional_update import isfinite, setup_optimizer, update_if_finite
from torch_facade.amp.diagnostics import (
    GradientRangeReport,
    OverflowReport,
    gradient_range_report,
    scaler_metrics,
)
from torch_facade.amp.grad_scaler import GradScaler, LossScaleStalledError
from torch_facade.amp.locate_overflow import locate_overflow
from torch_facade.amp.master_weights import with_master_weights
from torch_facade.amp.optimizer_step import optimizer_step
from torch_facade.amp.precision import (
    autocast,
    enable_mixed_precision,
    get_floating_point_dtype,
    get_floating_point_dtype_str,
    get_half_dtype,
    get_half_dtype_str,
    is_cbfloat16_tensor,
    mixed_precision,
    set_half_dtype,
)
from torch_facade.amp.skip_aware import skip_aware
from torch_facade.amp.spike_skip import SpikeSkip

__all__ = [
    "GradScaler",
    "GradientRangeReport",
    "LossScaleStalledError",
    "OverflowReport",
    "SpikeSkip",
    "autocast",
    "cast_to_cbfloat16",
    "cbfloat16_numerics",
    "disable_casts",
    "enable_mixed_precision",
    "float_function",
    "get_floating_point_dtype",
    "get_floating_point_dtype_str",
    "get_half_dtype",
    "get_half_dtype_str",
    "gradient_range_report",
    "half_function",
    "init",
    "is_cbfloat16_tensor",
    "isfinite",
    "locate_overflow",
    "mixed_precision",
    "optimizer_step",
    "promote_function",
    "register_float_function",
    "register_half_function",
    "register_promote_function",
    "round_to_cbfloat16",
    "scaler_metrics",
    "set_half_dtype",
    "setup_optimizer",
    "skip_aware",
    "update_if_finite",
    "with_master_weights",
]
