"""Bit-exact small floating-point formats, emulated in a float32 container.

One generic type, :class:`FloatFormat`, describes a binary floating-point format by its exponent
and mantissa widths plus three choices (exponent bias, subnormal handling, overflow behaviour)
and one layout switch (IEEE-style infinities or the ml_dtypes ``fn`` layout). The same code
rounds, encodes and decodes float16, bfloat16, cbfloat16 and the float8 formats.

Every value of a valid format is exactly representable in float32, so a float32 array whose
elements all lie on the format's grid *is* an array of that format: this is how cbfloat16, which
no framework computes in, is emulated.

The rounding works on the float32 bit pattern, so it is exact on every backend and keeps
subnormals (``jax.lax.reduce_precision`` flushes the target's subnormals to zero, and XLA's CPU
backend may flush float32 subnormals in floating-point arithmetic).

:meth:`FloatFormat.round` and :meth:`FloatFormat.cast` work on the float32 bits directly, in
a handful of operations an element, for every named format::

    a = bits of |x| (uint32)            (the sign bit is put back at the end)
    d = 23 - m                          (the float32 mantissa bits the format drops)
    r = (a + 2**(d-1) - 1 + bit d of a) with its low d bits cleared
                                        (half an ulp, ties to even; a carry moves into the
                                        next binade, and past max towards inf, by itself)
    |x| < min_normal  ->  r = rint(|x| / step) * step
                                        (the format's subnormals, step = smallest_subnormal)
    not subnormals    ->  r < min_normal becomes 0   (where min_normal >= 2**-125)
    r > max           ->  inf, NaN (no infinities) or max (saturating); NaN -> quiet NaN

The subnormal line is float arithmetic, but exact and immune to flushing: scaling by a power of
two is exact, ``rint`` is exact, and it is used only where the step is at least ``2**-125``, so
every result is zero or a normal float32 and every float32 subnormal input rounds to zero
whether or not the backend flushes it first. Formats whose exponent range is float32's at the
bottom (bfloat16) need no subnormal line: the bit rounding is right there too. Other valid
formats (a custom bias whose range reaches into float32's subnormals) round as
``decode(encode(x))``, the integer path below: the same bits, about 40 operations an element.

Algorithm of :meth:`FloatFormat.encode`, per element, on integers::

    |x| = sig * 2**s                    (float32 significand with hidden bit, s its scale)
    e_x = floor(log2 |x|)               (from the leading bit of sig)
    q   = max(e_x, emin) - m            (the format's quantum at |x|; emin only with subnormals)
    r   = round_half_even(sig / 2**(q - s))
    code = r + (q - (emin - m)) * 2**m  (magnitude code; a carry into the next binade just works)
    code > max_code  ->  inf code, NaN code (no infinities) or max code (saturating)

The two paths give the same bits: tests hold ``round`` to ``decode(encode(x))`` on every code,
every tie, the range's edges and, in every float32 binade, the inputs around the rounding bit.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

_F32_ABS_MASK = 0x7FFFFFFF
_F32_INF_BITS = 0x7F800000
_F32_QUIET_NAN_BITS = 0x7FC00000
_F32_MANTISSA_MASK = 0x007FFFFF
_F32_HIDDEN_BIT = 0x00800000
_F32_MIN_EXPONENT = -126
_F32_MAX_EXPONENT = 127
_F32_MIN_SUBNORMAL_EXPONENT = -149


@dataclasses.dataclass(frozen=True)
class FloatFormat:
    """A binary floating-point format of at most 32 bits, emulated in float32.

    The layout is ``sign | exponent (exponent_bits) | mantissa (mantissa_bits)``, with an
    implicit leading 1 for normal numbers and exponent field 0 for zero and subnormals. Values
    are ``(-1)**sign * 1.f * 2**(E - bias)`` for a normal exponent field ``E`` and
    ``(-1)**sign * 0.f * 2**(1 - bias)`` for subnormals.

    The defaults are IEEE-754-like: ``bias = 2**(exponent_bits - 1) - 1``, the top exponent
    field reserved for +-inf (mantissa 0) and NaN, gradual underflow, overflow to +-inf, and
    round-to-nearest-even everywhere.

    Attributes:
        name: the format's name, used in messages and by :func:`get_format`.
        exponent_bits: width of the exponent field, 2 to 8.
        mantissa_bits: explicit mantissa (fraction) bits, 1 to 23.
        bias: exponent bias; ``None`` means ``2**(exponent_bits - 1) - 1``.
        subnormals: ``True`` for gradual underflow. ``False`` flushes: a result whose magnitude
            rounds below ``min_normal`` becomes a zero of the same sign, and :meth:`decode`
            reads subnormal codes as zero (the rounding matches ``jax.lax.reduce_precision``).
        has_inf: ``True`` for the IEEE layout (top exponent field: +-inf and NaNs). ``False``
            for the ml_dtypes ``fn`` layout (as ``float8_e4m3fn``): no infinities, the top
            exponent field holds normal numbers except the all-ones mantissa, which is NaN.
        saturate: ``False`` sends a finite value that rounds above ``max`` to +-inf (to NaN
            when the format has no infinities, as ml_dtypes does). ``True`` clamps it to
            +-``max``; +-inf inputs then stay +-inf if the format has infinities and become
            +-``max`` otherwise.

    Raises:
        ValueError: a parameter is out of range, or the format has a value that float32
            cannot hold exactly (largest exponent above 127, or a quantum below ``2**-149``).

    Example:
        >>> fmt = FloatFormat("cbfloat16", exponent_bits=6, mantissa_bits=9)
        >>> fmt.bias, fmt.max == (2 - 2**-9) * 2**31, fmt.smallest_subnormal == 2.0**-39
        (31, True, True)
        >>> float(fmt.round(1.0 + 2**-10 + 2**-20))
        1.001953125
    """

    name: str
    exponent_bits: int
    mantissa_bits: int
    bias: int = None  # type: ignore[assignment]  # resolved in __post_init__
    subnormals: bool = True
    has_inf: bool = True
    saturate: bool = False

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name:
            raise ValueError(f"name must be a non-empty string; got {self.name!r}")
        _check_int("exponent_bits", self.exponent_bits, 2, 8, "float32 has 8 exponent bits")
        _check_int("mantissa_bits", self.mantissa_bits, 1, 23, "float32 has 23 mantissa bits")
        for flag in ("subnormals", "has_inf", "saturate"):
            if not isinstance(getattr(self, flag), bool):
                raise ValueError(f"{flag} must be a bool; got {getattr(self, flag)!r}")
        if self.bias is None:
            object.__setattr__(self, "bias", 2 ** (self.exponent_bits - 1) - 1)
        if isinstance(self.bias, bool) or not isinstance(self.bias, (int, np.integer)):
            raise ValueError(f"bias must be an int or None; got {self.bias!r}")
        object.__setattr__(self, "bias", int(self.bias))
        if self.emax > _F32_MAX_EXPONENT:
            raise ValueError(
                f"bias={self.bias} puts the largest exponent of {self.name!r} at "
                f"2**{self.emax}, above float32's 2**{_F32_MAX_EXPONENT}: float32 cannot hold "
                f"it; use bias >= {self.bias + self.emax - _F32_MAX_EXPONENT}"
            )
        if self._quantum_exponent < _F32_MIN_SUBNORMAL_EXPONENT:
            raise ValueError(
                f"bias={self.bias} puts the smallest step of {self.name!r} at "
                f"2**{self._quantum_exponent}, below float32's smallest subnormal "
                f"2**{_F32_MIN_SUBNORMAL_EXPONENT}: float32 cannot hold it; use bias <= "
                f"{self.bias + self._quantum_exponent - _F32_MIN_SUBNORMAL_EXPONENT}"
            )

    # ----------------------------------------------------------------------------------------
    # Derived constants (Python floats, exact).

    @property
    def total_bits(self) -> int:
        """Sign, exponent and mantissa bits together (16 for cbfloat16)."""
        return 1 + self.exponent_bits + self.mantissa_bits

    @property
    def bits_dtype(self) -> jnp.dtype:
        """The unsigned integer dtype :meth:`encode` returns: uint8, uint16 or uint32."""
        for dtype in (jnp.uint8, jnp.uint16, jnp.uint32):
            if self.total_bits <= jnp.iinfo(dtype).bits:
                return jnp.dtype(dtype)
        raise AssertionError("unreachable: validation bounds total_bits by 32")

    @property
    def emin(self) -> int:
        """Exponent of the smallest normal number, ``1 - bias``."""
        return 1 - self.bias

    @property
    def emax(self) -> int:
        """Exponent of the largest finite number."""
        top_field = 2**self.exponent_bits - 1
        return (top_field - 1 if self.has_inf else top_field) - self.bias

    @property
    def max(self) -> float:
        """The largest finite value, e.g. ``(2 - 2**-9) * 2**31`` for cbfloat16."""
        fraction_steps = 2**self.mantissa_bits - (1 if self.has_inf else 2)
        return math.ldexp(1.0 + math.ldexp(fraction_steps, -self.mantissa_bits), self.emax)

    @property
    def min_normal(self) -> float:
        """The smallest positive normal value, ``2**emin``."""
        return math.ldexp(1.0, self.emin)

    @property
    def smallest_subnormal(self) -> float:
        """The smallest positive value: ``2**(emin - mantissa_bits)``, or ``min_normal``
        when ``subnormals`` is ``False``."""
        if not self.subnormals:
            return self.min_normal
        return math.ldexp(1.0, self._quantum_exponent)

    @property
    def eps(self) -> float:
        """The distance from 1.0 to the next larger value, ``2**-mantissa_bits``."""
        return math.ldexp(1.0, -self.mantissa_bits)

    @property
    def _quantum_exponent(self) -> int:
        """Exponent of the spacing of the subnormals (and of the lowest normal binade)."""
        return self.emin - self.mantissa_bits

    @property
    def _magnitude_bits(self) -> int:
        return self.exponent_bits + self.mantissa_bits

    @property
    def _top_field(self) -> int:
        return 2**self.exponent_bits - 1

    @property
    def _nan_code(self) -> int:
        """Magnitude code of the NaN that encode produces (quiet NaN; all ones for ``fn``)."""
        if self.has_inf:
            return (self._top_field << self.mantissa_bits) | (1 << (self.mantissa_bits - 1))
        return (1 << self._magnitude_bits) - 1

    @property
    def _inf_code(self) -> int:
        return self._top_field << self.mantissa_bits

    @property
    def _max_code(self) -> int:
        return self._inf_code - 1 if self.has_inf else self._nan_code - 1

    # ----------------------------------------------------------------------------------------
    # The public contract: round, encode, decode.

    def round(self, x: jax.typing.ArrayLike) -> jax.Array:
        """Rounds float32 values to the nearest value of this format, in a float32 container.

        Round-to-nearest-even; overflow per ``saturate``; NaN stays NaN (a quiet NaN of the
        same sign), the sign of zero is kept, subnormals are kept (unless ``subnormals`` is
        ``False``). Inputs of other dtypes are converted to float32 first (float64 inputs are
        therefore rounded twice).

        Gradient: straight-through. The derivative is taken to be 1 everywhere (the tangent
        passes unchanged), also where the value overflows to inf or underflows to zero, as in
        quantisation-aware training.

        Cost: a few element-wise integer operations on the float32 bits (module docstring),
        which XLA fuses with the operations around them; jitted on its own it runs at about
        the speed of a copy of ``x``.

        Args:
            x: values to round (converted to float32).

        Returns:
            A float32 array of ``x``'s shape whose elements lie on this format's grid.

        Example:
            >>> import jax.numpy as jnp
            >>> CBFLOAT16.round(jnp.array([1.0 + 2**-10, 2.0**-40, -0.0, 3e38])).tolist()
            [1.0, 0.0, -0.0, inf]
        """
        return _round_straight_through(self, _as_float32(x))

    def cast(self, x: jax.typing.ArrayLike) -> jax.Array:
        """Casts to this format like ``astype`` casts to a real dtype: in both directions.

        The value is :meth:`round`-ed, and in the backward pass the incoming gradient is
        rounded to the format too, as JAX does for a real dtype (the transpose of a cast is a
        cast). This is what an emulated *compute* dtype needs: the backward pass then computes
        on the format's grid, so gradients overflow and underflow as they would in hardware,
        which is what loss scaling is about. :class:`hardware.Policy` casts with it.

        Args:
            x: values to cast (converted to float32).

        Returns:
            A float32 array on this format's grid.

        Example:
            >>> import jax, jax.numpy as jnp
            >>> grad = jax.grad(lambda x: jnp.sum(CBFLOAT16.cast(x) * 1e10))(jnp.ones(2))
            >>> grad.tolist()  # 1e10 overflows cbfloat16 on the way back
            [inf, inf]
        """
        return _cast_both_ways(self, _as_float32(x))

    def encode(self, x: jax.typing.ArrayLike) -> jax.Array:
        """Rounds float32 values (as :meth:`round`) and returns their bit patterns.

        The result has :attr:`bits_dtype`: uint16 for the 16-bit formats, uint8 for float8
        formats (as ``ml_dtypes`` arrays viewed as integers), uint32 for wider ones. NaN
        encodes as the quiet NaN with the input's sign (all ones for the ``fn`` layout).

        Args:
            x: values to encode (converted to float32).

        Returns:
            The codes, same shape as ``x``.

        Example:
            >>> import jax.numpy as jnp
            >>> [hex(int(c)) for c in CBFLOAT16.encode(jnp.array([1.0, -2.0, jnp.inf]))]
            ['0x3e00', '0xc000', '0x7e00']
        """
        return _encode(self, _as_float32(x)).astype(self.bits_dtype)

    def decode(self, bits: jax.typing.ArrayLike) -> jax.Array:
        """Returns the float32 values of bit patterns of this format.

        Only the low :attr:`total_bits` bits of each integer are read. Every code decodes
        exactly; NaN codes decode to a quiet float32 NaN of the same sign.

        Args:
            bits: an integer array of codes (typically from :meth:`encode`).

        Returns:
            A float32 array of the same shape.

        Raises:
            TypeError: ``bits`` is not an integer array.

        Example:
            >>> import jax.numpy as jnp
            >>> CBFLOAT16.decode(jnp.array([0x3E00, 0x0001, 0x7DFF], jnp.uint16)).tolist()
            [1.0, 1.8189894035458565e-12, 4290772992.0]
        """
        bits = jnp.asarray(bits)
        if not jnp.issubdtype(bits.dtype, jnp.integer):
            raise TypeError(f"bits must be an integer array; got dtype {bits.dtype}")
        return _decode(self, bits.astype(jnp.uint32))


# --------------------------------------------------------------------------------------------
# Implementation: integer arithmetic on float32 bit patterns. ``fmt`` is static under jit.


def _as_float32(x: jax.typing.ArrayLike) -> jax.Array:
    x = jnp.asarray(x)
    return x if x.dtype == jnp.float32 else x.astype(jnp.float32)


@functools.partial(jax.custom_jvp, nondiff_argnums=(0,))
def _round_straight_through(fmt: FloatFormat, x: jax.Array) -> jax.Array:
    return _round(fmt, x)


@_round_straight_through.defjvp
def _round_straight_through_jvp(
    fmt: FloatFormat, primals: tuple[jax.Array], tangents: tuple[jax.Array]
) -> tuple[jax.Array, jax.Array]:
    (x,), (x_dot,) = primals, tangents
    return _round_straight_through(fmt, x), x_dot


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _cast_both_ways(fmt: FloatFormat, x: jax.Array) -> jax.Array:
    return _round(fmt, x)


def _cast_both_ways_fwd(fmt: FloatFormat, x: jax.Array) -> tuple[jax.Array, None]:
    return _cast_both_ways(fmt, x), None


def _cast_both_ways_bwd(fmt: FloatFormat, _: None, gradient: jax.Array) -> tuple[jax.Array]:
    return (_round(fmt, _as_float32(gradient)),)


_cast_both_ways.defvjp(_cast_both_ways_fwd, _cast_both_ways_bwd)


@functools.partial(jax.jit, static_argnums=0)
def _round(fmt: FloatFormat, x: jax.Array) -> jax.Array:
    """float32 -> float32 on ``fmt``'s grid: on the float32 bits where the format allows it."""
    if _rounds_on_float32_bits(fmt):
        return _round_float32_bits(fmt, x)
    return _decode(fmt, _encode(fmt, x))


def _rounds_on_float32_bits(fmt: FloatFormat) -> bool:
    """Whether :func:`_round_float32_bits` is exact for ``fmt`` (every named format).

    With subnormals: either the format's normal range ends where float32's does (the bit
    rounding then covers the subnormals too), or its step is at least ``2**-125`` (the scaled
    ``rint`` then sees no float32 subnormal that does not round to zero and makes none). Without
    them, ``min_normal`` must be at least ``2**-125``: the binade below it is then normal in
    float32, where the bit rounding keeps ``mantissa_bits`` bits as the flushing rule does.
    """
    if not fmt.subnormals:
        return fmt.emin > _F32_MIN_EXPONENT
    return fmt.emin == _F32_MIN_EXPONENT or fmt._quantum_exponent >= _F32_MIN_EXPONENT + 1


def _round_float32_bits(fmt: FloatFormat, x: jax.Array) -> jax.Array:
    """The rounding on float32 bits (module docstring); bit-identical to decode(encode(x))."""
    bits = lax.bitcast_convert_type(x, jnp.uint32)
    magnitude = bits & np.uint32(_F32_ABS_MASK)
    sign = bits ^ magnitude
    dropped = 23 - fmt.mantissa_bits
    rounded = magnitude
    if dropped > 0:
        half_ulp_minus_one = np.uint32((1 << (dropped - 1)) - 1)
        is_odd = (magnitude >> np.uint32(dropped)) & np.uint32(1)
        kept = np.uint32(~((1 << dropped) - 1) & 0xFFFFFFFF)
        rounded = (magnitude + half_ulp_minus_one + is_odd) & kept
    min_normal_bits = np.uint32((fmt.emin - _F32_MIN_EXPONENT + 1) << 23)
    if not fmt.subnormals:
        rounded = jnp.where(rounded < min_normal_bits, np.uint32(0), rounded)
    elif fmt.emin > _F32_MIN_EXPONENT:
        steps = lax.bitcast_convert_type(magnitude, jnp.float32) * np.float32(
            math.ldexp(1.0, -fmt._quantum_exponent)
        )
        subnormal = lax.round(steps, lax.RoundingMethod.TO_NEAREST_EVEN) * np.float32(
            fmt.smallest_subnormal
        )
        subnormal_bits = lax.bitcast_convert_type(subnormal, jnp.uint32)
        rounded = jnp.where(magnitude < min_normal_bits, subnormal_bits, rounded)
    max_bits = np.float32(fmt.max).view(np.uint32)
    inf_bits, nan_bits = np.uint32(_F32_INF_BITS), np.uint32(_F32_QUIET_NAN_BITS)
    is_nan = magnitude > inf_bits
    if fmt.saturate:
        rounded = jnp.minimum(rounded, max_bits)
        if fmt.has_inf:
            rounded = jnp.where(magnitude == inf_bits, inf_bits, rounded)
        rounded = jnp.where(is_nan, nan_bits, rounded)
    elif fmt.has_inf:
        rounded = jnp.where(rounded > max_bits, inf_bits, rounded)
        rounded = jnp.where(is_nan, nan_bits, rounded)
    else:  # Overflow, inf and NaN inputs all end above max: NaN.
        rounded = jnp.where(rounded > max_bits, nan_bits, rounded)
    return lax.bitcast_convert_type(rounded | sign, jnp.float32)


@functools.partial(jax.jit, static_argnums=0)
def _encode(fmt: FloatFormat, x: jax.Array) -> jax.Array:
    """float32 -> uint32 code of ``fmt`` (rounded, overflow and specials applied)."""
    bits = lax.bitcast_convert_type(x, jnp.uint32)
    sign = bits >> 31
    magnitude = (bits & _F32_ABS_MASK).astype(jnp.int32)
    is_nan = magnitude > _F32_INF_BITS
    is_inf = magnitude == _F32_INF_BITS
    code = _round_magnitude(fmt, jnp.where(is_nan | is_inf, 0, magnitude))

    if fmt.saturate:
        overflow_code = fmt._max_code
    else:
        overflow_code = fmt._inf_code if fmt.has_inf else fmt._nan_code
    if fmt.has_inf:
        inf_code = fmt._inf_code
    else:
        inf_code = fmt._max_code if fmt.saturate else fmt._nan_code
    code = jnp.where(code > fmt._max_code, overflow_code, code)
    code = jnp.where(is_inf, inf_code, code)
    code = jnp.where(is_nan, fmt._nan_code, code)
    return (sign << fmt._magnitude_bits) | code.astype(jnp.uint32)


def _round_magnitude(fmt: FloatFormat, magnitude: jax.Array) -> jax.Array:
    """Finite float32 magnitude bits (int32) -> int32 magnitude code, before the max check."""
    m = fmt.mantissa_bits
    exponent_field = magnitude >> 23
    significand = magnitude & _F32_MANTISSA_MASK
    significand = jnp.where(exponent_field > 0, significand | _F32_HIDDEN_BIT, significand)
    scale = jnp.maximum(exponent_field, 1) - 150  # |x| == significand * 2**scale
    exponent = (31 - lax.clz(significand)) + scale  # floor(log2 |x|) for |x| > 0
    if fmt.subnormals:
        quantum = jnp.maximum(exponent, fmt.emin) - m
    else:
        quantum = exponent - m
    # Validation makes ``quantum >= scale`` whenever it matters; 25 drops every bit.
    dropped = jnp.clip(quantum - scale, 0, 25)
    kept = significand >> dropped
    remainder = significand & ((1 << dropped) - 1)
    half = (1 << dropped) >> 1
    round_up = (remainder > half) | ((remainder == half) & (dropped > 0) & ((kept & 1) == 1))
    rounded = kept + round_up.astype(jnp.int32)
    code = rounded + (quantum - fmt._quantum_exponent) * (1 << m)
    below_range = code < (1 << m) if not fmt.subnormals else jnp.zeros_like(code, bool)
    return jnp.where((significand == 0) | below_range, 0, code)


@functools.partial(jax.jit, static_argnums=0)
def _decode(fmt: FloatFormat, code: jax.Array) -> jax.Array:
    """uint32 code of ``fmt`` -> float32 (exact)."""
    m = fmt.mantissa_bits
    code = code & np.uint32((1 << fmt.total_bits) - 1)
    sign = (code >> fmt._magnitude_bits) & 1
    magnitude = (code & ((1 << fmt._magnitude_bits) - 1)).astype(jnp.int32)
    exponent_field = magnitude >> m
    fraction = magnitude & ((1 << m) - 1)
    if fmt.has_inf:
        is_top = exponent_field == fmt._top_field
        is_inf = is_top & (fraction == 0)
        is_nan = is_top & (fraction != 0)
    else:
        is_inf = jnp.zeros_like(magnitude, bool)
        is_nan = magnitude == fmt._nan_code
    significand = jnp.where(exponent_field > 0, fraction | (1 << m), fraction)
    if not fmt.subnormals:
        significand = jnp.where(exponent_field > 0, significand, 0)
    scale = jnp.maximum(exponent_field, 1) - fmt.bias - m
    result = _float32_bits(significand, scale)
    result = jnp.where(is_inf, _F32_INF_BITS, result)
    result = jnp.where(is_nan, _F32_QUIET_NAN_BITS, result)
    return lax.bitcast_convert_type((sign << 31) | result.astype(jnp.uint32), jnp.float32)


def _float32_bits(significand: jax.Array, scale: jax.Array) -> jax.Array:
    """int32 bits of the float32 ``significand * 2**scale`` (``significand < 2**24``, exact)."""
    top_bit = 31 - lax.clz(significand)
    exponent = top_bit + scale
    mantissa = (significand << jnp.clip(23 - top_bit, 0, 31)) & _F32_MANTISSA_MASK
    normal = ((exponent + 127) << 23) | mantissa
    subnormal = significand << jnp.clip(scale - _F32_MIN_SUBNORMAL_EXPONENT, 0, 31)
    bits = jnp.where(exponent >= _F32_MIN_EXPONENT, normal, subnormal)
    return jnp.where(significand == 0, 0, bits)


def _check_int(argument: str, value: Any, low: int, high: int, reason: str) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise ValueError(f"{argument} must be an int; got {value!r}")
    if not low <= value <= high:
        raise ValueError(
            f"{argument} must be in [{low}, {high}] ({reason}, and every value must fit in "
            f"a float32 container); got {value}"
        )


# --------------------------------------------------------------------------------------------
# Named formats.

FLOAT16 = FloatFormat("float16", exponent_bits=5, mantissa_bits=10)
"""IEEE-754 binary16 (numpy/JAX ``float16``).

Example:
    >>> import hardware, numpy as np
    >>> hardware.FLOAT16.max, hardware.FLOAT16.eps
    (65504.0, 0.0009765625)
    >>> x = np.array([1 + 2**-11, 65519.0, 3e-8], np.float32)
    >>> bool((np.asarray(hardware.FLOAT16.round(x)) == x.astype(np.float16)).all())
    True
"""

BFLOAT16 = FloatFormat("bfloat16", exponent_bits=8, mantissa_bits=7)
"""bfloat16 with subnormals, bit-identical to ``ml_dtypes.bfloat16``.

Example:
    >>> import hardware, ml_dtypes, numpy as np
    >>> x = np.array([1 + 2**-8, 3.0e38, 1e-40], np.float32)
    >>> rounded = np.asarray(hardware.BFLOAT16.round(x))
    >>> bool((rounded == x.astype(ml_dtypes.bfloat16).astype(np.float32)).all())
    True
"""

CBFLOAT16 = FloatFormat("cbfloat16", exponent_bits=6, mantissa_bits=9, bias=31)
"""Cerebras cbfloat16 (1-6-9), in ml_dtypes naming ``float16_e6m9``.

Only the bit split is public. The project assumes (SPEC section 7): bias 31, top exponent
reserved for inf/NaN, gradual underflow, round-to-nearest-even, overflow to inf.

Example:
    >>> import hardware
    >>> cb16 = hardware.CBFLOAT16
    >>> cb16.max == (2 - 2**-9) * 2**31, cb16.smallest_subnormal == 2**-39
    (True, True)
    >>> hardware.CBFLOAT16.round([65504.0, 5e9]).tolist()  # 65504 rounds up; beyond max: inf
    [65536.0, inf]
"""

FLOAT8_E5M2 = FloatFormat("float8_e5m2", exponent_bits=5, mantissa_bits=2)
"""IEEE-like float8, bit-identical to ``ml_dtypes.float8_e5m2``.

Example:
    >>> import hardware
    >>> hardware.FLOAT8_E5M2.max, hardware.FLOAT8_E5M2.round([1.1, 60000.0, 1e6]).tolist()
    (57344.0, [1.0, 57344.0, inf])
"""

FLOAT8_E4M3 = FloatFormat("float8_e4m3", exponent_bits=4, mantissa_bits=3)
"""IEEE-like float8, bit-identical to ``ml_dtypes.float8_e4m3``.

Example:
    >>> import hardware
    >>> hardware.FLOAT8_E4M3.max, hardware.FLOAT8_E4M3.round([1.1, 235.0, 250.0]).tolist()
    (240.0, [1.125, 240.0, inf])
"""

FLOAT8_E4M3FN = FloatFormat("float8_e4m3fn", exponent_bits=4, mantissa_bits=3, has_inf=False)
"""OCP E4M3 (no infinities, max 448), bit-identical to ``ml_dtypes.float8_e4m3fn``.

Example:
    >>> import hardware, math
    >>> values = hardware.FLOAT8_E4M3FN.round([448.0, 1e4]).tolist()  # no inf: overflow is NaN
    >>> hardware.FLOAT8_E4M3FN.max, values[0], math.isnan(values[1])
    (448.0, 448.0, True)
"""

FLOAT8_E3M4 = FloatFormat("float8_e3m4", exponent_bits=3, mantissa_bits=4)
"""IEEE-like float8, bit-identical to ``ml_dtypes.float8_e3m4``.

Example:
    >>> import hardware
    >>> hardware.FLOAT8_E3M4.max, hardware.FLOAT8_E3M4.eps
    (15.5, 0.0625)
"""

_FORMATS: dict[str, FloatFormat] = {
    fmt.name: fmt
    for fmt in (FLOAT16, BFLOAT16, CBFLOAT16, FLOAT8_E5M2, FLOAT8_E4M3, FLOAT8_E4M3FN, FLOAT8_E3M4)
}
_ALIASES: dict[str, str] = {"float16_e6m9": "cbfloat16", "cb16": "cbfloat16"}


def known_formats() -> tuple[str, ...]:
    """Names :func:`get_format` accepts (aliases ``"float16_e6m9"`` and ``"cb16"`` aside).

    Example:
        >>> known_formats()[:3]
        ('float16', 'bfloat16', 'cbfloat16')
    """
    return tuple(_FORMATS)


def get_format(name: Any) -> FloatFormat:
    """Returns the named format.

    Args:
        name: a format name (``"float16"``, ``"bfloat16"``, ``"cbfloat16"`` or its aliases
            ``"float16_e6m9"`` and ``"cb16"``, or a float8 name from :func:`known_formats`),
            a numpy/JAX dtype such as ``jnp.float16`` or ``jnp.bfloat16``, an object whose
            ``str()`` is ``"torch.float16"`` or ``"torch.bfloat16"``, or a :class:`FloatFormat`
            (returned as is).

    Returns:
        The :class:`FloatFormat`.

    Raises:
        ValueError: ``name`` names no known format; the message lists the known ones.

    Example:
        >>> import jax.numpy as jnp
        >>> get_format("cbfloat16").max == (2 - 2**-9) * 2**31
        True
        >>> get_format(jnp.bfloat16).name
        'bfloat16'
    """
    if isinstance(name, FloatFormat):
        return name
    key = _format_key(name)
    key = _ALIASES.get(key, key) if key is not None else None
    if key in _FORMATS:
        return _FORMATS[key]
    known = ", ".join(repr(n) for n in (*_FORMATS, *_ALIASES))
    raise ValueError(f"unknown number format {name!r}; known formats: {known}")


def _format_key(name: Any) -> str | None:
    if isinstance(name, str):
        return name
    text = str(name)
    if text.startswith("torch."):
        return text.removeprefix("torch.")
    try:
        return np.dtype(name).name
    except TypeError:
        return None
