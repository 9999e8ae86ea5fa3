"""Cerebras-style loss scaling as pure, jittable JAX functions.

Configuration is a frozen dataclass (:class:`StaticLossScale`, :class:`DynamicLossScale`), state
a NamedTuple of arrays (:class:`LossScaleState`), and every operation a pure function of them.
"""

from amp_core.config import DynamicLossScale, LossScaleConfig, StaticLossScale, make_config
from amp_core.diagnostics import LeafReport, nonfinite_report
from amp_core.scaling import (
    CLIP_EPSILON,
    GradCheck,
    StepResult,
    apply_multiplier,
    check_and_update,
    check_grads,
    check_sum_and_update,
    check_sum_of_squares,
    clip_coefficient,
    combine_partials,
    fused_optimizer_args,
    global_norm_of_unscaled,
    inverse_scale,
    is_stalled,
    recount_skipped_steps,
    scale_loss,
    select_if_finite,
    sum_of_unscaled_squares,
    unscale_and_check,
    update,
)
from amp_core.state import (
    LossScaleState,
    from_state_dict,
    init,
    state_dict_keys,
    to_state_dict,
)
from amp_core.transforms import (
    LossScaledState,
    apply_scaled_gradients,
    loss_scale_state,
    value_and_grad,
    with_loss_scaling,
)

__all__ = [
    "CLIP_EPSILON",
    "DynamicLossScale",
    "GradCheck",
    "LeafReport",
    "LossScaleConfig",
    "LossScaleState",
    "LossScaledState",
    "StaticLossScale",
    "StepResult",
    "apply_multiplier",
    "apply_scaled_gradients",
    "check_and_update",
    "check_grads",
    "check_sum_and_update",
    "check_sum_of_squares",
    "clip_coefficient",
    "combine_partials",
    "from_state_dict",
    "fused_optimizer_args",
    "global_norm_of_unscaled",
    "init",
    "inverse_scale",
    "is_stalled",
    "loss_scale_state",
    "make_config",
    "nonfinite_report",
    "recount_skipped_steps",
    "scale_loss",
    "select_if_finite",
    "state_dict_keys",
    "sum_of_unscaled_squares",
    "to_state_dict",
    "unscale_and_check",
    "update",
    "value_and_grad",
    "with_loss_scaling",
]
