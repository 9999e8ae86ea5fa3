"""What a training loop logs and asks when steps are skipped: metrics and per-leaf reports.

The reports are computed only when asked (never on the hot path): :func:`nonfinite_report`
(which gradients overflowed) and :func:`gradient_range_report` (how the gradients fit a half
format's range at a loss scale: "is my loss scale right?").
"""

from __future__ import annotations

import functools
import math
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from amp_core.scaling import apply_multiplier, sum_of_unscaled_squares
from amp_core.state import LossScaleState
from amp_core.transforms import loss_scale_state, spike_state
from hardware import FloatFormat, get_format

METRIC_NAMES = ("loss_scale", "num_skipped_steps", "global_norm", "isfinite")
"""The keys of :func:`scaler_metrics`, in order (those of ``cstorch.amp.scaler_metrics``)."""


class LeafReport(NamedTuple):
    """What one gradient leaf contributed to an overflow.

    Attributes:
        overflows: whether this leaf alone makes the global norm non-finite (0-d bool): it holds
            an inf or NaN once unscaled, or values so large that their squares overflow float32.
        nonfinite_count: how many of its elements are inf or NaN once unscaled (0-d int32).

    Example:
        >>> import amp_core, jax.numpy as jnp
        >>> report = amp_core.nonfinite_report({"w": jnp.array([1.0, jnp.nan, 3e38])}, 0.5)
        >>> report["w"]._fields, bool(report["w"].overflows), int(report["w"].nonfinite_count)
        (('overflows', 'nonfinite_count'), True, 1)
    """

    overflows: jax.Array
    nonfinite_count: jax.Array


def nonfinite_report(grads: Any, inv_scale: jax.typing.ArrayLike = 1.0) -> Any:
    """Per leaf of ``grads``, whether it overflows and how many elements are inf or NaN.

    Read-only and jittable; meant for diagnosing a skipped step, not for every step. The values
    are unscaled (multiplied by ``inv_scale`` and rounded to each leaf's dtype) before they are
    checked, exactly as :func:`amp_core.check_grads` sees them. Non-floating leaves report no
    overflow.

    Args:
        grads: any pytree of gradients.
        inv_scale: what the gradients are multiplied by to unscale them (``1 / loss_scale``, or
            1 for gradients that are already unscaled).

    Returns:
        A pytree of ``grads``' structure with a :class:`LeafReport` in place of every leaf.

    Example:
        >>> import amp_core, jax.numpy as jnp
        >>> grads = {"a": jnp.array([1.0, jnp.inf, jnp.nan]), "b": jnp.ones(2)}
        >>> report = amp_core.nonfinite_report(grads)
        >>> bool(report["a"].overflows), int(report["a"].nonfinite_count)
        (True, 2)
        >>> bool(report["b"].overflows)
        False
    """
    inv = jnp.asarray(inv_scale, jnp.float32)

    def leaf_report(leaf: Any) -> LeafReport:
        leaf = jnp.asarray(leaf)
        if not jnp.issubdtype(leaf.dtype, jnp.floating):
            return LeafReport(jnp.asarray(False), jnp.zeros((), jnp.int32))
        unscaled = apply_multiplier(leaf, inv)
        count = jnp.sum(jnp.logical_not(jnp.isfinite(unscaled)), dtype=jnp.int32)
        overflows = jnp.logical_not(jnp.isfinite(sum_of_unscaled_squares([leaf], inv)))
        return LeafReport(overflows, count)

    return jax.tree_util.tree_map(leaf_report, grads)


def scaler_metrics(source: Any, *, as_arrays: bool = False) -> dict[str, Any]:
    """The scaler's numbers for a logger, as ``cstorch.amp.scaler_metrics`` gives them.

    ``loss_scale`` (the scale the next step will use), ``num_skipped_steps``, ``global_norm``
    (of the last step's unscaled gradients) and ``isfinite`` (whether the last step was
    applied), and ``num_spike_skips`` when the state skips spikes (:class:`amp_core.SpikeSkip`), from any state :func:`amp_core.loss_scale_state` reads: a
    :class:`~amp_core.LossScaleState`, the state of :func:`amp_core.with_loss_scaling` or a tree
    that nests it, an ``nnx.Optimizer``, :class:`amp_core.flax_nnx.LossScaledOptimizer`,
    a linen ``TrainState``, a tree restored without a target.

    Args:
        source: where the scaler state is.
        as_arrays: return the 0-d arrays themselves (jittable, no host synchronisation)
            instead of Python numbers.

    Returns:
        ``{"loss_scale": float, "num_skipped_steps": int, "global_norm": float,
        "isfinite": bool}`` (one host transfer), or the same keys with 0-d arrays.

    Raises:
        ValueError: ``source`` holds no scaler state (see :func:`amp_core.loss_scale_state`).
        TypeError: Python numbers asked for inside ``jax.jit`` (pass ``as_arrays=True``).

    Example:
        >>> import amp_core, jax.numpy as jnp, optax
        >>> tx = amp_core.with_loss_scaling(optax.sgd(0.1), amp_core.DynamicLossScale())
        >>> amp_core.scaler_metrics(tx.init({"w": jnp.zeros(2)}))
        {'loss_scale': 32768.0, 'num_skipped_steps': 0, 'global_norm': 0.0, 'isfinite': True}
    """
    state = loss_scale_state(source)
    values = {name: getattr(state, name) for name in METRIC_NAMES}
    spikes = None if isinstance(source, LossScaleState) else spike_state(source)
    if spikes is not None:
        values["num_spike_skips"] = spikes.num_spike_skips
    if as_arrays:
        return values
    host = jax.device_get(values)  # one transfer, not one per number
    if not all(isinstance(value, (np.ndarray, np.generic)) for value in host.values()):
        raise TypeError(
            "scaler_metrics(source) reads the numbers on the host, which it cannot do inside "
            "jax.jit (the scaler holds tracers); there, pass as_arrays=True"
        )
    metrics: dict[str, Any] = {
        "loss_scale": float(host["loss_scale"]),
        "num_skipped_steps": int(host["num_skipped_steps"]),
        "global_norm": float(host["global_norm"]),
        "isfinite": bool(host["isfinite"]),
    }
    if "num_spike_skips" in host:
        metrics["num_spike_skips"] = int(host["num_spike_skips"])
    return metrics


class GradientRange(NamedTuple):
    """How one gradient leaf fits a half format at a loss scale (all 0-d arrays).

    Every count is of elements of the leaf, the gradients taken as *unscaled* (true) values and
    multiplied by the loss scale in float32 before they are rounded to the format, as a scaled
    backward pass would hold them.

    Attributes:
        size: elements (int32).
        zeros: elements that are zero already, before scaling (int32).
        underflows: nonzero finite elements that round to zero: their information is lost
            (int32).
        subnormals: nonzero elements that round to a subnormal of the format: kept, with fewer
            significant bits than the format's normal numbers (int32).
        overflows: finite elements that round beyond the format's largest value (int32).
        nonfinite: elements that are inf or NaN already (int32).
        headroom: how many times the scale can still double before the largest finite element
            overflows the format (float32, a whole number; negative when it overflows already,
            ``inf`` when every element is zero or non-finite).

    Example:
        >>> import amp_core, jax.numpy as jnp
        >>> report = amp_core.gradient_range_report(jnp.array([1e-8, 1e-6, 3.0, 0.0]))
        >>> int(report.underflows), int(report.subnormals), float(report.headroom)
        (1, 1, 14.0)
    """

    size: jax.Array
    zeros: jax.Array
    underflows: jax.Array
    subnormals: jax.Array
    overflows: jax.Array
    nonfinite: jax.Array
    headroom: jax.Array


def gradient_range_report(
    grads: Any,
    *,
    half_dtype: Any = "float16",
    loss_scale: Any = 1.0,
) -> Any:
    """Per leaf of ``grads``: how many elements underflow, lose precision or overflow in
    ``half_dtype`` at ``loss_scale``, and how many doublings of headroom remain.

    Answers "is my loss scale right?" before a run goes wrong: many ``underflows`` say the scale
    is too low for the format (those gradient elements become zero in a half-precision backward
    pass), a ``headroom`` near 0 says the next growth will overflow. Read-only, jittable, and
    meant to be called now and then (every few hundred steps, or once on a float32 run before
    choosing a format), not on every step: it reads every gradient element.

    Args:
        grads: a pytree of *unscaled* gradients (float32, or any floating dtype), e.g. from a
            float32 backward pass or the unscaled gradients of a loss-scaled step.
        half_dtype: the format to check against: ``"float16"``, ``"bfloat16"``, ``"cbfloat16"``
            (the names :func:`hardware.get_format` accepts, a JAX dtype, or a
            :class:`hardware.FloatFormat`).
        loss_scale: the scale the gradients would be multiplied by: a positive number or 0-d
            array, or any scaler state :func:`amp_core.loss_scale_state` reads (its current
            ``loss_scale`` is used).

    Returns:
        A pytree of ``grads``' structure with a :class:`GradientRange` in place of every leaf
        (non-floating leaves report ``size`` 0). :func:`gradient_range_totals` sums it.

    Raises:
        ValueError: ``half_dtype`` names no known format, or ``loss_scale`` is a number that is
            not positive and finite.

    Example:
        >>> import amp_core, jax.numpy as jnp
        >>> grads = {"w": jnp.array([2e-8, 1e-4, 0.5]), "b": jnp.array([7e4])}
        >>> report = amp_core.gradient_range_report(grads, half_dtype="float16")
        >>> int(report["w"].underflows), int(report["w"].subnormals), int(report["b"].overflows)
        (1, 0, 1)
        >>> scaled = amp_core.gradient_range_report(grads["w"], loss_scale=2.0**10)
        >>> int(scaled.underflows), int(scaled.subnormals), float(scaled.headroom)
        (0, 1, 6.0)
    """
    try:
        fmt = get_format(half_dtype)
    except ValueError as err:
        raise ValueError(f"half_dtype: {err}") from None
    scale = _scale_of(loss_scale)
    return jax.tree_util.tree_map(lambda leaf: _leaf_range(jnp.asarray(leaf), scale, fmt), grads)


def gradient_range_totals(report: Any) -> GradientRange:
    """One :class:`GradientRange` for a whole :func:`gradient_range_report`: counts summed, the
    smallest headroom.

    Example:
        >>> import amp_core, jax.numpy as jnp
        >>> grads = {"w": jnp.array([1e-8, 0.5]), "b": jnp.array([1e-9, 4.0])}
        >>> total = amp_core.gradient_range_totals(amp_core.gradient_range_report(grads))
        >>> int(total.size), int(total.underflows), float(total.headroom)
        (4, 2, 13.0)
    """
    leaves = jax.tree_util.tree_leaves(report, is_leaf=lambda x: isinstance(x, GradientRange))
    if not leaves or not all(isinstance(leaf, GradientRange) for leaf in leaves):
        raise TypeError(
            "report must be the result of gradient_range_report (a pytree of GradientRange); "
            f"got {type(report).__name__}"
        )
    counts = {
        name: sum((getattr(leaf, name) for leaf in leaves), jnp.zeros((), jnp.int32))
        for name in GradientRange._fields[:-1]
    }
    headroom = functools.reduce(jnp.minimum, (leaf.headroom for leaf in leaves))
    return GradientRange(**counts, headroom=headroom)


def suggested_loss_scale(
    grads: Any, *, half_dtype: Any = "float16", headroom: int = 2
) -> jax.Array:
    """The largest power of two that leaves ``headroom`` doublings between the largest gradient
    element, multiplied by it, and overflow in ``half_dtype``.

    A starting loss scale read off the gradients themselves: the scale that lifts the small
    gradient elements as far above the format's underflow as the largest element allows, less a
    margin of ``headroom`` doublings for gradients that grow. With the suggested scale ``s``,
    ``gradient_range_report(grads, half_dtype=half_dtype, loss_scale=s)`` reports a headroom of
    exactly ``headroom``. Read-only and jittable; it reads every element, like
    :func:`gradient_range_report`.

    Args:
        grads: a pytree of *unscaled* gradients (of a float32 backward pass, for instance);
            non-floating leaves and inf or NaN elements are ignored.
        half_dtype: the format (the names :func:`hardware.get_format` accepts, a JAX dtype or a
            :class:`hardware.FloatFormat`).
        headroom: doublings to leave before the largest element overflows, a non-negative
            integer.

    Returns:
        A float32 0-d array: a power of two, at most ``2**127`` (float32's largest), smaller
        than 1 when the gradients overflow the format already; ``inf`` when no element is
        finite and nonzero (any scale fits).

    Raises:
        ValueError: ``half_dtype`` names no known format, or ``headroom`` is not a non-negative
            integer.

    Example:
        >>> import amp_core, jax.numpy as jnp
        >>> grads = {"w": jnp.array([3e-9, 0.5]), "b": jnp.array([-2.0**-6])}
        >>> float(amp_core.suggested_loss_scale(grads, half_dtype="float16", headroom=0))
        65536.0
        >>> float(amp_core.suggested_loss_scale(grads, half_dtype="float16"))  # 2 doublings
        16384.0
    """
    try:
        fmt = get_format(half_dtype)
    except ValueError as err:
        raise ValueError(f"half_dtype: {err}") from None
    if isinstance(headroom, bool) or not isinstance(headroom, (int, np.integer)) or headroom < 0:
        raise ValueError(f"headroom must be a non-negative integer (doublings); got {headroom!r}")
    largest = jnp.zeros((), jnp.float32)
    for leaf in jax.tree_util.tree_leaves(grads):
        leaf = jnp.asarray(leaf)
        if jnp.issubdtype(leaf.dtype, jnp.floating):
            magnitude = jnp.abs(leaf.astype(jnp.float32))
            largest = jnp.maximum(
                largest, jnp.max(jnp.where(jnp.isfinite(magnitude), magnitude, 0.0), initial=0.0)
            )
    doublings = _headroom(largest, fmt)  # at scale 1
    exponent = jnp.clip(jnp.where(jnp.isinf(doublings), 0.0, doublings) - headroom, -149, 127)
    scale = jnp.ldexp(jnp.float32(1.0), exponent.astype(jnp.int32))
    return jnp.where(largest == 0, jnp.float32(jnp.inf), scale)


def _scale_of(loss_scale: Any) -> jax.Array:
    """The loss scale as a float32 0-d array (from a number, an array or a scaler state)."""
    if isinstance(loss_scale, (int, float, np.integer, np.floating)) and not isinstance(
        loss_scale, bool
    ):
        if not (math.isfinite(loss_scale) and loss_scale > 0):
            raise ValueError(f"loss_scale must be positive and finite; got {loss_scale!r}")
        return jnp.float32(loss_scale)
    if isinstance(loss_scale, (jax.Array, np.ndarray)):
        if np.ndim(loss_scale) != 0:
            raise ValueError(f"loss_scale must be 0-d; got shape {np.shape(loss_scale)}")
        return jnp.asarray(loss_scale, jnp.float32)
    try:
        state = loss_scale_state(loss_scale)
    except (ValueError, TypeError):
        raise ValueError(
            "loss_scale must be a positive number, a 0-d array or a loss-scaler state; got "
            f"{type(loss_scale).__name__}"
        ) from None
    return jnp.asarray(state.loss_scale, jnp.float32)


@functools.partial(jax.jit, static_argnames="fmt")
def _leaf_range(leaf: jax.Array, scale: jax.Array, fmt: FloatFormat) -> GradientRange:
    if not jnp.issubdtype(leaf.dtype, jnp.floating):
        zero = jnp.zeros((), jnp.int32)
        return GradientRange(zero, zero, zero, zero, zero, zero, jnp.float32(jnp.inf))
    finite = jnp.isfinite(leaf)
    scaled = leaf.astype(jnp.float32) * scale
    rounded = fmt.round(scaled)
    nonzero = finite & (leaf != 0)

    def count(mask: jax.Array) -> jax.Array:
        return jnp.sum(mask, dtype=jnp.int32)

    largest = jnp.max(jnp.where(finite, jnp.abs(scaled), 0.0), initial=0.0)
    return GradientRange(
        size=jnp.asarray(leaf.size, jnp.int32),
        zeros=count(leaf == 0),
        underflows=count(nonzero & (rounded == 0)),
        subnormals=count(nonzero & (rounded != 0) & (jnp.abs(rounded) < fmt.min_normal)),
        overflows=count(finite & ~jnp.isfinite(rounded)),
        nonfinite=count(~finite),
        headroom=_headroom(largest, fmt),
    )


def _headroom(largest: jax.Array, fmt: FloatFormat) -> jax.Array:
    """The largest whole ``k`` with ``round(largest * 2**k)`` finite in ``fmt``, exactly.

    A value rounds to a finite number of the format iff it is below the midpoint between the
    largest value and the next power of two, ``(2 - 2**-(m+1)) * 2**emax`` (at the midpoint,
    round-to-nearest-even goes up). With ``largest = f * 2**e``, ``f`` in ``[1, 2)``,
    ``largest * 2**k`` is below it iff ``k < emax - e`` or ``k == emax - e`` and ``f`` is below
    ``2 - 2**-(m+1)``.
    """
    mantissa, exponent = jnp.frexp(
        largest
    )  # largest = mantissa * 2**exponent, mantissa in [0.5, 1)
    limit = 1.0 - math.ldexp(1.0, -(fmt.mantissa_bits + 2))  # the midpoint's mantissa, halved
    k = (fmt.emax + 1 - exponent) - jnp.where(mantissa < limit, 0, 1)
    k = k.astype(jnp.float32)
    k = jnp.where(largest == 0, jnp.inf, k)
    return jnp.where(jnp.isinf(largest), -jnp.inf, k)
