"""Numeric formats (cbfloat16 and the IEEE-like 16-bit formats), precision policies, device facts."""

from hardware.devices import (
    backend,
    jax_device_for,
    native_half_dtypes,
    recommended_half_dtype,
)
from hardware.formats import (
    BFLOAT16,
    CBFLOAT16,
    FLOAT8_E3M4,
    FLOAT8_E4M3,
    FLOAT8_E4M3FN,
    FLOAT8_E5M2,
    FLOAT16,
    FloatFormat,
    get_format,
    known_formats,
)
from hardware.half_dtypes import (
    DEFAULT_HALF_DTYPE,
    HALF_DTYPES,
    MIN_LOSS_SCALE_FLOOR,
    LossScaleDefaults,
    canonical_half_dtype,
    loss_scale_defaults,
)
from hardware.policy import Policy, canonical_dtype, cast_tree, dtype_name, get_policy

__all__ = [
    "BFLOAT16",
    "CBFLOAT16",
    "DEFAULT_HALF_DTYPE",
    "FLOAT8_E3M4",
    "FLOAT8_E4M3",
    "FLOAT8_E4M3FN",
    "FLOAT8_E5M2",
    "FLOAT16",
    "HALF_DTYPES",
    "MIN_LOSS_SCALE_FLOOR",
    "FloatFormat",
    "LossScaleDefaults",
    "Policy",
    "backend",
    "canonical_dtype",
    "canonical_half_dtype",
    "cast_tree",
    "dtype_name",
    "get_format",
    "get_policy",
    "jax_device_for",
    "known_formats",
    "loss_scale_defaults",
    "native_half_dtypes",
    "recommended_half_dtype",
]
