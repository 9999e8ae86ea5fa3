"""cbfloat16 rounding as torch operations, held bit for bit to ``hardware``'s JAX rounding.

Why there are two. ``hardware.get_format("cbfloat16").round`` (JAX) is the specification of the
format: the one the JAX front door uses and the one the tests check against ml_dtypes and hand
derivations. A torch model previewed under ``cstorch.amp.cbfloat16_numerics`` rounds every
parameter and activation, forward and backward: about 270 roundings per iteration of a small
GPT-2. Through JAX each one crossed DLPack twice, dispatched a jitted call and switched between
torch's and XLA's thread pools, which made the preview about 2x a float32 iteration. Done here,
the rounding is six element-wise torch operations on the tensor's own device (nine where some
value is ``2**31`` or more, or not finite), with no crossing.
``tests/torch_facade/test_cbfloat16_kernel.py`` holds this kernel to the JAX rounding bit for
bit: every cbfloat16 code, every rounding tie, float32 subnormals, infs and NaNs, and random
float32 bit patterns (10**7 in all). ``hardware`` stays the specification; a change of the
format is made there and this kernel follows the test.

How it rounds a float32 ``x`` (round-to-nearest-even to 9 mantissa bits, subnormals down to
``2**-39``, overflow to inf, NaN to the quiet NaN, the sign kept), with IEEE float32 addition
doing the rounding itself:

1. ``a = |x|``; ``c = 2**e * 2**14``, ``e`` the exponent of ``a`` clamped to ``[-30, 32]``
   (``2**e``: the exponent bits of ``x``, clamped as integers; the product by ``2**14`` is exact
   inside the next step). Then ``a < c`` and every float32 in ``[c, 2c)`` is a multiple of
   ``2**(e - 9)``: the quantum of cbfloat16 at ``a`` (``2**-39`` below ``2**-30``).
2. ``(a + c) - c`` (``add_``/``sub_`` with ``alpha=2**14``): the addition rounds ``a`` to that
   quantum, to nearest even; the subtraction is exact.
3. ``* 2**96 * 2**-96``: exact for every value below ``2**32``; the values from ``2**32`` up
   (past the largest cbfloat16, ``(2 - 2**-9) * 2**31``) become inf.
4. The bits clamped at the quiet NaN's (an addition leaves a NaN's quiet bit set on CPUs, and
   CUDA returns its canonical NaN, 0x7FFFFFFF: both at or above it; not yet run on a GPU).
   Steps 3 and 4 change nothing unless some ``|x|`` is ``2**31`` or more (inf and NaN
   included): on the CPU, one read of the exponents decides whether they run.
5. ``copysign`` with ``x``.
"""

from __future__ import annotations

import torch

__all__ = ["round_float32"]

_ABS = 0x7FFFFFFF
_EXPONENT = 0x7F800000
_QUIET_NAN = 0x7FC00000
_MANTISSA_SHIFT = 23
_DROPPED_BITS = 23 - 9  # float32's mantissa bits minus cbfloat16's
_BIAS = 127
_LOWEST_EXPONENT = -30  # cbfloat16's smallest normal is 2**-30; its subnormals share its quantum
_HIGHEST_EXPONENT = 32  # anything from 2**32 overflows
_OVERFLOW = 2.0**96  # 2**32 * 2**96 overflows float32; every smaller cbfloat16 value does not


def _field(exponent: int) -> int:
    return (exponent + _BIAS) << _MANTISSA_SHIFT


_LOWEST_FIELD = _field(_LOWEST_EXPONENT)
_HIGHEST_FIELD = _field(_HIGHEST_EXPONENT)
_CARRIER = 2.0**_DROPPED_BITS  # the carrier is 2**e (the clamped exponent bits) times this
_MAY_OVERFLOW_FIELD = _field(_HIGHEST_EXPONENT - 1)  # below 2**31 nothing rounds to 2**32


def round_float32(x: torch.Tensor) -> torch.Tensor:
    """Rounds a float32 tensor to cbfloat16 values (a new float32 tensor, same shape).

    Bit-identical to ``hardware.get_format("cbfloat16").round`` on every float32 input.

    Args:
        x: a float32 tensor (any device torch supports integer and float element-wise on).

    Example:
        >>> import torch
        >>> from torch_facade.amp._cbfloat16_kernel import round_float32
        >>> x = torch.tensor([1 + 2**-10, 65504.0, 2.0**-39, 2.0**-40, -1e10, float("nan")])
        >>> round_float32(x).tolist()
        [1.0, 65536.0, 1.8189894035458565e-12, 0.0, -inf, nan]
    """
    bits = x.view(torch.int32)
    power_bits = (bits & _EXPONENT).clamp_(_LOWEST_FIELD, _HIGHEST_FIELD)
    power = power_bits.view(torch.float32)
    rounded = (bits & _ABS).view(torch.float32)
    rounded.add_(power, alpha=_CARRIER).sub_(power, alpha=_CARRIER)  # 2**e * 2**14: exact
    if _may_overflow(power_bits):
        rounded.mul_(_OVERFLOW).mul_(1.0 / _OVERFLOW)
        rounded.view(torch.int32).clamp_(max=_QUIET_NAN)
    return torch.copysign(rounded, x, out=rounded)


def _may_overflow(power_bits: torch.Tensor) -> bool:
    """Whether steps 3 and 4 can change anything: some ``|x|`` is ``2**31`` or more (an inf and
    a NaN among them). On the CPU one read of the exponents answers it, and skips two of the
    three passes most tensors would make for nothing; elsewhere the answer would wait for the
    device, so they are made."""
    if power_bits.device.type != "cpu" or power_bits.numel() == 0:
        return power_bits.numel() > 0
    return bool(power_bits.max() >= _MAY_OVERFLOW_FIELD)
