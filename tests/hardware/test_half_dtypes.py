"""The half-dtype table that amp_core reads its loss-scaling defaults from (SPEC section 1)."""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
import numpy as np
import pytest

from hardware import get_format
from hardware.half_dtypes import (
    DEFAULT_HALF_DTYPE,
    HALF_DTYPES,
    MIN_LOSS_SCALE_FLOOR,
    LossScaleDefaults,
    canonical_half_dtype,
    loss_scale_defaults,
)


class _FakeTorchDtype:
    def __init__(self, name: str) -> None:
        self.name = name

    def __str__(self) -> str:
        return f"torch.{self.name}"


def test_table_constants() -> None:
    assert HALF_DTYPES == ("float16", "bfloat16", "cbfloat16")
    assert DEFAULT_HALF_DTYPE == "float16"
    assert MIN_LOSS_SCALE_FLOOR == 2.0**-14


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        ("float16", "float16"),
        ("bfloat16", "bfloat16"),
        ("cbfloat16", "cbfloat16"),
        (jnp.float16, "float16"),
        (jnp.bfloat16, "bfloat16"),
        (np.dtype(np.float16), "float16"),
        (np.float16, "float16"),
        (_FakeTorchDtype("float16"), "float16"),
        (_FakeTorchDtype("bfloat16"), "bfloat16"),
    ],
)
def test_canonical_half_dtype(value, expected: str) -> None:
    assert canonical_half_dtype(value) == expected


def test_canonical_half_dtype_accepts_real_torch_dtypes() -> None:
    torch = pytest.importorskip("torch")
    assert canonical_half_dtype(torch.float16) == "float16"
    assert canonical_half_dtype(torch.bfloat16) == "bfloat16"
    with pytest.raises(ValueError, match=r"torch\.float32"):
        canonical_half_dtype(torch.float32)


@pytest.mark.parametrize(
    "value", ["float32", "cb16", "FLOAT16", jnp.float32, _FakeTorchDtype("float32"), 16, None]
)
def test_canonical_half_dtype_rejects_others_listing_the_accepted(value) -> None:
    with pytest.raises(ValueError, match="half_dtype must be one of 'float16', 'bfloat16', "):
        canonical_half_dtype(value)


def test_error_names_the_argument() -> None:
    with pytest.raises(ValueError, match=r"^value must be one of .*got 'float8'$"):
        canonical_half_dtype("float8", argument="value")


@pytest.mark.parametrize(
    ("half_dtype", "scale"),
    [("float16", 2.0**15), ("bfloat16", 2.0**15), ("cbfloat16", 2.0**31), (jnp.bfloat16, 2.0**15)],
)
def test_loss_scale_defaults(half_dtype, scale: float) -> None:
    defaults = loss_scale_defaults(half_dtype)
    assert defaults == LossScaleDefaults(
        init_scale=scale, max_loss_scale=scale, min_loss_scale=2.0**-14, steps_per_increase=2000
    )


def test_loss_scale_defaults_default_to_float16_and_reject_unknown() -> None:
    assert loss_scale_defaults() is loss_scale_defaults("float16")
    with pytest.raises(ValueError, match="half_dtype must be one of"):
        loss_scale_defaults("float32")


def test_defaults_are_frozen_and_hashable() -> None:
    defaults = loss_scale_defaults("cbfloat16")
    with pytest.raises(dataclasses.FrozenInstanceError):
        defaults.init_scale = 1.0  # type: ignore[misc]
    assert hash(defaults) == hash(loss_scale_defaults("cbfloat16"))


@pytest.mark.parametrize("half_dtype", HALF_DTYPES)
def test_every_half_dtype_is_a_format_whose_range_holds_the_max_scale(half_dtype: str) -> None:
    fmt = get_format(half_dtype)
    assert fmt.name == half_dtype and fmt.total_bits == 16
    assert loss_scale_defaults(half_dtype).max_loss_scale <= fmt.max
    assert loss_scale_defaults(half_dtype).min_loss_scale >= MIN_LOSS_SCALE_FLOOR
