"""``torch.amp.GradScaler`` checkpoints for ``GradScaler.load_state_dict``.

ModelZoo on GPUs trains with ``torch.amp.GradScaler`` and saves its ``state_dict()`` under
``"grad_scaler"``: ``scale``, ``growth_factor``, ``backoff_factor``, ``growth_interval`` and
``_growth_tracker``. A run moved to ``cstorch.amp`` keeps the scale: it becomes
``loss_scale``. The rest is not taken over, and a warning says so: the growth factors and
interval are configuration (dynamic loss scaling here doubles and halves, every
``steps_per_increase + 1`` steps), and ``_growth_tracker`` counts something else (torch's
consecutive finite steps since its last growth, where ``steps_since_rescale`` counts every
step since the last rescale, overflowed ones too), so the counters start from zero.

Only the conversion is here; validating and loading the values is ``amp_core``'s.
"""

from __future__ import annotations

import warnings
from collections.abc import Mapping
from typing import Any, cast

import amp_core
from amp_core.config import positive_finite
from torch_facade.amp import _caller

TORCH_KEYS = ("scale", "growth_factor", "backoff_factor", "growth_interval", "_growth_tracker")
"""The keys of ``torch.amp.GradScaler.state_dict()`` (of an enabled scaler)."""

_TORCH_DEFAULTS = {"growth_factor": 2.0, "backoff_factor": 0.5}
"""What dynamic loss scaling here always multiplies by: double, and halve."""


def is_torch_format(state_dict: Mapping[Any, Any]) -> bool:
    """Whether ``state_dict`` has any of ``torch.amp.GradScaler``'s keys.

    Example:
        >>> from torch_facade.amp._torch_checkpoint import is_torch_format
        >>> is_torch_format({"scale": 1024.0, "_growth_tracker": 3}), is_torch_format({})
        (True, False)
    """
    return any(key in TORCH_KEYS for key in state_dict)


def _keys(keys: Any) -> list[Any]:
    return sorted(keys, key=str)


def _not_taken_over(state_dict: Mapping[Any, Any], config: amp_core.LossScaleConfig) -> list[str]:
    """What of a torch checkpoint this scaler does not take over, and why, one entry each."""
    tracker = state_dict.get("_growth_tracker")
    if not isinstance(config, amp_core.DynamicLossScale):
        others = [k for k in TORCH_KEYS if k != "scale" and k in state_dict]
        return [f"{', '.join(others)} (a static loss scale never changes)"] if others else []
    steps_per_increase = cast(int, config.steps_per_increase)  # resolved: never None
    entries = []
    if tracker is not None:
        entries.append(
            f"_growth_tracker={tracker!r} (torch's count of consecutive finite steps since its "
            "last growth; steps_since_rescale and overflows_since_rescale start from 0, so the "
            f"next growth comes after steps_per_increase + 1 = {steps_per_increase + 1} "
            "steps)"
        )
    interval = state_dict.get("growth_interval")
    if interval is not None and interval != steps_per_increase:
        entries.append(
            f"growth_interval={interval!r} (this scaler keeps steps_per_increase="
            f"{steps_per_increase}: pass GradScaler(steps_per_increase=...) to change it)"
        )
    for key, fixed in _TORCH_DEFAULTS.items():
        value = state_dict.get(key)
        if value is not None and value != fixed:
            entries.append(
                f"{key}={value!r} (dynamic loss scaling here always multiplies by {fixed})"
            )
    return entries


def to_facade_format(
    state_dict: Mapping[Any, Any], config: amp_core.LossScaleConfig
) -> Mapping[Any, Any]:
    """``state_dict`` in this scaler's format: a torch checkpoint converted (with a warning),
    anything else unchanged (``amp_core`` validates it, and rejects keys it does not know).

    Args:
        state_dict: what ``GradScaler.load_state_dict`` was given.
        config: the loading scaler's configuration.

    Returns:
        ``{"loss_scale": scale}`` for a torch checkpoint; else ``state_dict`` itself.

    Raises:
        ValueError: a torch checkpoint without ``scale``, or with keys of neither format, or
            one that mixes torch's keys with this scaler's.

    Example:
        >>> import warnings, amp_core
        >>> from torch_facade.amp._torch_checkpoint import to_facade_format
        >>> config = amp_core.DynamicLossScale()
        >>> with warnings.catch_warnings(record=True) as caught:
        ...     warnings.simplefilter("always")
        ...     converted = to_facade_format({"scale": 1024.0, "_growth_tracker": 5}, config)
        >>> converted, "_growth_tracker=5" in str(caught[0].message)
        ({'loss_scale': 1024.0}, True)
    """
    if not isinstance(state_dict, Mapping) or not is_torch_format(state_dict):
        return state_dict
    own = set(amp_core.state_dict_keys(config))
    ours = _keys(k for k in state_dict if k in own)
    if ours:
        theirs = _keys(k for k in state_dict if k in TORCH_KEYS)
        raise ValueError(
            f"state_dict mixes torch.amp.GradScaler keys {theirs} with this GradScaler's keys "
            f"{ours}; expected one format: a subset of {sorted(own)}, or torch's "
            f"{list(TORCH_KEYS)}"
        )
    neither = _keys(k for k in state_dict if k not in TORCH_KEYS)
    if neither:
        raise ValueError(
            f"state_dict has keys {neither} that neither a torch.amp.GradScaler checkpoint "
            f"{list(TORCH_KEYS)} nor this GradScaler's {sorted(own)} has"
        )
    if "scale" not in state_dict:
        raise ValueError(
            "state_dict looks like a torch.amp.GradScaler checkpoint but has no 'scale'; got "
            f"keys {_keys(state_dict)}"
        )
    positive_finite("state_dict['scale']", state_dict["scale"])  # before saying it is taken
    skipped = _not_taken_over(state_dict, config)
    warnings.warn(
        "GradScaler.load_state_dict: loading a torch.amp.GradScaler checkpoint; its scale "
        f"{state_dict['scale']!r} becomes loss_scale."
        + (f" Not taken over: {'; '.join(skipped)}." if skipped else ""),
        UserWarning,
        stacklevel=_caller.stacklevel(),
    )
    return {"loss_scale": state_dict["scale"]}
