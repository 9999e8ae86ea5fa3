"""Loss-scaling settings read from a DeepSpeed ``ds_config`` or Megatron's arguments.

:func:`from_deepspeed_config` and :func:`from_megatron_args` return the
:class:`~amp_core.DynamicLossScale` (or :class:`~amp_core.StaticLossScale`) that takes the same
decisions, step for step, as DeepSpeed's ``DynamicLossScaler`` (deepspeed 0.19.8, the scaler of
its ZeRO optimizers) and Megatron's ``DynamicGradScaler`` (megatron-core 0.16.1). The two
frameworks differ from each other, and from SPEC section 2, in three places, each a parameter
of :class:`~amp_core.DynamicLossScale`:

* **hysteresis**: both halve the scale at the ``hysteresis``-th overflow, not the first; the
  absorbed overflows are forgiven when the scale grows (and, with DeepSpeed's
  ``consecutive_hysteresis``, at every finite step), never when it halves.
* **growth**: DeepSpeed grows after ``loss_scale_window + 1`` finite steps after an overflow,
  then every ``loss_scale_window``; Megatron every ``loss_scale_window`` finite steps. Here:
  ``steps_per_increase = W, growth_interval = W`` and ``steps_per_increase = W - 1`` (whose
  default ``growth_interval`` is ``W``).
* **the minimum**: DeepSpeed raises when an overflow would halve a scale already at
  ``min_loss_scale``; Megatron keeps skipping. Here: ``stall_steps=1`` for DeepSpeed, so that
  :func:`amp_core.is_stalled` is true after that step (the torch door raises there).

Both skip a step whose gradients are not finite even with a fixed loss scale (DeepSpeed's fp16
``loss_scale > 0`` and bf16 with ``check_grad_overflow``, Megatron's ``--loss-scale``): that is a
:class:`~amp_core.DynamicLossScale` whose scale is pinned (``init_scale == min_loss_scale ==
max_loss_scale``). Neither has an upper bound: here it is ``2**127``
(:data:`UNBOUNDED_LOSS_SCALE`), the largest power of two in float32.

Each entry of the settings is checked; an unknown key, an ``"auto"`` left unresolved or a
combination with no meaning here is a ``ValueError`` naming the key.
"""

from __future__ import annotations

import argparse
import json
import math
import numbers
import os
from collections.abc import Mapping, Sequence
from typing import Any, NamedTuple, NoReturn

from amp_core.config import DynamicLossScale, LossScaleConfig, StaticLossScale
from hardware.half_dtypes import MIN_LOSS_SCALE_FLOOR

UNBOUNDED_LOSS_SCALE = 2.0**127
"""The ``max_loss_scale`` given to settings whose framework has no upper bound: ``2**127``.

Example:
    >>> import amp_core
    >>> amp_core.from_megatron_args({"fp16": True}).max_loss_scale == 2.0**127
    True
"""


class ImportedSettings(NamedTuple):
    """What :func:`deepspeed_settings` and :func:`megatron_settings` read.

    Attributes:
        config: the loss-scaling configuration.
        raise_on_stall: whether the framework stops the run once :func:`amp_core.is_stalled`
            (DeepSpeed's dynamic scaler raises at its minimum scale; Megatron's does not).
    """

    config: LossScaleConfig
    raise_on_stall: bool


# -- DeepSpeed ----------------------------------------------------------------------------------

_FP16_KEYS = (
    "enabled",
    "auto_cast",
    "loss_scale",
    "initial_scale_power",
    "loss_scale_window",
    "hysteresis",
    "consecutive_hysteresis",
    "min_loss_scale",
    "fp16_master_weights_and_grads",
)
"""DeepSpeed's ``fp16`` keys (``DeepSpeedFP16Config``); the last ones are not loss scaling."""

_BF16_KEYS = (
    "enabled",
    "check_grad_overflow",
    "immediate_grad_update",
    "bf16_master_weights_and_grads",
    "bf16_optimizer_states",
)
"""DeepSpeed's ``bf16`` keys (``DeepSpeedBF16Config``); the last three are not loss scaling."""

_DEEPSPEED_GRADIENT_CLIPPING_DEFAULT = 1.0
"""DeepSpeed's ``gradient_clipping`` when a whole ``ds_config`` does not set it."""


def from_deepspeed_config(config: Any, *, clip_in_scaler: bool = True) -> LossScaleConfig:
    """The loss-scaling configuration of a DeepSpeed ``ds_config``.

    ``config`` is the whole ``ds_config`` (a dict, or the path of its JSON file), whose
    ``fp16``, ``bf16`` (or ``bfloat16``) and ``gradient_clipping`` entries are read and whose
    other entries (ZeRO, optimizer, batch sizes) are not loss scaling and are left alone; or
    its ``fp16`` section alone (a dict whose keys are ``fp16`` keys), which sets no clipping.

    The keys, and what they set here:

    * ``fp16.enabled``: ``half_dtype="float16"``, a dynamic or a pinned scale;
    * ``fp16.loss_scale``: ``0`` dynamic scaling; ``S > 0`` the scale pinned at ``S``;
    * ``fp16.initial_scale_power``: ``init_scale = 2**p``;
    * ``fp16.loss_scale_window``: ``steps_per_increase = growth_interval = W``;
    * ``fp16.hysteresis``, ``fp16.consecutive_hysteresis``: the arguments of the same names;
    * ``fp16.min_loss_scale``: ``min_loss_scale``, with ``stall_steps=1`` (DeepSpeed raises
      when an overflow finds the scale there with no hysteresis left);
    * ``bf16.enabled``: ``half_dtype="bfloat16"``, the scale pinned at 1 (steps with non-finite
      gradients skipped, with ``bf16.check_grad_overflow``, DeepSpeed's default) or static 1;
    * ``gradient_clipping``: ``max_gradient_norm`` (``0``: none; DeepSpeed's default ``1.0``).

    DeepSpeed's defaults fill absent keys (``initial_scale_power=16``,
    ``loss_scale_window=1000``, ``hysteresis=2``, ``min_loss_scale=1``). ``auto_cast``,
    ``fp16_master_weights_and_grads`` and the bf16 keys other than ``enabled`` and
    ``check_grad_overflow`` are checked for being known and then left to the training loop.
    The ``"fp16": true`` that gpt-neox's configs repeat inside the fp16 section is accepted
    when it agrees with ``enabled``.

    Args:
        config: a ``ds_config`` mapping, its ``fp16`` section, or a path to its JSON file.
        clip_in_scaler: map ``gradient_clipping`` to the scaler's fused clipping (DLS + GCC).
            ``False`` leaves it out: the training loop clips (``optax.clip_by_global_norm``).
            A static scale cannot clip, so a static result with clipping needs ``False``.

    Returns:
        The configuration.

    Raises:
        TypeError: ``config`` is not a mapping or a path, or an entry has the wrong type.
        ValueError: an unknown key, an ``"auto"`` value, an out-of-range value, fp16 and bf16
            both enabled, or clipping with a static scale while ``clip_in_scaler``.
        FileNotFoundError: no file at the path.

    Example:
        >>> import amp_core
        >>> config = amp_core.from_deepspeed_config(
        ...     {"fp16": {"enabled": True, "hysteresis": 2, "loss_scale_window": 500},
        ...      "gradient_clipping": 1.0, "train_micro_batch_size_per_gpu": 8}
        ... )
        >>> config.init_scale, config.hysteresis, config.steps_per_increase, config.growth_interval
        (65536.0, 2, 500, 500)
        >>> config.max_gradient_norm, config.stall_steps
        (1.0, 1)
    """
    return deepspeed_settings(config, clip_in_scaler=clip_in_scaler).config


def deepspeed_settings(config: Any, *, clip_in_scaler: bool = True) -> ImportedSettings:
    """:func:`from_deepspeed_config`, and whether DeepSpeed raises once the run stalls."""
    _check_bool("clip_in_scaler", clip_in_scaler)
    whole = _load_json_config(config)
    fp16: Mapping[str, Any]
    bf16: Mapping[str, Any]
    clip_value: Any
    if _is_fp16_section(whole):
        fp16, bf16, clip_value = dict(whole), {}, 0.0
        prefix = ""
    else:
        fp16 = _section(whole, "fp16")
        bf16 = _section(whole, "bf16" if "bf16" in whole else "bfloat16")
        clip_value = whole.get("gradient_clipping", _DEEPSPEED_GRADIENT_CLIPPING_DEFAULT)
        prefix = "fp16."
    bf16_name = "bf16" if "bf16" in whole or "bfloat16" not in whole else "bfloat16"
    fp16 = _without_gpt_neox_flag(fp16, prefix)
    _check_keys(fp16, _FP16_KEYS, "fp16", prefix)
    _check_keys(bf16, _BF16_KEYS, "bf16", f"{bf16_name}.")
    if isinstance(clip_value, str) and clip_value == "auto":
        raise ValueError(_auto_message("gradient_clipping"))

    def key(name: str) -> str:
        return prefix + name

    fp16_enabled = _ds_bool(fp16, "enabled", False, key("enabled"))
    bf16_enabled = _ds_bool(bf16, "enabled", False, f"{bf16_name}.enabled")
    check_overflow = _ds_bool(bf16, "check_grad_overflow", True, f"{bf16_name}.check_grad_overflow")
    for name in ("auto_cast", "fp16_master_weights_and_grads", "consecutive_hysteresis"):
        _ds_bool(fp16, name, False, key(name))
    for name in ("immediate_grad_update", "bf16_master_weights_and_grads", "bf16_optimizer_states"):
        _ds_bool(bf16, name, False, f"{bf16_name}.{name}")
    loss_scale = _number(fp16.get("loss_scale", 0), key("loss_scale"), minimum=0.0)
    power = _whole(fp16.get("initial_scale_power", 16), key("initial_scale_power"), -14, 127)
    window = _whole(fp16.get("loss_scale_window", 1000), key("loss_scale_window"), 1)
    hysteresis = _whole(fp16.get("hysteresis", 2), key("hysteresis"), 1)
    min_scale = _number(fp16.get("min_loss_scale", 1), key("min_loss_scale"), minimum=0.0)
    clip = _number(clip_value, "gradient_clipping", minimum=0.0)
    if fp16_enabled and bf16_enabled:
        raise ValueError(
            f"{key('enabled')} and {bf16_name}.enabled are both true; DeepSpeed rejects this "
            "too (bfloat16 and fp16 modes cannot be simultaneously enabled)"
        )
    norm = clip if clip > 0 and clip_in_scaler else None
    if fp16_enabled and loss_scale == 0:
        _check_floor(min_scale, key("min_loss_scale"))
        dynamic = DynamicLossScale(
            init_scale=2.0**power,
            steps_per_increase=window,
            growth_interval=window,
            min_loss_scale=min_scale,
            max_loss_scale=UNBOUNDED_LOSS_SCALE,
            hysteresis=hysteresis,
            consecutive_hysteresis=bool(fp16.get("consecutive_hysteresis", False)),
            max_gradient_norm=norm,
            half_dtype="float16",
            stall_steps=1,
        )
        return ImportedSettings(dynamic, raise_on_stall=True)
    if fp16_enabled:
        return ImportedSettings(_pinned(loss_scale, key("loss_scale"), norm, "float16"), False)
    if bf16_enabled and check_overflow:
        return ImportedSettings(_pinned(1.0, f"{bf16_name}.enabled", norm, "bfloat16"), False)
    _no_static_clipping(norm, "gradient_clipping", clip, "clip_in_scaler=False")
    return ImportedSettings(StaticLossScale(1.0), False)


def _load_json_config(config: Any) -> Mapping[str, Any]:
    if isinstance(config, (str, os.PathLike)):
        path = os.fspath(config)
        with open(path, encoding="utf-8") as file:
            try:
                loaded = json.load(file)
            except json.JSONDecodeError as err:
                raise ValueError(f"config: {path} is not valid JSON: {err}") from err
        if not isinstance(loaded, dict):
            raise TypeError(f"config: {path} must hold a JSON object; got {type(loaded).__name__}")
        return loaded
    if not isinstance(config, Mapping):
        raise TypeError(
            "config must be a ds_config mapping, its fp16 section, or the path of a JSON file; "
            f"got {type(config).__name__}"
        )
    return config


def _is_fp16_section(config: Mapping[str, Any]) -> bool:
    """Whether ``config`` is an fp16 section: fp16 keys, and no section of a whole config."""
    sections = [config.get(name) for name in ("fp16", "bf16", "bfloat16")]
    has_section = any(isinstance(value, (Mapping, str)) for value in sections)
    return not has_section and bool(set(config) & set(_FP16_KEYS))


def _section(config: Mapping[str, Any], name: str) -> Mapping[str, Any]:
    section = config.get(name, {})
    if isinstance(section, str) and section == "auto":
        raise ValueError(_auto_message(name))
    if not isinstance(section, Mapping):
        raise TypeError(f"{name} must be a mapping (a JSON object); got {section!r}")
    return section


def _check_keys(section: Mapping[str, Any], known: tuple[str, ...], kind: str, prefix: str) -> None:
    for name in section:
        if name not in known:
            raise ValueError(
                f"{prefix}{name} is not a key of DeepSpeed's {kind} section; expected one of "
                f"{list(known)}"
            )
        if isinstance(section[name], str) and section[name] == "auto":
            raise ValueError(_auto_message(prefix + name))


def _without_gpt_neox_flag(fp16: Mapping[str, Any], prefix: str) -> Mapping[str, Any]:
    """The fp16 section without the ``"fp16": true`` that gpt-neox's configs repeat in it.

    gpt-neox (through its DeeperSpeed fork) accepts it; DeepSpeed's own ``fp16`` model does
    not. Here it is accepted when it agrees with ``enabled``.
    """
    if "fp16" not in fp16:
        return fp16
    flag = fp16["fp16"]
    if not isinstance(flag, bool):
        raise TypeError(f"{prefix}fp16 (gpt-neox's flag) must be true or false; got {flag!r}")
    rest = {k: v for k, v in fp16.items() if k != "fp16"}
    if flag != rest.get("enabled", flag):
        raise ValueError(
            f"{prefix}fp16={flag} (gpt-neox's flag) disagrees with {prefix}enabled="
            f"{rest['enabled']!r}"
        )
    rest.setdefault("enabled", flag)
    return rest


def _auto_message(key: str) -> str:
    return (
        f'{key} is "auto": it has no value until a launcher resolves it (the Hugging Face '
        "Trainer fills the autos from its TrainingArguments at start-up). Pass the resolved "
        "config (after the Trainer or accelerate has filled it in), or write the value"
    )


def _ds_bool(section: Mapping[str, Any], name: str, default: bool, key: str) -> bool:
    value = section.get(name, default)
    if not isinstance(value, bool):
        raise TypeError(f"{key} must be true or false; got {value!r}")
    return value


# -- Megatron -------------------------------------------------------------------------------------

_MEGATRON_DEFAULTS: dict[str, Any] = {
    "fp16": False,
    "bf16": False,
    "loss_scale": None,
    "initial_loss_scale": 2.0**32,
    "min_loss_scale": 1.0,
    "loss_scale_window": 1000,
    "hysteresis": 2,
    "clip_grad": 1.0,
}
"""Megatron's argument defaults (megatron-core's ``OptimizerConfig``; Megatron-LM's flags)."""


def from_megatron_args(args: Any, *, clip_in_scaler: bool = True) -> LossScaleConfig:
    """The loss-scaling configuration of Megatron's arguments.

    ``args`` is Megatron's ``argparse.Namespace`` (or megatron-core's ``OptimizerConfig``, or
    any object or mapping with the same names), of which ``fp16``, ``bf16``, ``loss_scale``,
    ``initial_loss_scale``, ``min_loss_scale``, ``loss_scale_window``, ``hysteresis`` and
    ``clip_grad`` are read (absent ones take Megatron's defaults); or a list of command-line
    flags (``["--fp16", "--hysteresis", "4"]``), of which the others are left alone.

    The flags, and what they set here:

    * ``--fp16``: dynamic scaling, ``half_dtype="float16"``;
    * ``--bf16``: a static scale of 1 (Megatron does not check bf16 gradients for overflow);
    * ``--loss-scale S``: the scale pinned at ``S`` (Megatron still skips non-finite steps);
    * ``--initial-loss-scale``: ``init_scale`` (default ``2**32``);
    * ``--min-loss-scale``: ``min_loss_scale`` (default ``1``);
    * ``--loss-scale-window W``: ``steps_per_increase = W - 1`` (default 1000);
    * ``--hysteresis``: ``hysteresis`` (default 2);
    * ``--clip-grad``: ``max_gradient_norm`` (default ``1.0``; ``0``: none).

    Args:
        args: Megatron's arguments, as above.
        clip_in_scaler: map ``--clip-grad`` to the scaler's fused clipping (DLS + GCC).
            ``False`` leaves it out: the training loop clips. A static scale cannot clip, so
            bf16 or fp32 with ``--clip-grad`` (default 1.0) needs ``False``.

    Returns:
        The configuration.

    Raises:
        TypeError: ``args`` is none of the above, or a value has the wrong type.
        ValueError: an unknown loss-scaling flag, an out-of-range value, ``--fp16`` with
            ``--bf16``, ``--loss-scale`` without either, a ``--loss-scale-window`` below 2, or
            clipping with a static scale while ``clip_in_scaler``.

    Example:
        >>> import amp_core
        >>> config = amp_core.from_megatron_args(["--fp16", "--loss-scale-window", "500"])
        >>> config.init_scale, config.hysteresis, config.steps_per_increase, config.growth_interval
        (4294967296.0, 2, 499, 500)
        >>> amp_core.from_megatron_args({"bf16": True}, clip_in_scaler=False)
        StaticLossScale(loss_scale=1.0)
    """
    return megatron_settings(args, clip_in_scaler=clip_in_scaler).config


def megatron_settings(args: Any, *, clip_in_scaler: bool = True) -> ImportedSettings:
    """:func:`from_megatron_args`, as :class:`ImportedSettings` (Megatron never raises)."""
    _check_bool("clip_in_scaler", clip_in_scaler)
    values = _megatron_values(args)
    fp16 = _megatron_bool(values, "fp16")
    bf16 = _megatron_bool(values, "bf16")
    if fp16 and bf16:
        raise ValueError("--fp16 and --bf16 are both set; Megatron allows one of them")
    loss_scale = values["loss_scale"]
    initial = _number(values["initial_loss_scale"], "--initial-loss-scale", minimum=0.0)
    min_scale = _number(values["min_loss_scale"], "--min-loss-scale", minimum=0.0)
    window = _whole(values["loss_scale_window"], "--loss-scale-window", 1)
    hysteresis = _whole(values["hysteresis"], "--hysteresis", 1)
    clip = _number(values["clip_grad"], "--clip-grad", minimum=0.0)
    norm = clip if clip > 0 and clip_in_scaler else None
    half = "bfloat16" if bf16 else "float16"
    if loss_scale is not None and _number(loss_scale, "--loss-scale", minimum=0.0) != 0:
        if not (fp16 or bf16):
            raise ValueError(
                f"--loss-scale={loss_scale!r} needs --fp16 or --bf16: Megatron's fp32 optimizer "
                "does not scale the loss"
            )
        return ImportedSettings(_pinned(float(loss_scale), "--loss-scale", norm, half), False)
    if fp16:
        _check_floor(min_scale, "--min-loss-scale")
        if min_scale > initial:
            raise ValueError(
                f"--min-loss-scale={min_scale!r} must not exceed --initial-loss-scale="
                f"{initial!r} (Megatron asserts this too)"
            )
        if window < 2:
            raise ValueError(
                "--loss-scale-window must be at least 2 here (a growth after every finite step "
                f"is steps_per_increase=0, which SPEC section 1 rejects); got {window}"
            )
        dynamic = DynamicLossScale(
            init_scale=initial,
            steps_per_increase=window - 1,
            min_loss_scale=min_scale,
            max_loss_scale=UNBOUNDED_LOSS_SCALE,
            hysteresis=hysteresis,
            max_gradient_norm=norm,
            half_dtype="float16",
        )
        return ImportedSettings(dynamic, raise_on_stall=False)
    _no_static_clipping(norm, "--clip-grad", clip, "clip_in_scaler=False")
    return ImportedSettings(StaticLossScale(1.0), False)


_MEGATRON_WORDS = ("loss_scale", "hysteresis", "clip_grad")
"""Parts of a name that say it is about loss scaling: such a name must be a known one."""


def _megatron_values(args: Any) -> dict[str, Any]:
    if isinstance(args, (str, bytes)):
        raise TypeError(
            "args must be Megatron's argparse.Namespace, a mapping, or a list of flags; got a "
            f"string {args!r} (split it into a list: shlex.split)"
        )
    if isinstance(args, Sequence):
        return _parse_megatron_flags(list(args))
    if isinstance(args, Mapping):
        given = dict(args)
    elif hasattr(args, "__dict__"):
        given = {k: v for k, v in vars(args).items() if not k.startswith("_")}
    else:
        raise TypeError(
            "args must be Megatron's argparse.Namespace (or OptimizerConfig), a mapping, or a "
            f"list of flags; got {type(args).__name__}"
        )
    for name in given:
        if not isinstance(name, str):
            raise TypeError(f"args has a key {name!r} that is not a string")
        if name not in _MEGATRON_DEFAULTS and any(w in name for w in _MEGATRON_WORDS):
            raise ValueError(
                f"args.{name} is not a loss-scaling argument Megatron has; expected one of "
                f"{sorted(n for n in _MEGATRON_DEFAULTS)}"
            )
    return {name: given.get(name, default) for name, default in _MEGATRON_DEFAULTS.items()}


class _FlagParser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:  # argparse would exit the process
        raise ValueError(f"args: {message}")


def _parse_megatron_flags(flags: list[Any]) -> dict[str, Any]:
    for flag in flags:
        if not isinstance(flag, str):
            raise TypeError(f"args must be a list of strings (command-line flags); got {flag!r}")
    parser = _FlagParser(add_help=False, allow_abbrev=False)
    parser.add_argument("--fp16", action="store_true")
    parser.add_argument("--bf16", action="store_true")
    parser.add_argument("--loss-scale", type=float, default=None)
    for name in ("initial_loss_scale", "min_loss_scale", "loss_scale_window", "clip_grad"):
        parser.add_argument("--" + name.replace("_", "-"), type=float)
    parser.add_argument("--hysteresis", type=int)
    parsed, rest = parser.parse_known_args(flags)
    for flag in rest:
        name = flag.split("=", 1)[0]
        if name.startswith("--") and any(w in name[2:].replace("-", "_") for w in _MEGATRON_WORDS):
            raise ValueError(f"args: {name} is not a loss-scaling flag Megatron has")
    given = {k: v for k, v in vars(parsed).items() if v is not None}
    return {name: given.get(name, default) for name, default in _MEGATRON_DEFAULTS.items()}


def _megatron_bool(values: Mapping[str, Any], name: str) -> bool:
    value = values[name]
    if not isinstance(value, bool):
        raise TypeError(f"--{name} must be a bool; got {value!r}")
    return value


# -- shared ---------------------------------------------------------------------------------------


def _pinned(scale: float, key: str, norm: float | None, half_dtype: str) -> DynamicLossScale:
    """A fixed scale that still skips non-finite steps: dynamic, with the bounds at the scale."""
    _check_floor(scale, key)
    return DynamicLossScale(
        init_scale=scale,
        min_loss_scale=scale,
        max_loss_scale=scale,
        max_gradient_norm=norm,
        half_dtype=half_dtype,
    )


def _no_static_clipping(norm: float | None, key: str, value: float, how: str) -> None:
    if norm is not None:
        raise ValueError(
            f"{key}={value!r} asks for gradient clipping, but these settings give a static loss "
            "scale, which never reads the gradients and so cannot clip them. Pass "
            f"{how} and clip in the training loop (cstorch.amp.optimizer_step(..., "
            f"max_gradient_norm={value!r}) or optax.clip_by_global_norm({value!r}))"
        )


def _check_floor(value: float, key: str) -> None:
    if value < MIN_LOSS_SCALE_FLOOR:
        raise ValueError(
            f"{key}={value!r} is below the smallest loss scale here, 2**-14 = "
            f"{MIN_LOSS_SCALE_FLOOR!r} (SPEC section 1)"
        )


def _check_bool(name: str, value: Any) -> None:
    if not isinstance(value, bool):
        raise TypeError(f"{name} must be a bool; got {value!r} ({type(value).__name__})")


def _number(value: Any, key: str, *, minimum: float) -> float:
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{key} must be a number; got {value!r} ({type(value).__name__})")
    number = float(value)
    if not math.isfinite(number) or number < minimum:
        raise ValueError(f"{key} must be a finite number >= {minimum:g}; got {value!r}")
    return number


def _whole(value: Any, key: str, minimum: int, maximum: int | None = None) -> int:
    number = _number(value, key, minimum=float(minimum))
    if not number.is_integer():
        raise ValueError(f"{key} must be a whole number; got {value!r}")
    if maximum is not None and number > maximum:
        raise ValueError(f"{key} must be at most {maximum}; got {value!r}")
    return int(number)
