"""Bit-exactness of the generic FloatFormat against numpy, ml_dtypes and an independent reference."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from hardware import formats
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

# (our format, the numpy/ml_dtypes dtype that is the oracle)
ORACLES = [
    (FLOAT16, np.dtype(np.float16)),
    (BFLOAT16, np.dtype(ml_dtypes.bfloat16)),
    (FLOAT8_E5M2, np.dtype(ml_dtypes.float8_e5m2)),
    (FLOAT8_E4M3, np.dtype(ml_dtypes.float8_e4m3)),
    (FLOAT8_E4M3FN, np.dtype(ml_dtypes.float8_e4m3fn)),
    (FLOAT8_E3M4, np.dtype(ml_dtypes.float8_e3m4)),
]
ORACLE_IDS = [fmt.name for fmt, _ in ORACLES]

N_RANDOM = 100_000


# ---------------------------------------------------------------------------------------------
# Helpers.


def _bits(x) -> np.ndarray:
    return np.asarray(x, np.float32).view(np.uint32)


def assert_same_float32(got, want) -> None:
    """Bit-identical, except that NaNs only need to agree in position and sign."""
    got = np.asarray(got, np.float32)
    want = np.asarray(want, np.float32)
    assert got.shape == want.shape
    got_nan, want_nan = np.isnan(got), np.isnan(want)
    np.testing.assert_array_equal(got_nan, want_nan, err_msg="NaN positions differ")
    np.testing.assert_array_equal(np.signbit(got), np.signbit(want), err_msg="signs differ")
    bad = np.flatnonzero((_bits(got) != _bits(want)) & ~want_nan)
    assert bad.size == 0, (
        f"{bad.size} values differ, e.g. got {got.flat[bad[0]]!r} ({_bits(got).flat[bad[0]]:#010x})"
        f" want {want.flat[bad[0]]!r} ({_bits(want).flat[bad[0]]:#010x})"
    )


def oracle_codes(x: np.ndarray, dtype: np.dtype) -> np.ndarray:
    with np.errstate(over="ignore", invalid="ignore"):
        return x.astype(dtype).view(f"uint{dtype.itemsize * 8}")


def oracle_round(x: np.ndarray, dtype: np.dtype) -> np.ndarray:
    with np.errstate(over="ignore", invalid="ignore"):
        return x.astype(dtype).astype(np.float32)


def all_codes(fmt: FloatFormat) -> np.ndarray:
    return np.arange(2**fmt.total_bits, dtype=np.uint32).astype(fmt.bits_dtype)


def reference_round(x: np.ndarray, fmt: FloatFormat) -> np.ndarray:
    """An independent model of FloatFormat.round: float64 arithmetic and np.rint (ties to even)."""
    with np.errstate(invalid="ignore"):  # signalling NaNs
        x = np.asarray(x, np.float32).astype(np.float64)
    magnitude = np.abs(x)
    finite_nonzero = np.isfinite(x) & (magnitude > 0)
    safe = np.where(finite_nonzero, magnitude, 1.0)
    exponent = np.frexp(safe)[1] - 1  # floor(log2 |x|), exact
    if fmt.subnormals:
        exponent = np.maximum(exponent, fmt.emin)
    quantum_exponent = exponent - fmt.mantissa_bits
    y = np.ldexp(np.rint(np.ldexp(safe, -quantum_exponent)), quantum_exponent)
    y = np.where(finite_nonzero, y, magnitude)
    if not fmt.subnormals:
        y = np.where(y < fmt.min_normal, 0.0, y)
    if fmt.saturate:
        overflow, infinity = fmt.max, (np.inf if fmt.has_inf else fmt.max)
    else:
        overflow = infinity = np.inf if fmt.has_inf else np.nan
    y = np.where(np.isfinite(x) & (y > fmt.max), overflow, y)
    y = np.where(np.isinf(x), infinity, y)
    y = np.where(np.isnan(x), np.nan, y)
    return np.copysign(y, x).astype(np.float32)


def random_float32(rng: np.random.Generator, n: int) -> np.ndarray:
    """Random bit patterns: every exponent equally likely, NaN and inf included."""
    return rng.integers(0, 2**32, size=n, dtype=np.uint64).astype(np.uint32).view(np.float32)


def focused_float32(rng: np.random.Generator, fmt: FloatFormat, n: int) -> np.ndarray:
    """Log-uniform values around the overflow threshold and across the subnormal range."""
    low = np.log2(fmt.smallest_subnormal) - 2, np.log2(fmt.min_normal) + 2
    high = np.log2(fmt.max) - 1, min(np.log2(fmt.max) + 1, 127.9)
    parts = [2.0 ** rng.uniform(*span, size=n // 2) for span in (low, high)]
    values = np.concatenate(parts).astype(np.float32)
    return np.where(rng.random(values.size) < 0.5, -values, values).astype(np.float32)


def grid_midpoints(fmt: FloatFormat) -> np.ndarray:
    """Every midpoint between neighbouring non-negative values, the one above max, and the
    float32 neighbours of each midpoint; all with both signs."""
    values = np.asarray(fmt.decode(all_codes(fmt)), np.float64)
    values = np.unique(values[np.isfinite(values) & (values >= 0)])
    above_max = fmt.max + 2.0 ** (fmt.emax - fmt.mantissa_bits) / 2
    mids64 = np.append((values[:-1] + values[1:]) / 2, above_max)
    mids = mids64.astype(np.float32)
    np.testing.assert_array_equal(mids.astype(np.float64), mids64)  # exact in float32
    below = np.nextafter(mids, np.float32(0))
    above = np.nextafter(mids, np.float32(np.inf))
    positive = np.concatenate([mids, below, above])
    return np.concatenate([positive, -positive])


# ---------------------------------------------------------------------------------------------
# The generic code reproduces numpy float16, ml_dtypes bfloat16 and four ml_dtypes float8 formats.


@pytest.mark.parametrize(("fmt", "dtype"), ORACLES, ids=ORACLE_IDS)
def test_constants_match_finfo(fmt: FloatFormat, dtype: np.dtype) -> None:
    info = ml_dtypes.finfo(dtype)
    assert fmt.total_bits == dtype.itemsize * 8
    assert fmt.bits_dtype.itemsize == dtype.itemsize
    assert fmt.max == float(info.max)
    assert fmt.min_normal == float(info.smallest_normal)
    assert fmt.smallest_subnormal == float(info.smallest_subnormal)
    assert fmt.eps == float(info.eps)
    assert fmt.emin == info.minexp
    assert fmt.emax == info.maxexp - 1


@pytest.mark.parametrize(("fmt", "dtype"), ORACLES, ids=ORACLE_IDS)
def test_decode_matches_oracle_on_every_code(fmt: FloatFormat, dtype: np.dtype) -> None:
    codes = all_codes(fmt)
    assert_same_float32(fmt.decode(codes), codes.view(dtype).astype(np.float32))


@pytest.mark.parametrize(("fmt", "dtype"), ORACLES, ids=ORACLE_IDS)
def test_every_code_value_rounds_and_encodes_to_itself(fmt: FloatFormat, dtype: np.dtype) -> None:
    codes = all_codes(fmt)
    values = codes.view(dtype).astype(np.float32)
    is_nan = np.isnan(values)
    assert_same_float32(fmt.round(values), values)
    encoded = np.asarray(fmt.encode(values))
    assert encoded.dtype == codes.dtype
    np.testing.assert_array_equal(encoded[~is_nan], codes[~is_nan])
    assert np.isnan(encoded[is_nan].view(dtype).astype(np.float32)).all()


@pytest.mark.parametrize(("fmt", "dtype"), ORACLES, ids=ORACLE_IDS)
def test_random_float32_matches_oracle(fmt: FloatFormat, dtype: np.dtype) -> None:
    rng = np.random.default_rng(20240607)
    x = np.concatenate([random_float32(rng, N_RANDOM), focused_float32(rng, fmt, 40_000)])
    want = oracle_codes(x, dtype)
    got = np.asarray(fmt.encode(x))
    is_nan = np.isnan(x)
    np.testing.assert_array_equal(got[~is_nan], want[~is_nan])
    assert np.isnan(np.asarray(fmt.decode(got[is_nan]))).all()
    assert_same_float32(fmt.round(x), oracle_round(x, dtype))


@pytest.mark.parametrize(("fmt", "dtype"), ORACLES, ids=ORACLE_IDS)
def test_midpoints_tie_to_even_like_oracle(fmt: FloatFormat, dtype: np.dtype) -> None:
    x = grid_midpoints(fmt)
    np.testing.assert_array_equal(np.asarray(fmt.encode(x)), oracle_codes(x, dtype))
    assert_same_float32(fmt.round(x), oracle_round(x, dtype))


@pytest.mark.parametrize(("fmt", "dtype"), ORACLES, ids=ORACLE_IDS)
def test_independent_reference_agrees_with_oracle(fmt: FloatFormat, dtype: np.dtype) -> None:
    """Validates reference_round itself, which then checks cbfloat16 and random formats."""
    rng = np.random.default_rng(7)
    x = np.concatenate([random_float32(rng, 20_000), grid_midpoints(fmt)])
    assert_same_float32(reference_round(x, fmt), oracle_round(x, dtype))


# ---------------------------------------------------------------------------------------------
# cbfloat16.


def test_cbfloat16_constants() -> None:
    assert CBFLOAT16.total_bits == 16
    assert CBFLOAT16.bits_dtype == jnp.uint16
    assert (CBFLOAT16.exponent_bits, CBFLOAT16.mantissa_bits, CBFLOAT16.bias) == (6, 9, 31)
    assert CBFLOAT16.max == (2 - 2**-9) * 2.0**31
    assert CBFLOAT16.min_normal == 2.0**-30
    assert CBFLOAT16.smallest_subnormal == 2.0**-39
    assert CBFLOAT16.eps == 2.0**-9


def test_cbfloat16_round_trip_over_all_codes() -> None:
    codes = all_codes(CBFLOAT16)
    values = np.asarray(CBFLOAT16.decode(codes))
    exponent_field, fraction = (codes >> 9) & 0x3F, codes & 0x1FF
    nan_codes = (exponent_field == 0x3F) & (fraction != 0)
    assert nan_codes.sum() == 2 * 511
    assert np.isnan(values[nan_codes]).all()
    assert not np.isnan(values[~nan_codes]).any()
    np.testing.assert_array_equal(np.signbit(values), codes >= 0x8000)
    encoded = np.asarray(CBFLOAT16.encode(values))
    np.testing.assert_array_equal(encoded[~nan_codes], codes[~nan_codes])
    assert np.isnan(np.asarray(CBFLOAT16.decode(encoded[nan_codes]))).all()
    np.testing.assert_array_equal(encoded[nan_codes] & 0x8000, codes[nan_codes] & 0x8000)
    # Codes order like the values they stand for: 0x0000 .. 0x7E00 (= inf) strictly increase.
    positive = values[:0x7E01]
    assert (np.diff(positive) > 0).all()
    assert positive[-1] == np.inf and positive[-2] == CBFLOAT16.max
    assert_same_float32(CBFLOAT16.round(values), values)


MAX = np.float32((2 - 2**-9) * 2.0**31)
ABOVE_MAX_MIDPOINT = np.float32((2 - 2**-10) * 2.0**31)
TINY = np.float32(2.0**-39)

CBFLOAT16_EDGES = [
    # (input, expected output, expected code)
    (MAX, MAX, 0x7DFF),
    (ABOVE_MAX_MIDPOINT, np.inf, 0x7E00),  # tie: max has an odd mantissa, rounds up to inf
    (np.nextafter(ABOVE_MAX_MIDPOINT, 0), MAX, 0x7DFF),  # just below: stays max
    (-ABOVE_MAX_MIDPOINT, -np.inf, 0xFE00),
    (np.float32(2.0**32), np.inf, 0x7E00),
    (np.float32(3.0e38), np.inf, 0x7E00),
    (np.inf, np.inf, 0x7E00),
    (-np.inf, -np.inf, 0xFE00),
    (TINY, TINY, 0x0001),
    (TINY / 2, 0.0, 0x0000),  # tie between 0 (even) and TINY: goes to 0
    (-TINY / 2, -0.0, 0x8000),  # ... keeping the sign
    (np.nextafter(TINY / 2, 1), TINY, 0x0001),  # slightly above half: up to TINY
    (TINY * 1.5, TINY * 2, 0x0002),  # tie between 1 and 2 quanta: to 2 (even)
    (TINY * 2.5, TINY * 2, 0x0002),  # tie between 2 and 3 quanta: to 2 (even)
    (np.float32(2.0**-45), 0.0, 0x0000),
    (np.float32(2.0**-30), 2.0**-30, 0x0200),  # min normal
    (np.float32((1 - 2**-9) * 2.0**-30), (1 - 2**-9) * 2.0**-30, 0x01FF),  # largest subnormal
    (np.float32((1 - 2**-10) * 2.0**-30), 2.0**-30, 0x0200),  # tie: odd subnormal -> min normal
    (np.float32(1.0), 1.0, 0x3E00),
    (np.float32(1 + 2**-10), 1.0, 0x3E00),  # tie: to even (1.0)
    (np.float32(1 + 3 * 2**-10), 1 + 2**-8, 0x3E02),  # tie: to even (up)
    (np.float32(1 + 2**-10 + 2**-23), 1 + 2**-9, 0x3E01),  # just above the tie: up
    (np.float32(-2.0), -2.0, 0xC000),
    (np.float32(0.0), 0.0, 0x0000),
    (np.float32(-0.0), -0.0, 0x8000),
]


@pytest.mark.parametrize(("x", "want", "code"), CBFLOAT16_EDGES)
def test_cbfloat16_hand_checked_edges(x, want, code) -> None:
    x = np.float32(x)
    assert_same_float32(CBFLOAT16.round(x), np.float32(want))
    assert int(CBFLOAT16.encode(x)) == code
    assert_same_float32(CBFLOAT16.decode(np.uint16(code)), np.float32(want))


@pytest.mark.parametrize("x", [np.nan, -np.nan, np.uint32(0x7F800001).view(np.float32)])
def test_cbfloat16_nan_stays_nan_with_its_sign(x) -> None:
    x = np.float32(x)
    out = np.asarray(CBFLOAT16.round(x))
    assert np.isnan(out) and np.signbit(out) == np.signbit(x)
    code = int(CBFLOAT16.encode(x))
    assert code & 0x7FFF == 0x7F00  # exponent all ones, quiet bit set
    assert bool(code & 0x8000) == bool(np.signbit(x))


def test_cbfloat16_matches_independent_reference() -> None:
    rng = np.random.default_rng(1234)
    x = np.concatenate(
        [
            random_float32(rng, N_RANDOM),
            focused_float32(rng, CBFLOAT16, 40_000),
            grid_midpoints(CBFLOAT16),
        ]
    )
    assert_same_float32(CBFLOAT16.round(x), reference_round(x, CBFLOAT16))


def test_reduce_precision_agrees_on_normals_but_flushes_subnormals() -> None:
    """SPEC section 7: lax.reduce_precision is right for normals, not enough for subnormals."""
    rng = np.random.default_rng(5)
    x = focused_float32(rng, CBFLOAT16, 20_000)
    x = x[np.abs(x) >= CBFLOAT16.min_normal]
    assert_same_float32(CBFLOAT16.round(x), jax.lax.reduce_precision(x, 6, 9))
    tiny = np.float32(2.0**-35)
    assert float(jax.lax.reduce_precision(tiny, 6, 9)) == 0.0
    assert float(CBFLOAT16.round(tiny)) == 2.0**-35


# ---------------------------------------------------------------------------------------------
# The parameters: saturation, flushing subnormals, arbitrary valid formats.


@pytest.mark.parametrize(("fmt", "dtype"), ORACLES[2:], ids=ORACLE_IDS[2:])
def test_saturating_variant_matches_clip_then_convert(fmt: FloatFormat, dtype: np.dtype) -> None:
    saturating = FloatFormat(
        f"{fmt.name}_sat", fmt.exponent_bits, fmt.mantissa_bits, has_inf=fmt.has_inf, saturate=True
    )
    rng = np.random.default_rng(11)
    x = np.concatenate([random_float32(rng, 20_000), grid_midpoints(fmt)])
    x = np.concatenate([x, np.array([np.inf, -np.inf], np.float32)])
    clipped = np.clip(x, -fmt.max, fmt.max).astype(np.float32)
    if fmt.has_inf:
        clipped = np.where(np.isinf(x), x, clipped)
    assert_same_float32(saturating.round(x), oracle_round(clipped, dtype))
    assert_same_float32(saturating.round(x), reference_round(x, saturating))
    assert float(saturating.round(np.float32(1e30))) == fmt.max


@pytest.mark.parametrize(("exponent_bits", "mantissa_bits"), [(5, 10), (6, 9), (8, 7)])
def test_flushing_variant_matches_reduce_precision(exponent_bits: int, mantissa_bits: int) -> None:
    flushing = FloatFormat("ftz", exponent_bits, mantissa_bits, subnormals=False)
    rng = np.random.default_rng(3)
    x = np.concatenate([random_float32(rng, 50_000), focused_float32(rng, flushing, 20_000)])
    x = x[~(np.abs(x) < 2.0**-126) | (x == 0)]  # XLA's CPU backend may flush float32 subnormals
    want = jax.lax.reduce_precision(x, exponent_bits, mantissa_bits)
    assert_same_float32(flushing.round(x), want)
    assert_same_float32(flushing.round(x), reference_round(x, flushing))
    assert flushing.smallest_subnormal == flushing.min_normal
    # Subnormal codes read as zero; the sign is kept.
    assert_same_float32(
        flushing.decode(np.array([1, 1 << (flushing.total_bits - 1) | 1])), [0, -0.0]
    )


def test_float32_itself_is_a_valid_format_and_round_is_the_identity() -> None:
    float32 = FloatFormat("float32", exponent_bits=8, mantissa_bits=23)
    assert float32.bits_dtype == jnp.uint32
    assert float32.max == float(np.finfo(np.float32).max)
    rng = np.random.default_rng(0)
    x = random_float32(rng, 50_000)
    x = x[~np.isnan(x)]
    assert_same_float32(float32.round(x), x)
    np.testing.assert_array_equal(np.asarray(float32.encode(x)), _bits(x))


@st.composite
def valid_formats(draw) -> FloatFormat:
    exponent_bits = draw(st.integers(2, 8))
    mantissa_bits = draw(st.integers(1, 23))
    has_inf = draw(st.booleans())
    top_exponent = 2**exponent_bits - (2 if has_inf else 1)
    low, high = top_exponent - 127, 150 - mantissa_bits
    assume(low <= high)
    return FloatFormat(
        "random",
        exponent_bits,
        mantissa_bits,
        bias=draw(st.integers(low, high)),
        subnormals=draw(st.booleans()),
        has_inf=has_inf,
        saturate=draw(st.booleans()),
    )


@settings(max_examples=20, deadline=None)
@given(fmt=valid_formats(), seed=st.integers(0, 2**32 - 1))
def test_any_valid_format_matches_independent_reference(fmt: FloatFormat, seed: int) -> None:
    rng = np.random.default_rng(seed)
    x = np.concatenate([random_float32(rng, 2_000), focused_float32(rng, fmt, 2_000)])
    got = np.asarray(fmt.round(x))
    assert_same_float32(got, reference_round(x, fmt))
    finite = np.isfinite(got)
    assert_same_float32(fmt.decode(fmt.encode(got[finite])), got[finite])


# ---------------------------------------------------------------------------------------------
# jit, gradients, shapes.


@pytest.mark.parametrize(
    "fmt",
    [CBFLOAT16, FLOAT8_E4M3FN, FloatFormat("e5m2_saturating", 5, 2, saturate=True)],
    ids=lambda fmt: fmt.name,
)
def test_jit_and_eager_are_identical(fmt: FloatFormat) -> None:
    rng = np.random.default_rng(99)
    x = np.concatenate([random_float32(rng, 5_000), grid_midpoints(fmt)[:5_000]])
    codes = all_codes(fmt)
    with jax.disable_jit():
        eager = fmt.round(x), fmt.encode(x), fmt.decode(codes)
    jitted = jax.jit(fmt.round)(x), jax.jit(fmt.encode)(x), jax.jit(fmt.decode)(codes)
    assert_same_float32(jitted[0], eager[0])
    np.testing.assert_array_equal(np.asarray(jitted[1]), np.asarray(eager[1]))
    assert_same_float32(jitted[2], eager[2])


def test_round_has_a_straight_through_gradient() -> None:
    x = jnp.array([1.0 + 2**-11, -3.3, 1e10, 2.0**-45, 0.0], jnp.float32)
    weights = jnp.arange(1.0, 6.0)

    def loss(x: jax.Array) -> jax.Array:
        return jnp.sum(CBFLOAT16.round(x) * weights)

    np.testing.assert_array_equal(jax.grad(loss)(x), weights)  # also where it overflows (1e10)
    np.testing.assert_array_equal(jax.jit(jax.grad(loss))(x), weights)
    primal, tangent = jax.jvp(CBFLOAT16.round, (x,), (jnp.full_like(x, 0.5),))
    assert_same_float32(primal, CBFLOAT16.round(x))
    np.testing.assert_array_equal(tangent, jnp.full_like(x, 0.5))


def test_shapes_dtypes_and_vmap() -> None:
    x = jnp.linspace(-3.0, 3.0, 24).reshape(2, 3, 4)
    assert CBFLOAT16.round(x).shape == (2, 3, 4)
    assert CBFLOAT16.encode(x).dtype == jnp.uint16
    assert FLOAT8_E5M2.encode(x).dtype == jnp.uint8
    assert CBFLOAT16.decode(CBFLOAT16.encode(x)).dtype == jnp.float32
    assert_same_float32(jax.vmap(CBFLOAT16.round)(x), CBFLOAT16.round(x))
    # Other input dtypes are converted to float32 first.
    assert CBFLOAT16.round(jnp.ones(3, jnp.bfloat16)).dtype == jnp.float32
    assert float(CBFLOAT16.round(3)) == 3.0
    # decode reads only the low total_bits bits of wider integers.
    assert float(FLOAT8_E5M2.decode(jnp.array(0x13C, jnp.int32))) == 1.0


def test_decode_rejects_floats() -> None:
    with pytest.raises(TypeError, match="integer"):
        CBFLOAT16.decode(jnp.ones(3))


# ---------------------------------------------------------------------------------------------
# Validation and lookup.


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"exponent_bits": 9}, r"exponent_bits must be in \[2, 8\].*got 9"),
        ({"exponent_bits": 1}, "exponent_bits"),
        ({"exponent_bits": 5.0}, "exponent_bits must be an int"),
        ({"exponent_bits": True}, "exponent_bits must be an int"),
        ({"mantissa_bits": 0}, "mantissa_bits"),
        ({"mantissa_bits": 24}, r"mantissa_bits must be in \[1, 23\]"),
        ({"bias": 0}, r"bias=0 .*above float32's 2\*\*127"),
        ({"bias": 200}, r"bias=200 .*below float32's smallest subnormal"),
        ({"bias": 1.5}, "bias must be an int"),
        ({"subnormals": "yes"}, "subnormals must be a bool"),
        ({"saturate": 1}, "saturate must be a bool"),
        ({"name": ""}, "name must be a non-empty string"),
    ],
)
def test_invalid_parameters_raise_value_error_naming_them(kwargs, match) -> None:
    params = {"name": "bad", "exponent_bits": 8, "mantissa_bits": 7} | kwargs
    with pytest.raises(ValueError, match=match):
        FloatFormat(**params)


def test_bias_limits_are_exact() -> None:
    assert FloatFormat("x", 8, 7, bias=127).emax == 127
    with pytest.raises(ValueError, match="use bias >= 127"):
        FloatFormat("x", 8, 7, bias=126)
    assert FloatFormat("x", 8, 7, bias=143).smallest_subnormal == 2.0**-149
    with pytest.raises(ValueError, match="use bias <= 143"):
        FloatFormat("x", 8, 7, bias=144)


def test_formats_are_frozen_and_hashable() -> None:
    assert FloatFormat("cbfloat16", 6, 9) == CBFLOAT16
    assert hash(FloatFormat("cbfloat16", 6, 9, bias=31)) == hash(CBFLOAT16)
    with pytest.raises(AttributeError):
        CBFLOAT16.bias = 15  # type: ignore[misc]


class _FakeTorchDtype:
    def __str__(self) -> str:
        return "torch.bfloat16"


@pytest.mark.parametrize(
    ("name", "expected"),
    [
        ("float16", FLOAT16),
        ("bfloat16", BFLOAT16),
        ("cbfloat16", CBFLOAT16),
        ("float16_e6m9", CBFLOAT16),
        ("cb16", CBFLOAT16),
        ("float8_e4m3fn", FLOAT8_E4M3FN),
        (jnp.float16, FLOAT16),
        (jnp.bfloat16, BFLOAT16),
        (np.dtype(np.float16), FLOAT16),
        (ml_dtypes.float8_e5m2, FLOAT8_E5M2),
        (_FakeTorchDtype(), BFLOAT16),
        (CBFLOAT16, CBFLOAT16),
    ],
)
def test_get_format(name, expected: FloatFormat) -> None:
    assert get_format(name) is expected


@pytest.mark.parametrize("name", ["float32", "fp16", jnp.float32, 3, None])
def test_get_format_unknown_lists_known_names(name) -> None:
    with pytest.raises(ValueError, match="known formats: 'float16', 'bfloat16', 'cbfloat16'"):
        get_format(name)


def test_known_formats() -> None:
    assert known_formats()[:3] == ("float16", "bfloat16", "cbfloat16")
    assert all(get_format(name).name == name for name in known_formats())
    assert formats.FLOAT8_E4M3FN.max == 448.0


# ---------------------------------------------------------------------------------------------
# round and cast work on the float32 bits; encode/decode keep the integer path. The two are
# held to each other bit for bit (NaN bits included), and to numpy/ml_dtypes or reference_round.

NAMED = [get_format(name) for name in known_formats()]


def integer_path_round(x: np.ndarray, fmt: FloatFormat) -> np.ndarray:
    """The rounding as it was before the bit path: decode(encode(x)), on integers only."""
    return np.asarray(fmt.decode(fmt.encode(x)))


def rounding_position_sweep(fmt: FloatFormat, max_prefixes: int = 512) -> np.ndarray:
    """For every sign and float32 exponent field: the kept mantissa bits (all of them, or a
    sample with both ends) times the dropped bits just around the tie (0, 1, half - 1, half,
    half + 1, all ones) at the bit where the format rounds in that binade, subnormals included."""
    rng = np.random.default_rng(fmt.total_bits)
    parts = []
    for exponent_field in range(256):
        exponent = max(exponent_field, 1) - 127
        dropped = 23 - fmt.mantissa_bits + max(0, fmt.emin - exponent)
        dropped = min(dropped, 23)
        n_prefixes = 1 << (23 - dropped)
        if n_prefixes <= max_prefixes:
            prefixes = np.arange(n_prefixes, dtype=np.uint64)
        else:
            sample = rng.integers(0, n_prefixes, max_prefixes - 4, dtype=np.uint64)
            prefixes = np.append(sample, [0, 1, n_prefixes - 2, n_prefixes - 1]).astype(np.uint64)
        half = (1 << dropped) >> 1
        lows = np.unique([0, 1, half - 1, half, half + 1, (1 << dropped) - 1])
        lows = lows[(lows >= 0) & (lows < 1 << dropped)].astype(np.uint64)
        mantissas = (prefixes[:, None] << np.uint64(dropped)) | lows[None, :]
        parts.append((np.uint64(exponent_field) << np.uint64(23)) | mantissas.ravel())
    magnitudes = np.concatenate(parts).astype(np.uint32)
    return np.concatenate([magnitudes, magnitudes | np.uint32(0x80000000)]).view(np.float32)


def range_edges(fmt: FloatFormat) -> np.ndarray:
    """max, smallest subnormal, min normal, half the smallest subnormal and the midpoint above
    max, each with its float32 neighbours, both signs; plus the float32 extremes."""
    above_max = fmt.max + 2.0 ** (fmt.emax - fmt.mantissa_bits) / 2
    with np.errstate(over="ignore"):  # above_max is inf for float32 itself
        points = np.array(
            [
                fmt.max,
                above_max,
                fmt.smallest_subnormal,
                fmt.smallest_subnormal / 2,
                fmt.min_normal,
            ],
            np.float32,
        )
        down, up = np.nextafter(points, np.float32(0)), np.nextafter(points, np.float32(np.inf))
    extremes = np.array([np.finfo(np.float32).max, np.finfo(np.float32).smallest_subnormal])
    positive = np.concatenate([points, down, up, extremes.astype(np.float32)])
    return np.concatenate([positive, -positive])


def float32_bit_probe(fmt: FloatFormat) -> np.ndarray:
    rng = np.random.default_rng(31)
    codes = all_codes(fmt) if fmt.total_bits <= 16 else np.zeros(0, np.uint32)
    nan_patterns = np.array([0x7F800001, 0x7FBFFFFF, 0x7FC00001, 0x7FFFFFFF], np.uint32)
    return np.concatenate(
        [
            np.asarray(fmt.decode(codes)),
            grid_midpoints(fmt) if fmt.total_bits <= 16 else np.zeros(0, np.float32),
            range_edges(fmt),
            rounding_position_sweep(fmt),
            random_float32(rng, 20_000),
            nan_patterns.view(np.float32),
            (nan_patterns | np.uint32(0x80000000)).view(np.float32),
            np.array([0.0, -0.0, np.inf, -np.inf], np.float32),
        ]
    )


def assert_same_bits(got, want) -> None:
    got, want = _bits(got), _bits(want)
    bad = np.flatnonzero(got != want)
    assert bad.size == 0, f"{bad.size} differ, e.g. {got[bad[0]]:#010x} want {want[bad[0]]:#010x}"


@pytest.mark.parametrize("fmt", NAMED, ids=lambda fmt: fmt.name)
def test_round_and_cast_give_the_integer_paths_bits(fmt: FloatFormat) -> None:
    x = float32_bit_probe(fmt)
    want = integer_path_round(x, fmt)
    assert_same_bits(fmt.round(x), want)
    assert_same_bits(jax.jit(fmt.round)(x), want)
    assert_same_bits(jax.jit(fmt.cast)(x), want)
    _, cast_vjp = jax.vjp(fmt.cast, jnp.zeros(x.shape, jnp.float32))
    assert_same_bits(cast_vjp(jnp.asarray(x))[0], want)  # the gradient is rounded alike


@pytest.mark.parametrize(("fmt", "dtype"), ORACLES, ids=ORACLE_IDS)
def test_round_matches_oracle_on_the_bit_probe(fmt: FloatFormat, dtype: np.dtype) -> None:
    x = float32_bit_probe(fmt)
    assert_same_float32(fmt.round(x), oracle_round(x, dtype))


def test_cbfloat16_round_matches_reference_on_the_bit_probe() -> None:
    x = float32_bit_probe(CBFLOAT16)
    assert_same_float32(CBFLOAT16.round(x), reference_round(x, CBFLOAT16))


@pytest.mark.parametrize("fmt", NAMED, ids=lambda fmt: fmt.name)
def test_named_formats_round_without_the_integer_encoding(fmt: FloatFormat) -> None:
    """The bit path has no count-leading-zeros (the encoding's exponent search) and is short."""
    jaxpr = jax.make_jaxpr(fmt.round)(jnp.ones(8, jnp.float32))
    text = str(jaxpr)
    assert "clz" not in text
    assert text.count(" = ") < 30, text


@pytest.mark.parametrize(
    "fmt",
    [
        FloatFormat("e8m7_bias140", 8, 7, bias=140),  # subnormal steps below float32's normals
        FloatFormat("e8m3_bias130", 8, 3, bias=130, saturate=True),
        FloatFormat("e8m7_flush_bias140", 8, 7, bias=140, subnormals=False),
        FloatFormat("e8m7_flushing", 8, 7, subnormals=False),  # rounds below 2**-126 alike
    ],
    ids=lambda fmt: fmt.name,
)
def test_formats_reaching_float32_subnormals_keep_the_integer_path(fmt: FloatFormat) -> None:
    assert "clz" in str(jax.make_jaxpr(fmt.round)(jnp.ones(8, jnp.float32)))
    x = float32_bit_probe(fmt)
    x = x[~(np.abs(x) < 2.0**-126) | (x == 0)]  # reference_round's float64 sees no flushing
    assert_same_float32(fmt.round(x), reference_round(x, fmt))


@pytest.mark.parametrize(
    "fmt",
    [
        FloatFormat("e6m9_saturating", 6, 9, bias=31, saturate=True),
        FloatFormat("e6m9_flushing", 6, 9, bias=31, subnormals=False),
        FloatFormat("e6m9_fn", 6, 9, bias=31, has_inf=False),
        FloatFormat("e6m9_fn_saturating", 6, 9, bias=31, has_inf=False, saturate=True),
        FloatFormat("e7m8_flushing", 7, 8, subnormals=False),
        FloatFormat("e2m1_bias_minus_100", 2, 1, bias=-100),  # every step above 1
        FloatFormat("e5m10_bias_115", 5, 10, bias=115),  # smallest step 2**-124
        FloatFormat("float32", 8, 23),
    ],
    ids=lambda fmt: fmt.name,
)
def test_variants_on_the_bit_path_match_both_oracles(fmt: FloatFormat) -> None:
    x = float32_bit_probe(fmt)
    assert "clz" not in str(jax.make_jaxpr(fmt.round)(jnp.ones(8, jnp.float32)))
    assert_same_bits(fmt.round(x), integer_path_round(x, fmt))
    x = x[~(np.abs(x) < 2.0**-126) | (x == 0)]  # reference_round's float64 sees no flushing
    assert_same_float32(fmt.round(x), reference_round(x, fmt))
