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
        if overflows / steps > overflow_tolerance:  scale /= 2; steps = overflows = 0
        if steps > steps_per_increase:              scale *= 2; steps = overflows = 0
        scale = min(scale, max_loss_scale); non_clamped = scale
        scale = max(scale, min_loss_scale)

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
            can no longer help (default ``steps_per_increase``).

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
        )
    canonical_half_dtype(half_dtype, argument="half_dtype")
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
