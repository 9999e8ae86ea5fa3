"""Loss-scaling configuration: frozen, hashable, validated eagerly (SPEC section 1).

A configuration is static: it is closed over or passed as a static argument to ``jax.jit``.
Everything that changes from step to step lives in :class:`amp_core.LossScaleState`.
"""

from __future__ import annotations

import dataclasses
import math
import numbers
from typing import Any

import numpy as np

from amp_core.spike_skip import SpikeSkip
from hardware.half_dtypes import (
    DEFAULT_HALF_DTYPE,
    MIN_LOSS_SCALE_FLOOR,
    canonical_half_dtype,
    loss_scale_defaults,
)


@dataclasses.dataclass(frozen=True)
class StaticLossScale:
    """A fixed loss scale. ``update`` never changes it and overflow is never checked.

    Attributes:
        loss_scale: the constant scale (``1.0`` means no scaling).

    Example:
        >>> import amp_core
        >>> amp_core.StaticLossScale(loss_scale=128.0).loss_scale
        128.0
    """

    loss_scale: float = 1.0

    def __post_init__(self) -> None:
        object.__setattr__(self, "loss_scale", positive_finite("loss_scale", self.loss_scale))

    @property
    def is_dynamic(self) -> bool:
        """Always ``False``."""
        return False


@dataclasses.dataclass(frozen=True)
class DynamicLossScale:
    """Dynamic loss scaling (DLS), optionally with global gradient clipping (DLS + GCC).

    Every argument left as ``None`` takes the SPEC section 1 default for ``half_dtype``:
    ``init_scale`` and ``max_loss_scale`` ``2**31`` for cbfloat16 and ``2**15`` otherwise,
    ``min_loss_scale`` ``2**-14``, ``steps_per_increase`` ``2000``.

    The update rule, applied once per training step with that step's ``isfinite``::

        steps += 1; overflows += not isfinite
        if overflows / steps > overflow_tolerance:
            if absorbed < hysteresis - 1:           absorbed += 1   # a strike: scale kept
            else:                                   scale /= 2
            steps = overflows = 0
        elif isfinite and consecutive_hysteresis:   absorbed = 0
        if steps > steps_per_increase:
            scale *= 2; absorbed = 0
            steps = steps_per_increase + 1 - growth_interval; overflows = 0
        scale = min(scale, max_loss_scale); non_clamped = scale
        scale = max(scale, min_loss_scale)

    With the defaults (``hysteresis=1``, ``growth_interval=steps_per_increase + 1``) this is
    SPEC section 2 exactly. ``hysteresis``, ``consecutive_hysteresis`` and ``growth_interval``
    reproduce DeepSpeed's ``DynamicLossScaler`` and Megatron's ``DynamicGradScaler`` (see
    :func:`amp_core.from_deepspeed_config` and :func:`amp_core.from_megatron_args`).

    Attributes:
        init_scale: the first loss scale (the state starts at ``min(max_loss_scale, init_scale)``).
        steps_per_increase: the scale doubles on the ``steps_per_increase + 1``-th step after the
            last rescale; overflowed steps count too.
        min_loss_scale: lower bound, at least ``2**-14``.
        max_loss_scale: upper bound.
        overflow_tolerance: the fraction of overflowed steps since the last rescale tolerated
            before halving (strictly greater halves; ``0`` halves on any overflow).
        max_gradient_norm: if set, gradients are clipped to this global L2 norm in the same pass
            that unscales them and checks for overflow.
        half_dtype: the half dtype whose defaults fill the ``None`` arguments.
        stall_steps: a run has stalled (:func:`amp_core.is_stalled`) once this many consecutive
            steps overflowed with the scale already at ``min_loss_scale``: lowering the scale
            can no longer help (default ``steps_per_increase``). Overflows that hysteresis
            absorbs are not counted.
        hysteresis: how many overflows it takes to halve the scale (DeepSpeed's and Megatron's
            ``hysteresis``): the first ``hysteresis - 1`` are absorbed (the step is skipped,
            the scale kept, the growth count restarted). Absorbed overflows are forgiven when
            the scale grows, and not when it halves: once exhausted, every overflow halves
            until the next growth. ``1`` (the default) halves on every overflow, as SPEC
            section 2. Needs ``overflow_tolerance=0``.
        consecutive_hysteresis: also forgive the absorbed overflows at every finite step
            (DeepSpeed's ``consecutive_hysteresis``): only ``hysteresis`` overflows in a row
            halve the scale.
        growth_interval: the steps from one growth to the next when no overflow comes between
            (default ``steps_per_increase + 1``, SPEC section 2; DeepSpeed's scaler grows after
            ``loss_scale_window + 1`` finite steps, then every ``loss_scale_window``). From
            ``1`` to ``steps_per_increase + 1``; other than the default, it needs
            ``overflow_tolerance=0``.
        spike_skip: skip steps whose gradient norm (or loss) is far above its recent values
            (:class:`amp_core.SpikeSkip`); ``None`` (the default) never does.

    Example:
        >>> import amp_core
        >>> cfg = amp_core.DynamicLossScale(half_dtype="cbfloat16", steps_per_increase=100)
        >>> cfg.init_scale == 2.0**31, cfg.min_loss_scale == 2.0**-14
        (True, True)
    """

    init_scale: float | None = None
    steps_per_increase: int | None = None
    min_loss_scale: float | None = None
    max_loss_scale: float | None = None
    overflow_tolerance: float = 0.0
    max_gradient_norm: float | None = None
    half_dtype: str = DEFAULT_HALF_DTYPE
    stall_steps: int | None = None
    hysteresis: int = 1
    consecutive_hysteresis: bool = False
    growth_interval: int | None = None
    spike_skip: SpikeSkip | None = None

    def __post_init__(self) -> None:
        half = canonical_half_dtype(self.half_dtype, argument="half_dtype")
        defaults = loss_scale_defaults(half)
        resolved: dict[str, Any] = {
            "half_dtype": half,
            "init_scale": positive_finite(
                "init_scale", _default(self.init_scale, defaults.init_scale)
            ),
            "max_loss_scale": positive_finite(
                "max_loss_scale", _default(self.max_loss_scale, defaults.max_loss_scale)
            ),
            "min_loss_scale": positive_finite(
                "min_loss_scale", _default(self.min_loss_scale, defaults.min_loss_scale)
            ),
            "steps_per_increase": _positive_int(
                "steps_per_increase", _default(self.steps_per_increase, defaults.steps_per_increase)
            ),
            "overflow_tolerance": _non_negative_finite(
                "overflow_tolerance", self.overflow_tolerance
            ),
            "max_gradient_norm": None
            if self.max_gradient_norm is None
            else positive_finite("max_gradient_norm", self.max_gradient_norm),
        }
        resolved["stall_steps"] = _positive_int(
            "stall_steps", _default(self.stall_steps, resolved["steps_per_increase"])
        )
        if self.spike_skip is not None and not isinstance(self.spike_skip, SpikeSkip):
            raise TypeError(
                "spike_skip must be an amp_core.SpikeSkip or None; got "
                f"{type(self.spike_skip).__name__}"
            )
        resolved.update(
            _hysteresis_settings(
                self.hysteresis,
                self.consecutive_hysteresis,
                self.growth_interval,
                steps_per_increase=resolved["steps_per_increase"],
                overflow_tolerance=resolved["overflow_tolerance"],
            )
        )
        if resolved["min_loss_scale"] < MIN_LOSS_SCALE_FLOOR:
            raise ValueError(
                f"min_loss_scale must be at least 2**-14 = {MIN_LOSS_SCALE_FLOOR!r} for dynamic "
                f"loss scaling; got {resolved['min_loss_scale']!r}"
            )
        if resolved["min_loss_scale"] > resolved["max_loss_scale"]:
            raise ValueError(
                f"min_loss_scale must not exceed max_loss_scale; got min_loss_scale="
                f"{resolved['min_loss_scale']!r} > max_loss_scale={resolved['max_loss_scale']!r}"
            )
        for name, value in resolved.items():
            object.__setattr__(self, name, value)

    @property
    def is_dynamic(self) -> bool:
        """Always ``True``."""
        return True

    @property
    def clips(self) -> bool:
        """Whether global gradient clipping (GCC) is fused into the overflow check."""
        return self.max_gradient_norm is not None

    @property
    def has_hysteresis(self) -> bool:
        """Whether overflows can be absorbed (``hysteresis > 1``): the state then counts them."""
        return self.hysteresis > 1


def _hysteresis_settings(
    hysteresis: Any,
    consecutive_hysteresis: Any,
    growth_interval: Any,
    *,
    steps_per_increase: int,
    overflow_tolerance: float,
) -> dict[str, Any]:
    """Validates the hysteresis arguments of :class:`DynamicLossScale`; returns them resolved.

    Raises:
        TypeError: a value of the wrong type.
        ValueError: a value out of range, or ``hysteresis > 1`` or a ``growth_interval`` other
            than ``steps_per_increase + 1`` with ``overflow_tolerance > 0``.
    """
    if not isinstance(consecutive_hysteresis, bool):
        raise TypeError(
            f"consecutive_hysteresis must be a bool; got {consecutive_hysteresis!r} "
            f"({type(consecutive_hysteresis).__name__})"
        )
    strikes = _positive_int("hysteresis", hysteresis)
    if strikes > 1 and overflow_tolerance > 0:
        raise ValueError(
            f"hysteresis={strikes} and overflow_tolerance={overflow_tolerance!r} cannot be "
            "combined: both decide when an overflow halves the scale (hysteresis counts "
            "overflows, overflow_tolerance their fraction of the steps). Set one of them: "
            "hysteresis=1 or overflow_tolerance=0"
        )
    interval = _positive_int("growth_interval", _default(growth_interval, steps_per_increase + 1))
    if interval > steps_per_increase + 1:
        raise ValueError(
            f"growth_interval must be from 1 to steps_per_increase + 1 = {steps_per_increase + 1}; "
            f"got {growth_interval!r}"
        )
    if interval != steps_per_increase + 1 and overflow_tolerance > 0:
        raise ValueError(
            f"growth_interval={interval} needs overflow_tolerance=0 (it starts the step count "
            f"after a growth at {steps_per_increase + 1 - interval}, which would change the "
            f"overflow ratio); got overflow_tolerance={overflow_tolerance!r}"
        )
    return {
        "hysteresis": strikes,
        "consecutive_hysteresis": consecutive_hysteresis,
        "growth_interval": interval,
    }


_MAX_COUNTER = int(np.iinfo(np.int32).max)
"""Step counters are int32 in the state: ``steps_per_increase`` must fit."""

LossScaleConfig = StaticLossScale | DynamicLossScale
"""Either kind of loss-scaling configuration.

Example:
    >>> import amp_core
    >>> isinstance(amp_core.make_config("dynamic"), amp_core.LossScaleConfig)
    True
    >>> amp_core.make_config(128.0)
    StaticLossScale(loss_scale=128.0)
"""


def make_config(
    loss_scale: Any = None,
    *,
    init_scale: float | None = None,
    steps_per_increase: int | None = None,
    min_loss_scale: float | None = None,
    max_loss_scale: float | None = None,
    overflow_tolerance: float = 0.0,
    max_gradient_norm: float | None = None,
    half_dtype: Any = DEFAULT_HALF_DTYPE,
    stall_steps: int | None = None,
    hysteresis: int = 1,
    consecutive_hysteresis: bool = False,
    growth_interval: int | None = None,
    spike_skip: SpikeSkip | None = None,
) -> LossScaleConfig:
    """Builds a configuration from the ``cstorch.amp.GradScaler`` constructor arguments.

    ``loss_scale="dynamic"`` selects :class:`DynamicLossScale`; a number (or ``None``, meaning
    ``1.0``) selects :class:`StaticLossScale`, for which the dynamic-only arguments are ignored
    (as in the reference).

    Args:
        loss_scale: ``"dynamic"``, a positive finite number, or ``None``.
        init_scale: see :class:`DynamicLossScale`.
        steps_per_increase: see :class:`DynamicLossScale`.
        min_loss_scale: see :class:`DynamicLossScale`.
        max_loss_scale: see :class:`DynamicLossScale`.
        overflow_tolerance: see :class:`DynamicLossScale`.
        max_gradient_norm: see :class:`DynamicLossScale`.
        half_dtype: the half dtype whose defaults apply.
        stall_steps: see :class:`DynamicLossScale`.
        hysteresis: see :class:`DynamicLossScale`.
        consecutive_hysteresis: see :class:`DynamicLossScale`.
        growth_interval: see :class:`DynamicLossScale`.
        spike_skip: see :class:`DynamicLossScale` (dynamic scaling only).

    Returns:
        The validated configuration.

    Raises:
        ValueError: a string other than ``"dynamic"``, or an out-of-range value.
        TypeError: a value of the wrong type.

    Example:
        >>> import amp_core
        >>> amp_core.make_config("dynamic", steps_per_increase=10).steps_per_increase
        10
        >>> amp_core.make_config(None)
        StaticLossScale(loss_scale=1.0)
    """
    if isinstance(loss_scale, str):
        if loss_scale != "dynamic":
            raise ValueError(
                f'loss_scale must be "dynamic", a positive finite number or None; '
                f"got the string {loss_scale!r}"
            )
        return DynamicLossScale(
            init_scale=init_scale,
            steps_per_increase=steps_per_increase,
            min_loss_scale=min_loss_scale,
            max_loss_scale=max_loss_scale,
            overflow_tolerance=overflow_tolerance,
            max_gradient_norm=max_gradient_norm,
            half_dtype=half_dtype,
            stall_steps=stall_steps,
            hysteresis=hysteresis,
            consecutive_hysteresis=consecutive_hysteresis,
            growth_interval=growth_interval,
            spike_skip=spike_skip,
        )
    canonical_half_dtype(half_dtype, argument="half_dtype")
    if spike_skip is not None:
        raise ValueError(
            'spike_skip needs loss_scale="dynamic": a static loss scale never reads the '
            "gradients (for a fixed scale that skips, pin a dynamic one: init_scale = "
            "min_loss_scale = max_loss_scale)"
        )
    # Ignored by static scaling, as the other dynamic-only arguments; still checked, so that a
    # mistyped value is not carried silently.
    _hysteresis_settings(
        hysteresis,
        consecutive_hysteresis,
        growth_interval,
        steps_per_increase=_MAX_COUNTER - 1,
        overflow_tolerance=0.0,
    )
    return StaticLossScale(loss_scale=1.0 if loss_scale is None else loss_scale)


def _default(value: Any, default: Any) -> Any:
    return default if value is None else value


def real_number(name: str, value: Any) -> float:
    """Converts numbers and 0-d arrays or tensors to float; anything else is a TypeError."""
    if isinstance(value, (bool, str, bytes)) or value is None:
        raise TypeError(f"{name} must be a real number; got {value!r} ({type(value).__name__})")
    try:
        return float(value)
    except (TypeError, ValueError, RuntimeError) as err:
        raise TypeError(
            f"{name} must be a real number; got {value!r} ({type(value).__name__})"
        ) from err


def positive_finite(name: str, value: Any) -> float:
    """A number that stays positive and finite in float32, where scales and norms live.

    Raises:
        TypeError: not a real number.
        ValueError: not positive, or infinite or zero once rounded to float32.
    """
    number = real_number(name, value)
    with np.errstate(over="ignore", under="ignore"):
        as_float32 = float(np.float32(number)) if math.isfinite(number) else number
    if not (math.isfinite(as_float32) and as_float32 > 0):
        raise ValueError(
            f"{name} must be a positive number that is finite and nonzero in float32 "
            f"(about 1.4e-45 to 3.4e38); got {value!r}"
        )
    return number


def _non_negative_finite(name: str, value: Any) -> float:
    number = real_number(name, value)
    if not math.isfinite(number) or number < 0:
        raise ValueError(f"{name} must be a finite number >= 0; got {value!r}")
    return number


def _positive_int(name: str, value: Any) -> int:
    if isinstance(value, bool):
        raise TypeError(f"{name} must be an integer; got {value!r}")
    if isinstance(value, numbers.Integral):
        number = int(value)
    elif isinstance(value, numbers.Real) and float(value).is_integer():
        number = int(float(value))
    elif isinstance(value, numbers.Real):
        raise ValueError(f"{name} must be a whole number; got {value!r}")
    else:
        raise TypeError(f"{name} must be an integer; got {value!r} ({type(value).__name__})")
    if not 1 <= number <= _MAX_COUNTER:
        raise ValueError(f"{name} must be an integer from 1 to {_MAX_COUNTER}; got {value!r}")
    return number
