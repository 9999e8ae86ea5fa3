"""The 16-bit "half" dtypes the project knows, and the loss-scaling defaults that depend on them.

This is the single table SPEC section 1 refers to: ``amp_core`` and ``torch_facade`` read the
per-half-dtype defaults from here and nowhere else.
"""

from __future__ import annotations

import dataclasses
from typing import Any

HALF_DTYPES: tuple[str, ...] = ("float16", "bfloat16", "cbfloat16")
"""Canonical names of the supported half dtypes, in the order error messages list them.

Example:
    >>> import hardware
    >>> hardware.HALF_DTYPES
    ('float16', 'bfloat16', 'cbfloat16')
"""

DEFAULT_HALF_DTYPE = "float16"
"""The half dtype when none is given (``DynamicLossScale``, the facade's ``set_half_dtype``).

Example:
    >>> import amp_core, hardware
    >>> amp_core.DynamicLossScale().half_dtype == hardware.DEFAULT_HALF_DTYPE == "float16"
    True
"""

MIN_LOSS_SCALE_FLOOR = 2.0**-14
"""The smallest ``min_loss_scale`` dynamic loss scaling accepts (SPEC section 1).

Example:
    >>> import amp_core, hardware
    >>> hardware.MIN_LOSS_SCALE_FLOOR == 2**-14 == amp_core.DynamicLossScale().min_loss_scale
    True
"""


@dataclasses.dataclass(frozen=True)
class LossScaleDefaults:
    """Dynamic-loss-scaling defaults for one half dtype (SPEC section 1).

    Attributes:
        init_scale: initial loss scale.
        max_loss_scale: upper bound of the loss scale.
        min_loss_scale: lower bound of the loss scale (also the smallest value accepted).
        steps_per_increase: finite-or-not steps after which the scale doubles.

    Example:
        >>> import hardware
        >>> defaults = hardware.loss_scale_defaults("cbfloat16")
        >>> type(defaults).__name__, defaults.init_scale == defaults.max_loss_scale == 2.0**31
        ('LossScaleDefaults', True)
        >>> defaults.min_loss_scale == 2**-14, defaults.steps_per_increase
        (True, 2000)
    """

    init_scale: float
    max_loss_scale: float
    min_loss_scale: float = MIN_LOSS_SCALE_FLOOR
    steps_per_increase: int = 2000


_LOSS_SCALE_DEFAULTS: dict[str, LossScaleDefaults] = {
    "float16": LossScaleDefaults(init_scale=2.0**15, max_loss_scale=2.0**15),
    "bfloat16": LossScaleDefaults(init_scale=2.0**15, max_loss_scale=2.0**15),
    "cbfloat16": LossScaleDefaults(init_scale=2.0**31, max_loss_scale=2.0**31),
}


def canonical_half_dtype(value: Any, *, argument: str = "half_dtype") -> str:
    """Returns the canonical name of a half dtype given as a string or dtype-like object.

    Accepts ``"float16"``, ``"bfloat16"``, ``"cbfloat16"``, numpy/JAX dtypes and scalar types of
    float16 and bfloat16, and any object whose ``str()`` is ``"torch.float16"`` or
    ``"torch.bfloat16"`` (so torch dtypes work without importing torch here).

    Args:
        value: the half dtype.
        argument: the argument name used in the error message.

    Returns:
        One of :data:`HALF_DTYPES`.

    Raises:
        ValueError: ``value`` names no supported half dtype.

    Example:
        >>> canonical_half_dtype("cbfloat16")
        'cbfloat16'
        >>> import jax.numpy as jnp
        >>> canonical_half_dtype(jnp.bfloat16)
        'bfloat16'
    """
    name: str | None
    if isinstance(value, str):
        name = value
    else:
        text = str(value)
        if text.startswith("torch."):
            name = text.removeprefix("torch.")
        else:
            name = _numpy_dtype_name(value)
    if name in HALF_DTYPES:
        return name
    raise ValueError(
        f"{argument} must be one of {', '.join(repr(n) for n in HALF_DTYPES)}, "
        f"torch.float16 or torch.bfloat16 (or the numpy/JAX float16 and bfloat16 dtypes); "
        f"got {value!r}"
    )


def _numpy_dtype_name(value: Any) -> str | None:
    import numpy as np

    try:
        return np.dtype(value).name
    except TypeError:
        return None


def loss_scale_defaults(half_dtype: Any = DEFAULT_HALF_DTYPE) -> LossScaleDefaults:
    """Returns the dynamic-loss-scaling defaults for ``half_dtype`` (SPEC section 1).

    Example:
        >>> loss_scale_defaults("cbfloat16").init_scale == 2.0**31
        True
        >>> loss_scale_defaults("float16").max_loss_scale
        32768.0
    """
    return _LOSS_SCALE_DEFAULTS[canonical_half_dtype(half_dtype)]
