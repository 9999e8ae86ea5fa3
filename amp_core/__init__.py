"""Cerebras-style loss scaling as pure, jittable JAX functions.

Configuration is a frozen dataclass (:class:`StaticLossScale`, :class:`DynamicLossScale`), state
a NamedTuple of arrays (:class:`LossScaleState`), and every operation a pure function of them.

The integrations with flax live in their own modules, imported on first use so that
``import amp_core`` needs neither flax nor equinox: :mod:`amp_core.flax_nnx`
(``LossScaledOptimizer``) and :mod:`amp_core.flax_linen` (``LossScaledTrainState``). equinox
models need no module of their own: :func:`value_and_grad` and :func:`apply_scaled_gradients`
pass their non-array leaves through.
"""

import importlib
from typing import Any

from amp_core.config import DynamicLossScale, LossScaleConfig, StaticLossScale, make_config
from amp_core.diagnostics import (
    GradientRange,
    LeafReport,
    gradient_range_report,
    gradient_range_totals,
    nonfinite_report,
    scaler_metrics,
    suggested_loss_scale,
)
from amp_core.framework_configs import (
    UNBOUNDED_LOSS_SCALE,
    from_deepspeed_config,
    from_megatron_args,
)
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
from amp_core.spike_skip import (
    SPIKE_METRICS,
    SpikeSkip,
    SpikeState,
    check_spike,
    init_spikes,
    spike_threshold,
)
from amp_core.state import (
    LossScaleState,
    from_state_dict,
    init,
    init_on_host,
    state_dict_keys,
    to_state_dict,
)
from amp_core.transforms import (
    LossScaledState,
    apply_scaled_gradients,
    loss_scale_state,
    spike_state,
    step_applied,
    value_and_grad,
    with_loss_scaling,
)

__version__ = "0.1.0"
"""The version of the ``cstorch-amp`` distribution (its one source: pyproject reads it)."""

__all__ = [
    "CLIP_EPSILON",
    "SPIKE_METRICS",
    "UNBOUNDED_LOSS_SCALE",
    "DynamicLossScale",
    "GradCheck",
    "GradientRange",
    "LeafReport",
    "LossScaleConfig",
    "LossScaleState",
    "LossScaledState",
    "SpikeSkip",
    "SpikeState",
    "StaticLossScale",
    "StepResult",
    "apply_multiplier",
    "apply_scaled_gradients",
    "check_and_update",
    "check_grads",
    "check_spike",
    "check_sum_and_update",
    "check_sum_of_squares",
    "clip_coefficient",
    "combine_partials",
    "from_deepspeed_config",
    "from_megatron_args",
    "from_state_dict",
    "fused_optimizer_args",
    "global_norm_of_unscaled",
    "gradient_range_report",
    "gradient_range_totals",
    "init",
    "init_on_host",
    "init_spikes",
    "inverse_scale",
    "is_stalled",
    "loss_scale_state",
    "make_config",
    "nonfinite_report",
    "recount_skipped_steps",
    "scale_loss",
    "scaler_metrics",
    "select_if_finite",
    "spike_state",
    "spike_threshold",
    "state_dict_keys",
    "step_applied",
    "suggested_loss_scale",
    "sum_of_unscaled_squares",
    "to_state_dict",
    "unscale_and_check",
    "update",
    "value_and_grad",
    "with_loss_scaling",
]

_LAZY_SUBMODULES = ("flax_linen", "flax_nnx")


def __getattr__(name: str) -> Any:
    """``amp_core.flax_nnx`` and ``amp_core.flax_linen``, imported (with flax) on first use."""
    if name in _LAZY_SUBMODULES:
        return importlib.import_module(f"amp_core.{name}")
    raise AttributeError(f"module 'amp_core' has no attribute {name!r}")
