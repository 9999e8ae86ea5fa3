"""``cstorch.amp``'s precision settings: the half dtype, the mixed-precision switch, autocast.

The process-wide settings of SPEC section 6 (the record itself is
:mod:`torch_facade.amp._half_state`). Public: the names in ``__all__``, re-exported as
``cstorch.amp.*``. Internal, for the facade's own modules (no stability promise):
:func:`autocast_off`, :func:`autocast_device_types`, :func:`casts_disabled` and
:func:`are_casts_disabled`.
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Iterator
from typing import Any

import torch

from hardware.half_dtypes import HALF_DTYPES
from torch_facade.amp._half_state import STATE
from torch_facade.amp._host_side import host_side

_PROXY_DTYPES: dict[str, torch.dtype] = {
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    # No framework has a cbfloat16 dtype: models hold it in float16 as a proxy (as on CSX, where
    # the compiler converts the proxy to the real format).
    "cbfloat16": torch.float16,
}

__all__ = [
    "autocast",
    "enable_mixed_precision",
    "get_floating_point_dtype",
    "get_floating_point_dtype_str",
    "get_half_dtype",
    "get_half_dtype_str",
    "is_cbfloat16_tensor",
    "mixed_precision",
    "set_half_dtype",
]


def _half_dtype_name(value: Any) -> str:
    if isinstance(value, str) and value in HALF_DTYPES:
        return value
    if value is torch.float16:
        return "float16"
    if value is torch.bfloat16:
        return "bfloat16"
    raise ValueError(
        f"value must be one of {', '.join(repr(n) for n in HALF_DTYPES)}, torch.float16 or "
        f"torch.bfloat16; got {value!r}"
    )


@host_side
def set_half_dtype(value: str | torch.dtype) -> torch.dtype:
    """Sets the 16-bit floating point dtype of mixed precision, and enables mixed precision.

    Args:
        value: ``"float16"``, ``"bfloat16"``, ``"cbfloat16"``, ``torch.float16`` or
            ``torch.bfloat16``.

    Returns:
        The torch dtype to build the model in: the dtype itself for float16 and bfloat16, and
        ``torch.float16`` as a *proxy* for cbfloat16, which torch cannot represent. Use
        :func:`torch_facade.amp.cbfloat16_numerics` to see real cbfloat16 rounding.

    Raises:
        ValueError: any other value.

    Example:
        >>> import torch_facade as cstorch
        >>> cstorch.amp.set_half_dtype("cbfloat16")
        torch.float16
        >>> cstorch.amp.get_half_dtype_str()
        'cbfloat16'
        >>> _ = cstorch.amp.set_half_dtype("float16"); _ = cstorch.amp.enable_mixed_precision(False)
    """
    name = _half_dtype_name(value)
    STATE.half_dtype = name
    STATE.enabled = True
    STATE.proxy_autocast_seen = False  # a new setting starts a new record (cbfloat16 notice)
    return _PROXY_DTYPES[name]


def get_half_dtype() -> torch.dtype:
    """The torch dtype of the half dtype in force (``torch.float16`` proxies cbfloat16).

    Example:
        >>> import torch_facade as cstorch
        >>> cstorch.amp.get_half_dtype()
        torch.float16
    """
    return _PROXY_DTYPES[STATE.half_dtype]


def get_half_dtype_str() -> str:
    """The name of the half dtype in force: ``"float16"``, ``"bfloat16"`` or ``"cbfloat16"``.

    Example:
        >>> import torch_facade as cstorch
        >>> cstorch.amp.get_half_dtype_str()
        'float16'
    """
    return STATE.half_dtype


@host_side
def enable_mixed_precision(enable: bool = True) -> bool:
    """Switches mixed precision on or off (the half dtype is kept), as the reference does.

    Args:
        enable: ``True`` to enable mixed precision, ``False`` to disable it.

    Returns:
        The new setting (what :func:`mixed_precision` now returns).

    Raises:
        TypeError: ``enable`` is not a bool.

    Example:
        >>> import torch_facade as cstorch
        >>> cstorch.amp.enable_mixed_precision(True)
        True
        >>> cstorch.amp.enable_mixed_precision(False)
        False
    """
    if not isinstance(enable, bool):
        raise TypeError(f"enable must be a bool; got {enable!r} ({type(enable).__name__})")
    STATE.enabled = enable
    return STATE.enabled


def mixed_precision() -> bool:
    """Whether mixed precision is enabled (off until :func:`set_half_dtype` or enabling it).

    Example:
        >>> import torch_facade as cstorch
        >>> cstorch.amp.mixed_precision()
        False
    """
    return STATE.enabled


def get_floating_point_dtype(default: torch.dtype = torch.float32) -> torch.dtype:
    """The half dtype (its torch proxy) if mixed precision is enabled, else ``default``.

    Example:
        >>> import torch, torch_facade as cstorch
        >>> cstorch.amp.get_floating_point_dtype()
        torch.float32
    """
    return get_half_dtype() if STATE.enabled else default


def get_floating_point_dtype_str(default: str = "float32") -> str:
    """The name of the half dtype if mixed precision is enabled, else ``default``.

    The string form of :func:`get_floating_point_dtype`, which ModelZoo models pass on to
    their embedding layers. For cbfloat16 it is ``"cbfloat16"`` (the real format's name, not
    its float16 proxy's).

    Args:
        default: what to return while mixed precision is disabled.

    Raises:
        TypeError: ``default`` is not a string.

    Example:
        >>> import torch_facade as cstorch
        >>> cstorch.amp.get_floating_point_dtype_str()
        'float32'
        >>> cstorch.amp.set_half_dtype("cbfloat16")
        torch.float16
        >>> cstorch.amp.get_floating_point_dtype_str()
        'cbfloat16'
        >>> _ = cstorch.amp.set_half_dtype("float16"); _ = cstorch.amp.enable_mixed_precision(False)
    """
    if not isinstance(default, str):
        raise TypeError(f"default must be a str; got {default!r} ({type(default).__name__})")
    return STATE.half_dtype if STATE.enabled else default


def is_cbfloat16_tensor(tensor: torch.Tensor) -> bool:
    """Whether ``tensor`` holds cbfloat16 values in its float16 proxy.

    True when the half dtype in force is cbfloat16, mixed precision is on and the tensor is of
    the proxy dtype ``torch.float16``.

    Raises:
        TypeError: ``tensor`` is not a ``torch.Tensor``.

    Example:
        >>> import torch, torch_facade as cstorch
        >>> cstorch.amp.is_cbfloat16_tensor(torch.zeros(2, dtype=torch.float16))
        False
    """
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"tensor must be a torch.Tensor; got {type(tensor).__name__}")
    return STATE.enabled and STATE.half_dtype == "cbfloat16" and tensor.dtype is torch.float16


@contextlib.contextmanager
def _checked_autocast(device_type: str, dtype: torch.dtype, note: str = "") -> Iterator[None]:
    """``torch.autocast(device_type, dtype)``, with torch's own rejection as a ``ValueError``.

    torch validates the dtype itself: it raises for some pairs (bfloat16 on a CUDA device without
    it) and, for a dtype its device does not support, warns and runs with autocast *disabled*.
    Both become a ``ValueError`` here (``note`` appended), so a model never silently runs
    without autocast.

    In ``torch.compile``'d code dynamo traces ``torch.autocast`` itself (it cannot trace the
    warnings machinery, and a graph break inside a context manager would make it run the whole
    function uncompiled): there the check is whether autocast is on once entered; a rejected
    dtype makes dynamo fall back to running the function eagerly, where this raises as usual.
    """
    if torch.compiler.is_compiling():
        with torch.autocast(device_type=device_type, dtype=dtype):
            if not torch.is_autocast_enabled(device_type):
                raise ValueError(
                    f"torch.autocast does not support dtype {dtype} on device {device_type!r}"
                    + note
                )
            yield
        return
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            context = torch.autocast(device_type=device_type, dtype=dtype)
        except (RuntimeError, AssertionError) as error:
            raise ValueError(
                f"torch.autocast rejects dtype {dtype} on device {device_type!r}: {error}{note}"
            ) from error
    with context:
        if not torch.is_autocast_enabled(device_type):  # torch warned and disabled it
            reasons = " ".join(" ".join(str(w.message).split()) for w in caught)
            raise ValueError(
                f"torch.autocast does not support dtype {dtype} on device {device_type!r}"
                + (f" ({reasons})" if reasons else "")
                + note
            )
        for w in caught:  # unrelated warnings go on to the caller's filters
            warnings.warn_explicit(w.message, w.category, w.filename, w.lineno)
        yield


@contextlib.contextmanager
def autocast_off(device_type: str) -> Iterator[None]:
    """``torch.autocast(device_type, enabled=False)`` as a ``with`` statement of its own.

    Entered through ``contextlib.ExitStack``, a ``torch.autocast`` object itself is not
    recognised by dynamo (which then runs the whole compiled function eagerly); entered by a
    ``with`` statement, in this generator, it is.

    Example:
        >>> import torch
        >>> from torch_facade.amp.precision import autocast_off
        >>> with torch.autocast("cpu", dtype=torch.bfloat16), autocast_off("cpu"):
        ...     torch.is_autocast_enabled("cpu")
        False
    """
    with torch.autocast(device_type=device_type, enabled=False):
        yield


def _autocast_available(device_type: str) -> bool:
    try:
        return bool(torch.amp.is_autocast_available(device_type))
    except RuntimeError:  # a device type torch's autocast does not know (e.g. "meta")
        return False


def _device_type_of(device_type: Any) -> str:
    if isinstance(device_type, torch.device):
        name = device_type.type
    elif isinstance(device_type, str):
        try:
            name = torch.device(device_type).type
        except RuntimeError as error:
            raise ValueError(
                f"device_type must name a torch device type; got {device_type!r}"
            ) from error
    else:
        raise TypeError(
            "device_type must be a str, a torch.device or None; got "
            f"{device_type!r} ({type(device_type).__name__})"
        )
    if not _autocast_available(name):
        raise ValueError(f"device_type {name!r} has no torch.autocast; got {device_type!r}")
    return name


def _default_device_type() -> str:
    """The type of ``torch.get_default_device()``, which dynamo cannot trace: in compiled code,
    that of a new empty tensor (where torch itself looks when the default has no index)."""
    if torch.compiler.is_compiling():
        return torch.empty(0).device.type
    return torch.get_default_device().type


def autocast_device_types(device_type: str | torch.device | None = None) -> tuple[str, ...]:
    """The device types :func:`autocast` covers: ``device_type``'s alone, else every device a
    model could be on: the CPU, the default device's type (``torch.get_default_device()``) and
    CUDA when torch sees a GPU.

    Example:
        >>> from torch_facade.amp.precision import autocast_device_types
        >>> autocast_device_types("cpu")
        ('cpu',)
    """
    if device_type is not None:
        return (_device_type_of(device_type),)
    types = ["cpu"]
    default = _default_device_type()
    if default not in types and _autocast_available(default):
        types.append(default)
    if "cuda" not in types and torch.cuda.is_available():
        types.append("cuda")
    return tuple(types)


@contextlib.contextmanager
def autocast(
    dtype: str | torch.dtype | None = None, *, device_type: str | torch.device | None = None
) -> Iterator[None]:
    """``torch.autocast`` with the half dtype in force (or ``dtype``), on the model's device.

    **Which device.** A model can be on the CPU of a machine with a GPU, or on the GPU while
    new tensors are created on the CPU; the context cannot know which, so without
    ``device_type`` it autocasts on every device the model could be on: the CPU, the default
    device's type (``torch.get_default_device()``, as set by ``torch.set_default_device`` or
    ``with torch.device(...)``) and CUDA when ``torch.cuda.is_available()``. Each op is then
    autocast on the device it runs on, and a CPU model on a GPU machine gets a CPU autocast.
    (Ops on the other devices inside the context are autocast too, which a single
    ``torch.autocast(device)`` would leave alone.) ``device_type`` restricts it to one device.

    Every dtype that ``torch.autocast`` accepts on a device works (on the CPU, torch 2.13
    computes in float16 and bfloat16); the cbfloat16 half dtype autocasts to its float16 proxy,
    so it computes with float16 numerics. What torch rejects on any covered device (it warns and
    disables autocast for an unsupported dtype) is a ``ValueError`` instead: the model never runs
    unautocast silently. Inside :func:`disable_casts` the context autocasts nothing.

    Args:
        dtype: a half dtype name (``"float16"``, ``"bfloat16"``, ``"cbfloat16"``) or any
            ``torch.dtype``; ``None`` takes the half dtype in force.
        device_type: the one device type to autocast on (``"cpu"``, ``"cuda"``, a
            ``torch.device``); ``None`` covers every device the model could be on (above).

    Raises:
        ValueError: an unknown dtype name, a device type without autocast, or a dtype that
            ``torch.autocast`` rejects on a covered device (the message names both).
        TypeError: ``device_type`` is neither a string, a ``torch.device`` nor ``None``.

    Example:
        >>> import torch, torch_facade as cstorch
        >>> with cstorch.amp.autocast(torch.bfloat16):
        ...     y = torch.nn.Linear(2, 2)(torch.ones(1, 2))
        >>> y.dtype
        torch.bfloat16
        >>> with cstorch.amp.autocast(torch.bfloat16, device_type="cpu"):
        ...     torch.is_autocast_enabled("cpu")
        True
    """
    if isinstance(dtype, torch.dtype):
        torch_dtype, name = dtype, None
    else:
        name = STATE.half_dtype if dtype is None else _half_dtype_name(dtype)
        torch_dtype = _PROXY_DTYPES[name]
    device_types = autocast_device_types(device_type)
    with contextlib.ExitStack() as stack:
        if STATE.casts_disabled:
            for each in device_types:
                stack.enter_context(autocast_off(each))
        else:
            for each in device_types:
                note = ""
                if device_type is None and each != "cpu":
                    note = (
                        f"; cstorch.amp.autocast() autocasts on {', '.join(device_types)} (every "
                        "device a model could be on): pass device_type= to choose one"
                    )
                stack.enter_context(_checked_autocast(each, torch_dtype, note))
            if name == "cbfloat16":
                STATE.proxy_autocast_seen = True
        yield


@contextlib.contextmanager
def casts_disabled() -> Iterator[None]:
    """Turns :func:`autocast` off while open (see :func:`torch_facade.amp.disable_casts`).

    Example:
        >>> from torch_facade.amp.precision import casts_disabled
        >>> with casts_disabled():
        ...     pass
    """
    STATE.casts_disabled += 1
    try:
        yield
    finally:
        STATE.casts_disabled -= 1


def are_casts_disabled() -> bool:
    """Whether a :func:`casts_disabled` context is open.

    Example:
        >>> from torch_facade.amp.precision import are_casts_disabled
        >>> are_casts_disabled()
        False
    """
    return STATE.casts_disabled > 0
