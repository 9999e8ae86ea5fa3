"""cbfloat16 rounding as torch operations, held bit for bit to ``hardware``'s JAX rounding.

Why there are two. ``hardware.get_format("cbfloat16").round`` (JAX) is the specification of the
format: the one the JAX front door uses and the one the tests check against ml_dtypes and hand
derivations. A torch model previewed under ``cstorch.amp.cbfloat16_numerics`` rounds every
parameter and activation, forward and backward: about 180 roundings per iteration of a small
GPT-2. Through JAX each one crossed DLPack twice, dispatched a jitted call and switched between
torch's and XLA's thread pools, which made the preview cost as much as a second iteration. Done
here, the rounding runs on the tensor's own device with no crossing: one compiled C++ loop on the
CPU, a handful of element-wise torch operations elsewhere.
``tests/torch_facade/test_cbfloat16_kernel.py`` holds this kernel to the JAX rounding bit for
bit: every cbfloat16 code, every rounding tie, float32 subnormals, infs and NaNs, and random
float32 bit patterns (10**7 in all). ``hardware`` stays the specification; a change of the
format is made there and this kernel follows the test.

On the CPU, a contiguous tensor takes the fused path once :func:`prepare_fused_rounding` has
compiled it (``cbfloat16_numerics`` does, on entry: a rounding call alone never starts a compile
of seconds), strided ones (and every tensor before that, or where the fused path cannot be
compiled) the integer path, and the few the integer path refuses, like every tensor on other
devices, the carrier path. All give the same bits.

**The fused path** (CPU, contiguous tensors): one C++ loop (:data:`LOOP_SOURCE`: the carrier
path's arithmetic on each element, its decisions made per element by selects), compiled once per
process by inductor's C++ toolchain (the compiler, flags and cache folder inductor uses for its
own CPU kernels) and called through a Python binding that takes the tensors themselves: it reads
the tensor once and writes the result once, split over torch's threads as they are at each call
(one thread below :data:`PARALLEL_FROM` elements); the integer path makes eight passes and a
reduction that waits for its result. Inductor builds its kernels without the compiler's loop
vectoriser (its code generator writes the vector operations itself); the source turns it back on
for this loop, which then runs at the speed of one multiplication (docs/performance-notes.md,
"Figures from the facade's docstrings"). ``cbfloat16_numerics`` compiles it on entry (on the
2-core AMD EPYC of docs/performance-notes.md: about 8 s with an empty inductor cache, 2.7 s with
a warm one, most of it importing inductor) and checks it against the carrier path on a probe;
where it cannot be compiled (no C++ compiler, say) or ``CSTORCH_CBFLOAT16_FUSED=0`` is set, the
integer path stays.

**The integer path** (CPU). Rounding to nearest even at bit 14 of the float32 encoding is
``(b + 0x1FFF + ((b >> 14) & 1)) & ~0x3FFF`` on the bits ``b``: five in-place passes over one
new tensor, with the sign and zeros kept for free. It is exact where cbfloat16's quantum is
float32's ``2**14`` ulps, that is when every nonzero ``|x|`` lies in ``[2**-30, 2**31)``: below
``2**-30`` the quantum stays ``2**-39`` (cbfloat16's subnormals), from ``2**31`` values may round
to ``2**32`` and must become inf, and infs and NaNs are not numbers to round. One reduction
decides it, before the passes, on ``(b - 1) & 0x7FFFFFFF`` written into the output tensor: zeros
become ``0x7FFFFFFF`` and every other value ``|b| - 1``, so the minimum finds a magnitude below
``2**-30`` that is not a zero, and the maximum one of ``2**31`` or more unless a zero is there
(then a reduction over ``x`` answers). ``b - 1`` wraps at ``-0.0`` (``INT32_MIN``), as torch's
integer arithmetic does on every CPU it runs on; the tests hold ``-0.0`` to the specification.
In a GPT-2's iteration few of the roundings take the carrier path.

**The carrier path** (every ``x``), with IEEE float32 addition doing the rounding itself:

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

Off the CPU both paths' decisions would wait for the device, so the carrier path runs whole,
with no read.
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Callable

import torch

from torch_facade.amp import _caller
from torch_facade.amp._trusted_folder import owner_and_mode_problem

__all__ = [
    "LOOP_SOURCE",
    "prepare_fused_rounding",
    "round_float32",
]

_ABS = 0x7FFFFFFF
_SIGN = -0x80000000  # 0x80000000 as an int32
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
_CARRIER_FIELD = _DROPPED_BITS << _MANTISSA_SHIFT  # times 2**14, as an addition to the bits
_MAY_OVERFLOW_FIELD = _field(_HIGHEST_EXPONENT - 1)  # below 2**31 nothing rounds to 2**32
_SHIFT_EXACT_FROM = _LOWEST_FIELD  # 2**-30: from here up cbfloat16's quantum is 2**14 ulps
_ROUND_BIT = 1 << _DROPPED_BITS
_KEPT_BITS = -_ROUND_BIT  # ~0x3FFF as an int32


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
    if x.is_cpu and x.numel() > 0:
        if _FUSED and x.is_contiguous():  # the loop, once prepare_fused_rounding compiled it
            fused = _FUSED[0]
            if fused is not None:
                return fused(x)
        rounded = _round_on_integers(x)
        if rounded is not None:
            return rounded
    return _round_with_carrier(x)


PARALLEL_FROM = 32768
"""Elements from which the fused loop is split over torch's threads: below it, starting the
threads costs more than the loop (a 2**15-element loop takes about 10 us on one thread)."""

LOOP_SOURCE = r"""
// cbfloat16 rounding of float32, one element at a time (torch_facade/amp/_cbfloat16_kernel.py).
// Inductor compiles with -fno-tree-loop-vectorize (its kernels are vectorised by hand); this loop
// is written for the compiler's vectoriser, so it is turned on again here (GCC; other compilers
// ignore the line and keep the same bits, more slowly).
#pragma GCC optimize("tree-loop-vectorize")
#include <cstdint>
#include <cstring>

extern "C" void kernel(const float* in, float* out, int64_t n, int64_t threads) {
    #pragma omp parallel for num_threads(threads) schedule(static) if(threads > 1 && n >= PARALLEL_FROM)
    for (int64_t i = 0; i < n; ++i) {
        int32_t bits;
        std::memcpy(&bits, in + i, 4);
        int32_t magnitude = bits & 0x7FFFFFFF;
        // The carrier 2**e * 2**14, e the exponent of |x| clamped to [-30, 32].
        int32_t power = magnitude & 0x7F800000;
        power = power < LOWEST_FIELD ? LOWEST_FIELD : power;
        power = power > HIGHEST_FIELD ? HIGHEST_FIELD : power;
        int32_t carrier_bits = power + CARRIER_FIELD;
        float value, carrier;
        std::memcpy(&value, &magnitude, 4);
        std::memcpy(&carrier, &carrier_bits, 4);
        float rounded = (value + carrier) - carrier;  // the rounding to nearest even
        int32_t result;
        std::memcpy(&result, &rounded, 4);
        result = result >= HIGHEST_FIELD ? 0x7F800000 : result;  // 2**32 and up, inf: inf
        result = magnitude > 0x7F800000 ? QUIET_NAN : result;    // NaN: the quiet NaN
        result |= bits & INT32_MIN;                               // the sign of x
        std::memcpy(out + i, &result, 4);
    }
}
"""
"""The fused path's loop: the carrier path (the module's docstring) on each element, its two
decisions made per element. Compiled as C++ by :func:`_compile_loop`; the upper-case names are
this module's constants, put in before it is compiled."""

_FUSED: list[Callable[[torch.Tensor], torch.Tensor] | None] = []
"""The fused rounding once tried: ``[function]``, or ``[None]`` where it cannot be compiled."""


def _fused_rounding() -> Callable[[torch.Tensor], torch.Tensor] | None:
    """:data:`LOOP_SOURCE` compiled into one loop over the tensor (one read, one write, against
    the integer path's eight passes), or ``None`` where it cannot be compiled here (no C++
    compiler, an unsupported platform, or ``CSTORCH_CBFLOAT16_FUSED=0``). Compiled once per
    process; inductor's cache on disk makes the compilation of later processes short. A
    compiled loop that does not give the carrier path's bits on a probe is not used."""
    if _FUSED:
        return _FUSED[0]
    fused: Callable[[torch.Tensor], torch.Tensor] | None = None
    if os.environ.get("CSTORCH_CBFLOAT16_FUSED", "1") != "0" and _inductor_cache_is_trusted():
        try:
            fused = _compile_loop(_loop_source())
            if not _rounds_the_probe(fused):
                fused = None
        except Exception:  # any failure to compile leaves the integer path
            fused = None
    _FUSED.append(fused)
    return fused


def _loop_source() -> str:
    """:data:`LOOP_SOURCE` with this module's constants written in."""
    constants = {
        "PARALLEL_FROM": PARALLEL_FROM,
        "LOWEST_FIELD": _LOWEST_FIELD,
        "HIGHEST_FIELD": _HIGHEST_FIELD,
        "CARRIER_FIELD": _CARRIER_FIELD,
        "QUIET_NAN": _QUIET_NAN,
    }
    source = LOOP_SOURCE
    for name, value in constants.items():
        source = source.replace(name, str(value))
    return source


def _inductor_cache_is_trusted() -> bool:
    """Whether inductor's cache folder (``TORCHINDUCTOR_CACHE_DIR``, by default
    ``torchinductor_<user>`` in the temporary folder) can only have been written by this user or
    root: inductor loads the compiled loop from there, and loading it runs it. A folder others
    may write, or one that belongs to someone else (a ``/tmp/torchinductor_<you>`` made by
    another user of the machine, say), keeps the uncompiled paths, with a warning; so does a
    platform that cannot say who owns a folder. A folder not made yet is inductor's to make, as
    this user. The check is of the folder itself, before inductor uses it."""
    problem: tuple[str, str] | None
    if not hasattr(os, "geteuid"):
        problem = ("this platform cannot say who owns it", "none here")
        path = "inductor's cache folder"
    else:
        from torch._inductor.runtime.cache_dir_utils import default_cache_dir

        path = os.path.abspath(os.environ.get("TORCHINDUCTOR_CACHE_DIR") or default_cache_dir())
        try:
            info = os.stat(path)
        except OSError:  # absent (inductor makes it, as this user) or unreadable (it fails)
            return True
        problem = owner_and_mode_problem(info, "the folder", path)
    if problem is None:
        return True
    warnings.warn(
        f"cbfloat16_numerics rounds without its compiled loop in this run (the same bits, "
        f"slower): inductor would compile and load it from {path}, and {problem[0]}. Loading "
        f"compiled code runs it, so the folder must belong to you (or root) and no one else "
        f"may write it. To fix it: {problem[1]}; or set TORCHINDUCTOR_CACHE_DIR to a folder of "
        f"your own; CSTORCH_CBFLOAT16_FUSED=0 turns the loop off without this warning.",
        RuntimeWarning,
        stacklevel=_caller.stacklevel(),
    )
    return False


def prepare_fused_rounding() -> bool:
    """Compiles the fused CPU rounding (once per process; a no-op after), from which contiguous
    CPU tensors take it; returns whether it is in use. ``cbfloat16_numerics`` calls it on
    entry.

    Example:
        >>> from torch_facade.amp import _cbfloat16_kernel
        >>> isinstance(_cbfloat16_kernel.prepare_fused_rounding(), bool)
        True
    """
    return _fused_rounding() is not None


def _compile_loop(source: str) -> Callable[[torch.Tensor], torch.Tensor]:
    """``source`` (a C++ function ``kernel(in, out, n, threads)``) compiled and loaded by
    inductor's C++ toolchain, as a function of a contiguous float32 CPU tensor that returns a
    new one. The binding reads each tensor's data pointer (no dispatcher, no autograd: the
    result records nothing), so a call costs a few microseconds."""
    from torch._inductor.codecache import CppPythonBindingsCodeCache

    loop = CppPythonBindingsCodeCache.load_pybinding(
        ["const float*", "float*", "int64_t", "int64_t"], source
    )

    def direct(x: torch.Tensor) -> torch.Tensor:
        out = torch.empty_like(x, memory_format=torch.contiguous_format)
        loop(x, out, x.numel(), torch.get_num_threads())
        return out

    return direct


def _rounds_the_probe(loop: Callable[[torch.Tensor], torch.Tensor]) -> bool:
    """Whether ``loop`` gives the carrier path's bits on ordinary values, every special one and
    two sizes (one not a multiple of any vector width)."""
    specials = torch.tensor(
        [0.0, -0.0, float("inf"), -float("inf"), float("nan"), 2.0**31, 2.0**32 - 2.0**8,
         -(2.0**32), 3e38, 2.0**-40, 3 * 2.0**-40, -(2.0**-149), 1 + 2.0**-10, 1 + 3 * 2.0**-10]
    )  # fmt: skip
    ordinary = torch.linspace(-3.0, 3.0, 4099) * 2.0**-7
    for probe in (torch.cat([ordinary, specials]), specials[:3]):
        expected = _round_with_carrier(probe).view(torch.int32)
        if not torch.equal(loop(probe).view(torch.int32), expected):
            return False
    return True


def _round_on_integers(x: torch.Tensor) -> torch.Tensor | None:
    """The integer path, or ``None`` where it would be wrong (some nonzero ``|x|`` below
    ``2**-30``, or ``2**31`` and up, inf or NaN). See the module's docstring."""
    bits = x.view(torch.int32)
    out = torch.sub(bits, 1)
    out.bitwise_and_(_ABS)  # zeros: 0x7FFFFFFF; every other value: |bits| - 1
    lowest, highest = torch.aminmax(out)
    if int(lowest) < _SHIFT_EXACT_FROM - 1:
        return None
    if int(highest) >= _MAY_OVERFLOW_FIELD - 1:
        if int(highest) != _ABS:  # no zero there: some |x| is 2**31 or more, inf or NaN
            return None
        low, high = torch.aminmax(x)  # a zero hides the top: read x (NaN propagates)
        if not (-(2.0**31) < float(low) and float(high) < 2.0**31):
            return None
    torch.bitwise_right_shift(bits, _DROPPED_BITS, out=out)
    out.bitwise_and_(1).add_(bits).add_(_ROUND_BIT // 2 - 1).bitwise_and_(_KEPT_BITS)
    return out.view(torch.float32)


def _round_with_carrier(x: torch.Tensor) -> torch.Tensor:
    """The carrier path: every float32, on every device. See the module's docstring."""
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
