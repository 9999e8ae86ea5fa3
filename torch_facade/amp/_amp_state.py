"""The process-wide half dtype and mixed-precision switch (SPEC section 6)."""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Iterator
from typing import Any

import torch

from hardware.half_dtypes import DEFAULT_HALF_DTYPE, HALF_DTYPES

_PROXY_DTYPES: dict[str, torch.dtype] = {
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    # No framework has a cbfloat16 dtype: models hold it in float16 as a proxy (as on CSX, where
    # the compiler converts the proxy to the real format).
    "cbfloat16": torch.float16,
}


class _AmpState:
    half_dtype: str = DEFAULT_HALF_DTYPE
    enabled: bool = False


_STATE = _AmpState()


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
        >>> _ = cstorch.amp.set_half_dtype("float16"); cstorch.amp.enable_mixed_precision(False)
    """
    name = _half_dtype_name(value)
    _STATE.half_dtype = name
    _STATE.enabled = True
    return _PROXY_DTYPES[name]


def get_half_dtype() -> torch.dtype:
    """The torch dtype of the half dtype in force (``torch.float16`` proxies cbfloat16).

    Example:
        >>> import torch_facade as cstorch
        >>> cstorch.amp.get_half_dtype()
        torch.float16
    """
    return _PROXY_DTYPES[_STATE.half_dtype]


def get_half_dtype_str() -> str:
    """The name of the half dtype in force: ``"float16"``, ``"bfloat16"`` or ``"cbfloat16"``.

    Example:
        >>> import torch_facade as cstorch
        >>> cstorch.amp.get_half_dtype_str()
        'float16'
    """
    return _STATE.half_dtype


def enable_mixed_precision(use: bool = True) -> None:
    """Switches mixed precision on or off (the half dtype is kept).

    Raises:
        TypeError: ``use`` is not a bool.

    Example:
        >>> import torch_facade as cstorch
        >>> cstorch.amp.enable_mixed_precision(True); cstorch.amp.mixed_precision()
        True
        >>> cstorch.amp.enable_mixed_precision(False)
    """
    if not isinstance(use, bool):
        raise TypeError(f"use must be a bool; got {use!r}")
    _STATE.enabled = use


def mixed_precision() -> bool:
    """Whether mixed precision is enabled (off until :func:`set_half_dtype` or enabling it).

    Example:
        >>> import torch_facade as cstorch
        >>> cstorch.amp.mixed_precision()
        False
    """
    return _STATE.enabled


def get_floating_point_dtype(default: torch.dtype = torch.float32) -> torch.dtype:
    """The half dtype (its torch proxy) if mixed precision is enabled, else ``default``.

    Example:
        >>> import torch, torch_facade as cstorch
        >>> cstorch.amp.get_floating_point_dtype()
        torch.float32
    """
    return get_half_dtype() if _STATE.enabled else default


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
    return _STATE.enabled and _STATE.half_dtype == "cbfloat16" and tensor.dtype is torch.float16


@contextlib.contextmanager
def _checked_autocast(device_type: str, dtype: torch.dtype) -> Iterator[None]:
    """``torch.autocast(device_type, dtype)``, with torch's own rejection as a ``ValueError``.

    torch validates the dtype itself: it raises for some pairs (bfloat16 on a CUDA device without
    it) and, for a dtype its device does not support, warns and runs with autocast *disabled*.
    Both become a ``ValueError`` here, so a model never silently runs without autocast.
    """
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            context = torch.autocast(device_type=device_type, dtype=dtype)
        except RuntimeError as error:
            raise ValueError(
                f"torch.autocast rejects dtype {dtype} on device {device_type!r}: {error}"
            ) from error
    with context:
        if not torch.is_autocast_enabled(device_type):  # torch warned and disabled it
            reasons = " ".join(" ".join(str(w.message).split()) for w in caught)
            raise ValueError(
                f"torch.autocast does not support dtype {dtype} on device {device_type!r}"
                + (f" ({reasons})" if reasons else "")
            )
        for w in caught:  # unrelated warnings go on to the caller's filters
            warnings.warn_explicit(w.message, w.category, w.filename, w.lineno)
        yield


@contextlib.contextmanager
def autocast(dtype: str | torch.dtype | None = None) -> Iterator[None]:
    """``torch.autocast`` on the current device with the half dtype in force (or ``dtype``).

    The device is CUDA when torch sees a GPU, else the CPU. Every dtype that ``torch.autocast``
    accepts on that device works (on the CPU, torch 2.13 computes in float16 and bfloat16); the
    cbfloat16 half dtype autocasts to its float16 proxy, so it computes with float16 numerics.
    What torch rejects (it warns and disables autocast for an unsupported dtype) is a
    ``ValueError`` here instead.

    Args:
        dtype: a half dtype name (``"float16"``, ``"bfloat16"``, ``"cbfloat16"``) or any
            ``torch.dtype``; ``None`` takes the half dtype in force.

    Raises:
        ValueError: an unknown dtype name, or a dtype that ``torch.autocast`` rejects on the
            device (the message names both).

    Example:
        >>> import torch, torch_facade as cstorch
        >>> with cstorch.amp.autocast(torch.bfloat16):
        ...     y = torch.nn.Linear(2, 2)(torch.ones(1, 2))
        >>> y.dtype
        torch.bfloat16
    """
    if isinstance(dtype, torch.dtype):
        torch_dtype = dtype
    else:
        name = _STATE.half_dtype if dtype is None else _half_dtype_name(dtype)
        torch_dtype = _PROXY_DTYPES[name]
    device_type = "cuda" if torch.cuda.is_available() else "cpu"
    with _checked_autocast(device_type, torch_dtype):
        yield
