"""The loss-scaling state: a NamedTuple pytree of arrays, created by :func:`init`."""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any, NamedTuple, cast

import jax
import jax.numpy as jnp
import numpy as np

from amp_core.config import DynamicLossScale, LossScaleConfig, positive_finite, real_number

COUNTER_DTYPE = jnp.int32
"""Integer dtype of the step counters inside JAX (``state_dict`` returns Python ints)."""


def _read_only_zero() -> np.ndarray:
    zero = np.zeros((), np.dtype(COUNTER_DTYPE))
    zero.flags.writeable = False
    return zero


_READ_ONLY_ZERO = _read_only_zero()


class LossScaleState(NamedTuple):
    """Everything that changes from step to step. All leaves are arrays.

    Attributes:
        loss_scale: the current loss scale (float32, 0-d).
        non_clamped_scale: the scale after the max clamp and before the min clamp of the last
            update (float32, 0-d).
        steps_since_rescale: updates since the scale last changed (int32, 0-d).
        overflows_since_rescale: overflowed steps since the scale last changed (int32, 0-d).
        num_skipped_steps: steps skipped for overflow in total (int32, 0-d).
        isfinite: whether the last updated step was finite (bool, 0-d; ``True`` before any step).
        global_norm: the global L2 norm of the last updated step's unscaled gradients
            (float32, 0-d; ``0`` before any step or when it was not supplied).
        overflows_at_min_scale: consecutive overflowed steps taken at ``min_loss_scale``
            (int32, 0-d; a finite step resets it). A run whose count keeps growing cannot
            progress: see :func:`amp_core.is_stalled`.
        absorbed_overflows: overflows that hysteresis let pass without halving the scale since
            it was last restored (int32, 0-d; from ``0`` to ``hysteresis - 1``; always ``0``
            when ``hysteresis`` is 1). DeepSpeed's ``cur_hysteresis`` is
            ``hysteresis - absorbed_overflows``.

    Example:
        >>> import amp_core
        >>> state = amp_core.init(amp_core.DynamicLossScale())
        >>> state.loss_scale.dtype, state.num_skipped_steps.dtype, bool(state.isfinite)
        (dtype('float32'), dtype('int32'), True)
        >>> float(state._replace(loss_scale=state.loss_scale / 2).loss_scale)  # a pytree of arrays
        16384.0
    """

    loss_scale: jax.Array
    non_clamped_scale: jax.Array
    steps_since_rescale: jax.Array
    overflows_since_rescale: jax.Array
    num_skipped_steps: jax.Array
    isfinite: jax.Array
    global_norm: jax.Array
    overflows_at_min_scale: jax.Array
    # A default, so that states built or pickled before the field existed (eight leaves) load.
    absorbed_overflows: jax.Array = cast(jax.Array, _READ_ONLY_ZERO)


def init(config: LossScaleConfig) -> LossScaleState:
    """Creates the initial state for ``config`` (SPEC section 1).

    Dynamic: ``loss_scale = min(max_loss_scale, init_scale)`` and zero counters. Static: the
    static scale and zero counters.

    Example:
        >>> import amp_core
        >>> state = amp_core.init(amp_core.DynamicLossScale(init_scale=2.0**20))
        >>> float(state.loss_scale)  # clamped to the float16 max_loss_scale default
        32768.0
    """
    # Every leaf its own buffer, so that the state can be donated to a jitted step.
    return jax.tree_util.tree_map(jnp.asarray, init_on_host(config))


def init_on_host(config: LossScaleConfig) -> LossScaleState:
    """The initial state of :func:`init` as NumPy 0-d arrays, without starting a JAX backend.

    For callers that must not initialize JAX's backends yet (on a GPU they claim device memory):
    the torch facade holds this until its first decision, then puts it on the gradients'
    device with ``jax.device_put``. Every function here accepts it as a state.

    Example:
        >>> import amp_core
        >>> state = amp_core.init_on_host(amp_core.DynamicLossScale())
        >>> type(state.loss_scale).__name__, float(state.loss_scale)
        ('ndarray', 32768.0)
    """
    if isinstance(config, DynamicLossScale):
        # Resolved in __post_init__: never None on an instance.
        scale = min(cast(float, config.max_loss_scale), cast(float, config.init_scale))
    else:
        scale = config.loss_scale
    counter = np.dtype(COUNTER_DTYPE)
    leaves = (
        np.full((), scale, np.float32),  # loss_scale
        np.full((), scale, np.float32),  # non_clamped_scale
        np.zeros((), counter),  # steps_since_rescale
        np.zeros((), counter),  # overflows_since_rescale
        np.zeros((), counter),  # num_skipped_steps
        np.ones((), np.bool_),  # isfinite
        np.zeros((), np.float32),  # global_norm
        np.zeros((), counter),  # overflows_at_min_scale
        np.zeros((), counter),  # absorbed_overflows
    )
    # NumPy leaves stand in for jax.Array: every function here accepts them.
    return LossScaleState(*(cast(jax.Array, leaf) for leaf in leaves))


_DYNAMIC_KEYS = (
    "loss_scale",
    "steps_since_rescale",
    "overflows_since_rescale",
    "num_skipped_steps",
    "overflows_at_min_scale",
)
_HYSTERESIS_KEYS = (*_DYNAMIC_KEYS, "absorbed_overflows")
_STATIC_KEYS = ("loss_scale",)


def state_dict_keys(config: LossScaleConfig) -> tuple[str, ...]:
    """The checkpoint keys of ``config``'s kind (SPEC section 9).

    Dynamic scaling adds ``overflows_at_min_scale`` to the reference's four keys, so that a
    resumed run keeps counting a stall, and with ``hysteresis > 1`` ``absorbed_overflows``, so
    that it resumes with the same strikes left; checkpoints without them still load (the
    counters then keep their values: zero in a new scaler).

    Example:
        >>> import amp_core
        >>> amp_core.state_dict_keys(amp_core.StaticLossScale(8.0))
        ('loss_scale',)
        >>> amp_core.state_dict_keys(amp_core.DynamicLossScale())[-1]
        'overflows_at_min_scale'
        >>> amp_core.state_dict_keys(amp_core.DynamicLossScale(hysteresis=2))[-1]
        'absorbed_overflows'
    """
    if isinstance(config, DynamicLossScale):
        return _HYSTERESIS_KEYS if config.has_hysteresis else _DYNAMIC_KEYS
    return _STATIC_KEYS


def to_state_dict(config: LossScaleConfig, state: LossScaleState) -> dict[str, float | int]:
    """Returns the cstorch checkpoint dictionary as Python numbers (a host synchronisation).

    Dynamic: ``loss_scale``, ``steps_since_rescale``, ``overflows_since_rescale``,
    ``num_skipped_steps`` and ``overflows_at_min_scale`` (and ``absorbed_overflows`` with
    ``hysteresis > 1``); static: ``loss_scale``.

    Example:
        >>> import amp_core
        >>> cfg = amp_core.DynamicLossScale()
        >>> amp_core.to_state_dict(cfg, amp_core.init(cfg))["loss_scale"]
        32768.0
    """
    host = jax.device_get(state)  # one transfer, not one per field
    result: dict[str, float | int] = {"loss_scale": float(host.loss_scale)}
    for key in state_dict_keys(config)[1:]:
        result[key] = int(getattr(host, key))
    return result


def from_state_dict(
    config: LossScaleConfig, state: LossScaleState, state_dict: Mapping[str, Any]
) -> LossScaleState:
    """Loads the keys present in ``state_dict`` into ``state``; absent keys keep their values.

    Values may be Python numbers, numpy or JAX scalars, or 0-d tensors. Loading ``loss_scale``
    also sets the non-clamped scale to it. A state of NumPy arrays (:func:`init_on_host`) stays
    one: no JAX backend is started.

    Raises:
        TypeError: ``state_dict`` is not a mapping, or a value is not a number.
        ValueError: an unknown key, a non-positive or non-finite scale, or a negative or
            fractional counter.

    Example:
        >>> import amp_core
        >>> cfg = amp_core.DynamicLossScale()
        >>> s = amp_core.from_state_dict(cfg, amp_core.init(cfg), {"loss_scale": 8.0})
        >>> float(s.loss_scale), int(s.steps_since_rescale)
        (8.0, 0)
    """
    if not isinstance(state_dict, Mapping):
        raise TypeError(f"state_dict must be a mapping; got {type(state_dict).__name__}")
    allowed = state_dict_keys(config)
    unknown = sorted(set(state_dict) - set(allowed))
    if unknown:
        kind = "dynamic" if config.is_dynamic else "static"
        raise ValueError(
            f"state_dict has keys {unknown} that a {kind} loss scaler does not have; "
            f"expected a subset of {list(allowed)}"
        )
    array = np.asarray if isinstance(state.loss_scale, np.ndarray) else jnp.asarray
    updates: dict[str, Any] = {}
    if "loss_scale" in state_dict:
        scale = positive_finite("state_dict['loss_scale']", state_dict["loss_scale"])
        updates["loss_scale"] = updates["non_clamped_scale"] = array(scale, np.float32)
    for key in allowed[1:]:
        if key in state_dict:
            updates[key] = array(_checkpoint_count(key, state_dict[key]), COUNTER_DTYPE)
    if "absorbed_overflows" in updates and isinstance(config, DynamicLossScale):
        absorbed = int(updates["absorbed_overflows"])
        if absorbed >= config.hysteresis:
            raise ValueError(
                f"state_dict['absorbed_overflows'] must be less than hysteresis="
                f"{config.hysteresis}; got {absorbed}"
            )
    return state._replace(**updates)


def _checkpoint_count(key: str, value: Any) -> int:
    number = real_number(f"state_dict[{key!r}]", value)
    if not (math.isfinite(number) and number >= 0 and number.is_integer()):
        raise ValueError(f"state_dict[{key!r}] must be a non-negative integer; got {value!r}")
    if number > jnp.iinfo(COUNTER_DTYPE).max:
        raise ValueError(f"state_dict[{key!r}] = {value!r} does not fit in a 32-bit counter")
    return int(number)
