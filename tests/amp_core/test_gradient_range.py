"""amp_core.gradient_range_report against counts computed independently with numpy (float16),
ml_dtypes (bfloat16) and the documented cbfloat16 thresholds, on hand-made gradients."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import optax
import pytest

import amp_core

RNG = np.random.default_rng(7)
# Magnitudes from far below every format's subnormals to beyond float16's and cbfloat16's range.
VALUES = np.concatenate(
    [
        np.sign(RNG.standard_normal(4000)) * 2.0 ** RNG.uniform(-60, 40, 4000),
        [0.0, -0.0, np.inf, -np.inf, np.nan, 65504.0, 65520.0, 2.0**-25, 2.0**-24, 2.0**-40],
    ]
).astype(np.float32)

NUMPY_DTYPES = {"float16": np.float16, "bfloat16": ml_dtypes.bfloat16}


def oracle(values: np.ndarray, fmt: str, scale: float) -> dict[str, float]:
    """The counts, from numpy's and ml_dtypes' casts (cbfloat16: its documented range)."""
    finite = np.isfinite(values)
    scaled = values.astype(np.float32) * np.float32(scale)
    with np.errstate(over="ignore", invalid="ignore"):
        if fmt == "cbfloat16":
            # Round-to-nearest-even: |x| <= 2**-40 (half the smallest subnormal 2**-39) -> 0;
            # |x| >= (2 - 2**-10) * 2**31 (the midpoint above the largest value) -> inf.
            magnitude = np.abs(scaled.astype(np.float64))
            rounded_zero = magnitude <= 2.0**-40
            rounded_inf = magnitude >= (2 - 2**-10) * 2.0**31
            subnormal = ~rounded_zero & (magnitude < 2.0**-30)
            largest_finite = (2 - 2**-9) * 2.0**31
        else:
            rounded = scaled.astype(NUMPY_DTYPES[fmt]).astype(np.float64)
            rounded_zero = rounded == 0
            rounded_inf = np.isinf(rounded)
            info = ml_dtypes.finfo(NUMPY_DTYPES[fmt])
            subnormal = ~rounded_zero & (np.abs(rounded) < float(info.smallest_normal))
            largest_finite = float(info.max)
    nonzero = finite & (values != 0)
    largest = np.max(np.abs(scaled[finite]).astype(np.float64), initial=0.0)
    if largest == 0:
        headroom = math.inf
    else:  # doubling by doubling, in float64, rounding each candidate as the format would
        overflow_from = largest_finite + 0.5 * _ulp_at_max(fmt)  # the midpoint rounds up to inf
        headroom = 0
        while largest * 2.0**headroom >= overflow_from:
            headroom -= 1
        while largest * 2.0 ** (headroom + 1) < overflow_from:
            headroom += 1
    return {
        "size": values.size,
        "zeros": int(np.sum(values == 0)),
        "underflows": int(np.sum(nonzero & rounded_zero)),
        "subnormals": int(np.sum(nonzero & subnormal & finite)),
        "overflows": int(np.sum(finite & rounded_inf)),
        "nonfinite": int(np.sum(~finite)),
        "headroom": float(headroom),
    }


def _ulp_at_max(fmt: str) -> float:
    mantissa_bits, emax = {"float16": (10, 15), "bfloat16": (7, 127), "cbfloat16": (9, 31)}[fmt]
    return 2.0 ** (emax - mantissa_bits)


def as_dict(report: amp_core.GradientRange) -> dict[str, float]:
    host = jax.device_get(report)
    return {name: float(value) for name, value in host._asdict().items()}


@pytest.mark.parametrize("fmt", ["float16", "bfloat16", "cbfloat16"])
@pytest.mark.parametrize("scale", [1.0, 2.0**-10, 2.0**15, 2.0**31, 3.0])
@pytest.mark.parametrize("jit", [False, True])
def test_counts_match_numpy_and_ml_dtypes(fmt: str, scale: float, jit: bool) -> None:
    finite_part = VALUES[np.isfinite(VALUES)]

    def report(v: jax.Array, s: jax.Array) -> amp_core.GradientRange:
        return amp_core.gradient_range_report(v, half_dtype=fmt, loss_scale=s)

    for values in (VALUES, finite_part):
        got = as_dict((jax.jit(report) if jit else report)(jnp.asarray(values), jnp.float32(scale)))
        assert got == pytest.approx(oracle(values, fmt, scale)), (fmt, scale)


def test_headroom_counts_doublings_exactly_at_the_rounding_boundary() -> None:
    # 65519 rounds to 65504 (finite), 65520 rounds to inf: float16's overflow midpoint.
    cases = {65519.0: 0.0, 65520.0: -1.0, 32759.5: 1.0, 32760.0: 0.0, 1.0: 15.0}
    for value, expected in cases.items():
        report = amp_core.gradient_range_report(jnp.array([value], jnp.float32))
        assert float(report.headroom) == expected, value
        assert (
            float(report.headroom)
            == oracle(np.array([value], np.float32), "float16", 1.0)["headroom"]
        )


def test_a_pytree_gets_one_report_per_leaf_and_totals_sum_them() -> None:
    grads = {
        "w": jnp.asarray(VALUES[:2000]),
        "b": jnp.asarray(VALUES[2000:]),
        "step": jnp.arange(3),
    }
    report = amp_core.gradient_range_report(grads, half_dtype="float16", loss_scale=2.0**8)
    assert set(report) == {"w", "b", "step"}
    assert as_dict(report["w"]) == pytest.approx(oracle(VALUES[:2000], "float16", 2.0**8))
    assert int(report["step"].size) == 0  # integer leaves are not gradients
    total = as_dict(amp_core.gradient_range_totals(report))
    expected = oracle(VALUES, "float16", 2.0**8)
    assert total == pytest.approx(expected)


def test_the_scale_can_come_from_a_scaler_state() -> None:
    tx = amp_core.with_loss_scaling(optax.sgd(0.1), amp_core.DynamicLossScale(init_scale=2.0**12))
    state = tx.init({"w": jnp.zeros(3)})
    grads = jnp.asarray(VALUES)
    from_state = as_dict(amp_core.gradient_range_report(grads, loss_scale=state))
    assert from_state == pytest.approx(oracle(VALUES, "float16", 2.0**12))


def test_all_zero_gradients_have_unbounded_headroom() -> None:
    report = amp_core.gradient_range_report(jnp.zeros(4))
    assert float(report.headroom) == math.inf and int(report.zeros) == 4


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"half_dtype": "float8"}, "half_dtype: unknown number format 'float8'"),
        ({"loss_scale": 0.0}, "loss_scale must be positive and finite; got 0.0"),
        ({"loss_scale": -2}, "loss_scale must be positive and finite; got -2"),
        ({"loss_scale": math.inf}, "loss_scale must be positive and finite; got inf"),
        ({"loss_scale": jnp.ones(2)}, r"loss_scale must be 0-d; got shape \(2,\)"),
        ({"loss_scale": "dynamic"}, "loss_scale must be a positive number, .* got str"),
    ],
)
def test_bad_arguments_are_named(kwargs: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        amp_core.gradient_range_report(jnp.ones(2), **kwargs)


def test_totals_reject_what_is_not_a_report() -> None:
    with pytest.raises(TypeError, match="report must be the result of gradient_range_report"):
        amp_core.gradient_range_totals({"w": jnp.ones(2)})


# The suggested loss scale: hand-computed powers of two. float16's largest value is 65504 and
# x rounds to inf from 65520 on; cbfloat16's largest is (2 - 2**-9) * 2**31; bfloat16's
# (2 - 2**-7) * 2**127.
SUGGESTIONS = [
    # (largest |gradient|, format, headroom, the largest power of two s with round(g * s * 2**h)
    # finite: worked by hand)
    (0.5, "float16", 0, 2.0**16),  # 0.5 * 2**16 = 32768 <= 65504; 0.5 * 2**17 = 65536 -> inf
    (0.5, "float16", 2, 2.0**14),
    (3.0, "float16", 0, 2.0**14),  # 3 * 2**14 = 49152; 3 * 2**15 = 98304 -> inf
    (65504.0, "float16", 0, 1.0),
    (65520.0, "float16", 0, 0.5),  # rounds to inf at scale 1 already
    (2.0**-20, "float16", 1, 2.0**34),  # 2**-20 * 2**35 = 2**15 <= 65504; 2**16 -> inf
    (1.0, "cbfloat16", 0, 2.0**31),
    (1.0, "cbfloat16", 3, 2.0**28),
    (1.0, "bfloat16", 0, 2.0**127),
    (2.0**-30, "bfloat16", 0, 2.0**127),  # 2**157 would do, but float32 stops at 2**127
    (1e5, "float16", 2, 2.0**-3),  # 1e5 / 8 = 12500, x 4 = 50000 <= 65504; x 8 -> inf
]


@pytest.mark.parametrize(("largest", "fmt", "headroom", "expected"), SUGGESTIONS)
@pytest.mark.parametrize("jit", [False, True])
def test_the_suggested_loss_scale_is_the_largest_power_of_two_leaving_the_headroom(
    largest: float, fmt: str, headroom: int, expected: float, jit: bool
) -> None:
    small = RNG.uniform(-1, 1, 50).astype(np.float32) * np.float32(largest) / 4
    grads = {
        "w": jnp.asarray(np.append(small, -largest).astype(np.float32)),
        "b": jnp.array([0.0, np.nan, np.inf], jnp.float32),  # ignored
        "step": jnp.arange(3),  # not a gradient
    }

    def suggest(g: dict) -> jax.Array:
        return amp_core.suggested_loss_scale(g, half_dtype=fmt, headroom=headroom)

    got = float((jax.jit(suggest) if jit else suggest)(grads))
    assert got == expected
    if expected < 2.0**127:  # the report at the suggestion shows exactly the headroom asked for
        finite = {"w": grads["w"]}
        report = amp_core.gradient_range_report(finite, half_dtype=fmt, loss_scale=got)
        assert float(report["w"].headroom) == headroom


def test_the_suggested_loss_scale_of_zero_gradients_is_unbounded() -> None:
    assert float(amp_core.suggested_loss_scale({"w": jnp.zeros(3)})) == math.inf


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"half_dtype": "float8"}, "half_dtype: unknown number format 'float8'"),
        ({"headroom": -1}, r"headroom must be a non-negative integer \(doublings\); got -1"),
        ({"headroom": 1.5}, "headroom must be a non-negative integer .* got 1.5"),
        ({"headroom": True}, "headroom must be a non-negative integer .* got True"),
    ],
)
def test_the_suggested_loss_scale_names_bad_arguments(kwargs: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        amp_core.suggested_loss_scale(jnp.ones(2), **kwargs)
