"""Spike skipping: skip a step whose gradient norm (or loss) is far above its recent values.

A finite step can still be a bad one: a corrupted batch, a rare token sequence, gradients
hundreds of times the usual. :class:`SpikeSkip` keeps the metric of the last ``window``
applied steps and skips a step whose metric exceeds their ``mean + sigma * std`` (once
``warmup`` steps have been applied). The decision reads numbers the overflow check has already
computed (the global norm) or the loss, and is branch-free: it costs a few scalar operations
and a write into a small ring buffer, in the same jitted step, with no host synchronisation.

A spike is not an overflow: the step is skipped (parameters and optimizer state unchanged),
and the loss scale and its counters are left as they were; it is counted in
``num_spike_skips``, and its metric does not enter the window.
"""

from __future__ import annotations

import dataclasses
import math
import numbers
from typing import Any, NamedTuple, cast

import jax
import jax.numpy as jnp

SPIKE_METRICS = ("grad_norm", "loss")
"""What :class:`SpikeSkip` can watch: the global gradient norm, or the loss.

Example:
    >>> import amp_core
    >>> amp_core.SPIKE_METRICS
    ('grad_norm', 'loss')
"""


@dataclasses.dataclass(frozen=True)
class SpikeSkip:
    """Skip steps whose metric is ``sigma`` standard deviations above the recent mean.

    A step is skipped when ``metric > mean + sigma * std`` of the metric over the last
    ``window`` applied steps (the sample standard deviation, ``n - 1``), once ``warmup`` steps
    have been applied. Steps that overflowed, and spikes, do not enter the window.

    Attributes:
        metric: ``"grad_norm"`` (the global L2 norm of the unscaled gradients, before
            clipping) or ``"loss"`` (the unscaled loss of the step, passed to the update).
        window: how many applied steps the mean and deviation are taken over (at least 2).
        sigma: how many standard deviations above the mean a spike starts (positive).
        warmup: applied steps before any step can be a spike (default: ``window``; at least 2).

    Example:
        >>> import amp_core
        >>> amp_core.SpikeSkip()
        SpikeSkip(metric='grad_norm', window=128, sigma=6.0, warmup=128)
        >>> amp_core.SpikeSkip(metric="loss", window=32, sigma=4.0).warmup
        32
    """

    metric: str = "grad_norm"
    window: int = 128
    sigma: float = 6.0
    warmup: int | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.metric, str) or self.metric not in SPIKE_METRICS:
            raise ValueError(f"metric must be one of {list(SPIKE_METRICS)}; got {self.metric!r}")
        window = _whole("window", self.window, minimum=2)
        sigma = self.sigma
        if isinstance(sigma, bool) or not isinstance(sigma, numbers.Real):
            raise TypeError(f"sigma must be a number; got {sigma!r} ({type(sigma).__name__})")
        if not (math.isfinite(float(sigma)) and float(sigma) > 0):
            raise ValueError(f"sigma must be a finite number > 0; got {sigma!r}")
        warmup = window if self.warmup is None else _whole("warmup", self.warmup, minimum=2)
        object.__setattr__(self, "window", window)
        object.__setattr__(self, "sigma", float(sigma))
        object.__setattr__(self, "warmup", warmup)


def _whole(name: str, value: Any, *, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{name} must be an integer; got {value!r} ({type(value).__name__})")
    number = float(value)
    if not number.is_integer():
        raise ValueError(f"{name} must be a whole number; got {value!r}")
    if not minimum <= number <= 2**30:
        raise ValueError(f"{name} must be an integer from {minimum} to 2**30; got {value!r}")
    return int(number)


class SpikeState(NamedTuple):
    """The window of recent metrics and the spike counters. All leaves are arrays.

    Attributes:
        values: the metric of the last ``window`` applied steps, a ring buffer (float32,
            ``[window]``; slot ``applied % window`` is written next).
        applied: steps applied since the start (int32, capped at ``2**30``).
        num_spike_skips: steps skipped as spikes in total (int32).
        spiked: whether the last step was skipped as a spike (bool).
        threshold: the ``mean + sigma * std`` the last step was compared with (float32;
            ``inf`` during warm-up).

    Example:
        >>> import amp_core
        >>> state = amp_core.init_spikes(amp_core.SpikeSkip(window=4))
        >>> state.values.shape, int(state.num_spike_skips), bool(state.spiked)
        ((4,), 0, False)
    """

    values: jax.Array
    applied: jax.Array
    num_spike_skips: jax.Array
    spiked: jax.Array
    threshold: jax.Array


def init_spikes(spike_skip: SpikeSkip) -> SpikeState:
    """The empty window of ``spike_skip``.

    Example:
        >>> import amp_core
        >>> int(amp_core.init_spikes(amp_core.SpikeSkip()).applied)
        0
    """
    return SpikeState(
        values=jnp.zeros((spike_skip.window,), jnp.float32),
        applied=jnp.zeros((), jnp.int32),
        num_spike_skips=jnp.zeros((), jnp.int32),
        spiked=jnp.zeros((), jnp.bool_),
        threshold=jnp.full((), jnp.inf, jnp.float32),
    )


def spike_threshold(spike_skip: SpikeSkip, spikes: SpikeState) -> jax.Array:
    """``mean + sigma * std`` of the window (float32, 0-d), or ``inf`` during warm-up.

    Example:
        >>> import amp_core, jax.numpy as jnp
        >>> cfg = amp_core.SpikeSkip(window=4, sigma=2.0)
        >>> spikes = amp_core.init_spikes(cfg)._replace(
        ...     values=jnp.array([1.0, 2.0, 3.0, 4.0]), applied=jnp.int32(4))
        >>> round(float(amp_core.spike_threshold(cfg, spikes)), 4)  # 2.5 + 2 * 1.291
        5.082
    """
    window = spike_skip.window
    filled = jnp.minimum(spikes.applied, window)
    mask = jnp.arange(window) < filled
    count = jnp.maximum(filled, 2).astype(jnp.float32)
    mean = jnp.sum(jnp.where(mask, spikes.values, 0.0)) / count
    deviation = jnp.where(mask, spikes.values - mean, 0.0)
    std = jnp.sqrt(jnp.sum(deviation * deviation) / (count - 1))
    ready = spikes.applied >= cast(int, spike_skip.warmup)  # resolved: never None
    return jnp.where(ready, mean + jnp.float32(spike_skip.sigma) * std, jnp.float32(jnp.inf))


def check_spike(
    spike_skip: SpikeSkip, spikes: SpikeState, metric: jax.typing.ArrayLike, isfinite: Any
) -> tuple[jax.Array, SpikeState]:
    """Decides whether this step is a spike, and records it; branch-free and jittable.

    Args:
        spike_skip: the configuration.
        spikes: the window before this step.
        metric: this step's metric (0-d).
        isfinite: whether the step's gradients are finite (an overflow is not a spike, and
            its metric does not enter the window).

    Returns:
        ``(spike, new_spikes)``: whether to skip the step as a spike, and the window after it
        (the metric recorded when the step is applied).

    Example:
        >>> import amp_core, jax.numpy as jnp
        >>> cfg = amp_core.SpikeSkip(window=4, warmup=4)
        >>> spikes = amp_core.init_spikes(cfg)
        >>> for norm in [1.0, 1.1, 0.9, 1.0, 50.0]:
        ...     spike, spikes = amp_core.check_spike(cfg, spikes, jnp.float32(norm), True)
        >>> bool(spike), int(spikes.num_spike_skips), int(spikes.applied)
        (True, 1, 4)
    """
    value = jnp.asarray(metric, jnp.float32)
    if value.shape != ():
        raise ValueError(f"metric must be a 0-d (scalar) value; got shape {value.shape}")
    finite = jnp.logical_and(jnp.asarray(isfinite, jnp.bool_), jnp.isfinite(value))
    threshold = spike_threshold(spike_skip, spikes)
    spike = jnp.logical_and(finite, value > threshold)
    record = jnp.logical_and(finite, jnp.logical_not(spike))
    slot = spikes.applied % spike_skip.window
    values = jnp.where(
        jnp.logical_and(record, jnp.arange(spike_skip.window) == slot), value, spikes.values
    )
    # Capped far beyond any run, so that the int32 count never wraps.
    applied = jnp.where(record, jnp.minimum(spikes.applied + 1, 2**30), spikes.applied)
    return spike, SpikeState(
        values=values,
        applied=applied.astype(jnp.int32),
        num_spike_skips=spikes.num_spike_skips + spike.astype(jnp.int32),
        spiked=spike,
        threshold=threshold,
    )
