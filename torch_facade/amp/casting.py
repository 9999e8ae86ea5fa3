"""The reference's apex-style casting API, and ``disable_casts``.

``cerebras.pytorch.amp`` keeps a part of NVIDIA apex's O1 "amp": decorators and registries
that cast a function's floating-point tensor arguments, switched on by ``init()``:

* :func:`half_function`, :func:`float_function`, :func:`promote_function` wrap a function;
* :func:`register_half_function`, :func:`register_float_function`,
  :func:`register_promote_function` name a function in a module, patched by :func:`init`;
* :func:`init` turns the casts on (and mixed precision with them) and returns the handle;
* :func:`disable_casts` turns every cast off inside a ``with`` block.

Here the casts run on every device. What is not reproduced: the reference's ``init`` also
patches several hundred of torch's own functions from apex's op lists (``FP16_FUNCS``,
``FP32_FUNCS``, ...), process-wide. torch's autocast does that job per op and per device,
so here :func:`torch_facade.amp.autocast` is the op-level cast and ``init`` says so once.

Example:
    >>> import torch, torch_facade as cstorch
    >>> @cstorch.amp.float_function
    ... def total(x):
    ...     return x.sum()
    >>> total(torch.ones(2, dtype=torch.float16)).dtype  # casts are off until init()
    torch.float16
"""

from __future__ import annotations

import contextlib
import functools
import os
import types
import warnings
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

import torch
from torch.optim.optimizer import register_optimizer_step_pre_hook

from torch_facade.amp import _caller, precision
from torch_facade.amp._engine import engine_of
from torch_facade.amp._host_side import host_side

__all__ = [
    "disable_casts",
    "float_function",
    "half_function",
    "init",
    "promote_function",
    "register_float_function",
    "register_half_function",
    "register_promote_function",
]

F = TypeVar("F", bound=Callable[..., Any])

_HALF_TYPES = (torch.float16, torch.bfloat16)
"""The 16-bit dtypes a half dtype is held in (cbfloat16 in its float16 proxy)."""

_TORCH_DIR = os.path.dirname(os.path.abspath(torch.__file__))
"""torch's package directory: the float16 warning skips torch's optimizer-hook frames."""

_DEVICE_TYPES = ("cpu", "cuda", "xpu", "mps", "hpu", "xla", "privateuseone", "mtia", "maia")
"""Device types whose autocast :func:`disable_casts` turns off where it is on."""


class AmpHandle:
    """What :func:`init` returns: whether the apex-style casts are on, and what it patched.

    Attributes:
        verbose: print each cast (``"float32->float16 (fn)"``).
    """

    def __init__(self, enabled: bool, verbose: bool) -> None:
        self._enabled = enabled
        self.verbose = verbose
        self._patched: list[tuple[Any, str, Any]] = []
        self._hook: Any = None

    def is_active(self) -> bool:
        """Whether casts happen now: ``init(enabled=True)`` and no :func:`disable_casts` open."""
        return self._enabled and not precision.are_casts_disabled()

    @property
    def has_cache(self) -> bool:
        """Always ``False``: casts are not cached (the reference caches casted weights)."""
        return False

    def _patch(self, module: Any, name: str, wrap: Callable[[Callable[..., Any]], Any]) -> None:
        original = getattr(module, name)
        self._patched.append((module, name, original))
        setattr(module, name, wrap(original))

    def _deactivate(self) -> None:
        """Undoes :func:`init`: restores the patched functions and turns the casts off."""
        for module, name, original in reversed(self._patched):
            setattr(module, name, original)
        self._patched.clear()
        if self._hook is not None:
            self._hook.remove()
            self._hook = None
        self._enabled = False
        if _STATE.handle is self:
            _STATE.handle = None


class _CastingState:
    handle: AmpHandle | None = None
    # (module, name, kind) registered by register_*_function, patched by init().
    registry: list[tuple[Any, str, str]] = []  # noqa: RUF012 (one process-wide registry)


_STATE = _CastingState()


# ----------------------------------------------------------------------------- the casts


def _fn_name(fn: Any) -> str:
    return str(getattr(fn, "__qualname__", None) or getattr(fn, "__name__", repr(fn)))


def _is_float_tensor(x: Any) -> bool:
    return isinstance(x, torch.Tensor) and x.is_floating_point()


def _is_float_tensors(x: Any) -> bool:
    """A floating-point tensor, or a non-empty list or tuple of them (apex's rule)."""
    if isinstance(x, (list, tuple)):
        return bool(x) and all(_is_float_tensor(y) for y in x)
    return _is_float_tensor(x)


def _cast(x: Any, dtype: torch.dtype, name: str, verbose: bool) -> Any:
    if isinstance(x, (list, tuple)):
        return type(x)(_cast(y, dtype, name, verbose) for y in x)
    if x.dtype is dtype:
        return x
    if verbose:
        print(
            f"{str(x.dtype).removeprefix('torch.')}->{str(dtype).removeprefix('torch.')} ({name})"
        )
    return x.to(dtype)


def _cast_arguments(
    args: tuple[Any, ...], kwargs: dict[str, Any], dtype: torch.dtype, name: str, verbose: bool
) -> tuple[list[Any], dict[str, Any]]:
    new_args = [_cast(a, dtype, name, verbose) if _is_float_tensors(a) else a for a in args]
    new_kwargs = {
        k: _cast(v, dtype, name, verbose) if _is_float_tensors(v) else v for k, v in kwargs.items()
    }
    return new_args, new_kwargs


def _float_dtypes(args: tuple[Any, ...], kwargs: dict[str, Any]) -> set[torch.dtype]:
    found: set[torch.dtype] = set()
    for value in (*args, *kwargs.values()):
        if _is_float_tensors(value):
            for t in value if isinstance(value, (list, tuple)) else (value,):
                found.add(t.dtype)
    return found


def _casting_wrapper(fn: Callable[..., Any], kind: str) -> Callable[..., Any]:
    """``fn``, casting its floating-point tensor arguments while the handle is active.

    ``kind``: ``"half"`` (to the half dtype), ``"float"`` (to float32) or ``"promote"`` (to
    float32 when they mix float32 with a 16-bit dtype, else unchanged).
    """
    name = _fn_name(fn)

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        handle = _STATE.handle
        if handle is None or not handle.is_active():
            return fn(*args, **kwargs)
        if kind == "half":
            dtype = precision.get_half_dtype()
        elif kind == "float":
            dtype = torch.float32
        else:
            dtypes = _float_dtypes(args, kwargs)
            if not (len(dtypes) == 2 and torch.float32 in dtypes and dtypes & set(_HALF_TYPES)):
                return fn(*args, **kwargs)
            dtype = torch.float32
        new_args, new_kwargs = _cast_arguments(args, kwargs, dtype, name, handle.verbose)
        return fn(*new_args, **new_kwargs)

    return wrapper


def _check_callable(fn: Any) -> None:
    if not callable(fn):
        raise TypeError(f"fn must be callable; got {fn!r} ({type(fn).__name__})")


def half_function(fn: F) -> F:
    """Decorator: ``fn`` gets its floating-point tensor arguments in the half dtype.

    Tensors (and lists or tuples of tensors) among the positional and keyword arguments are
    cast to the torch dtype of the half dtype in force (float16 for cbfloat16's proxy) while the
    casts are on: after :func:`init`, outside :func:`disable_casts`. Otherwise ``fn`` runs
    unchanged.

    Raises:
        TypeError: ``fn`` is not callable.

    Example:
        >>> import torch, torch_facade as cstorch
        >>> @cstorch.amp.half_function
        ... def matmul(a, b):
        ...     return a @ b
        >>> matmul(torch.ones(2, 2), torch.ones(2, 2)).dtype
        torch.float32
    """
    _check_callable(fn)
    return _casting_wrapper(fn, "half")  # type: ignore[return-value]


def float_function(fn: F) -> F:
    """Decorator: ``fn`` gets its floating-point tensor arguments in float32 (casts on only).

    Raises:
        TypeError: ``fn`` is not callable.

    Example:
        >>> import torch, torch_facade as cstorch
        >>> softmax = cstorch.amp.float_function(torch.softmax)
        >>> softmax(torch.ones(3, dtype=torch.bfloat16), 0).dtype  # casts are off: unchanged
        torch.bfloat16
    """
    _check_callable(fn)
    return _casting_wrapper(fn, "float")  # type: ignore[return-value]


def promote_function(fn: F) -> F:
    """Decorator: ``fn``'s floating-point tensor arguments are promoted to float32 when they mix
    float32 with a 16-bit dtype (casts on only); arguments of one dtype pass unchanged.

    Raises:
        TypeError: ``fn`` is not callable.

    Example:
        >>> import torch, torch_facade as cstorch
        >>> add = cstorch.amp.promote_function(torch.add)
        >>> add(torch.ones(1), torch.ones(1)).dtype
        torch.float32
    """
    _check_callable(fn)
    return _casting_wrapper(fn, "promote")  # type: ignore[return-value]


def _register(module: Any, name: Any, kind: str) -> None:
    if not isinstance(name, str):
        raise TypeError(f"name must be a str; got {name!r} ({type(name).__name__})")
    where = module.__name__ if isinstance(module, types.ModuleType) else repr(module)
    if not hasattr(module, name):
        raise ValueError(f"No function named {name} in module {where}.")
    if not callable(getattr(module, name)):
        raise TypeError(f"{where}.{name} must be callable; got {getattr(module, name)!r}")
    handle = _STATE.handle
    if handle is not None:  # init() already ran: patch now
        handle._patch(module, name, lambda fn: _casting_wrapper(fn, kind))
    else:
        _STATE.registry.append((module, name, kind))


@host_side
def register_half_function(module: Any, name: str) -> None:
    """Has :func:`init` patch ``module.name`` as :func:`half_function` would wrap it.

    Registered before :func:`init`, the function is patched by it (as in the reference);
    registered after it, at once (the reference would silently ignore it).

    Args:
        module: a module (or any object) holding the function.
        name: the function's attribute name.

    Raises:
        ValueError: ``module`` has no attribute ``name``.
        TypeError: ``name`` is not a string, or the attribute is not callable.

    Example:
        >>> import types, warnings, torch, torch_facade as cstorch
        >>> ops = types.SimpleNamespace(mm=torch.mm)
        >>> cstorch.amp.register_half_function(ops, "mm")
        >>> with warnings.catch_warnings():
        ...     warnings.simplefilter("ignore")
        ...     handle = cstorch.amp.init()
        >>> ops.mm(torch.ones(2, 2), torch.ones(2, 2)).dtype
        torch.float16
        >>> handle._deactivate(); _ = cstorch.amp.enable_mixed_precision(False)
        >>> ops.mm is torch.mm
        True
    """
    _register(module, name, "half")


@host_side
def register_float_function(module: Any, name: str) -> None:
    """Has :func:`init` patch ``module.name`` as :func:`float_function` would wrap it.

    Raises:
        ValueError: ``module`` has no attribute ``name``.
        TypeError: ``name`` is not a string, or the attribute is not callable.

    Example:
        >>> import math, torch_facade as cstorch
        >>> cstorch.amp.register_float_function(math, "no_such_function")
        Traceback (most recent call last):
        ...
        ValueError: No function named no_such_function in module math.
    """
    _register(module, name, "float")


@host_side
def register_promote_function(module: Any, name: str) -> None:
    """Has :func:`init` patch ``module.name`` as :func:`promote_function` would wrap it.

    Raises:
        ValueError: ``module`` has no attribute ``name``.
        TypeError: ``name`` is not a string, or the attribute is not callable.

    Example:
        >>> import math, torch_facade as cstorch
        >>> cstorch.amp.register_promote_function(math, "pi")
        Traceback (most recent call last):
        ...
        TypeError: math.pi must be callable; got 3.141592653589793
    """
    _register(module, name, "promote")


# ---------------------------------------------------------------------- init, disable_casts


def _warn_float16_without_scaler(optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
    """The reference's optimizer step pre-hook: float16 without a loss scaler underflows."""
    if precision.get_half_dtype_str() == "float16" and engine_of(optimizer) is None:
        warnings.warn(
            "Detected that the half dtype is set to float16 but no grad scaler steps this "
            f"{type(optimizer).__name__}. Please use a grad scaler to prevent gradient "
            "underflow: grad_scaler = cstorch.amp.GradScaler(...), then "
            "grad_scaler.step(optimizer)",
            UserWarning,
            stacklevel=_caller.stacklevel(also_skip=(_TORCH_DIR,)),
        )


@host_side
def init(
    enabled: bool = True,
    enable_caching: bool = True,
    verbose: bool = False,
    allow_banned: bool = False,
) -> AmpHandle:
    """Turns the apex-style casts on; runs once (later calls return the first handle).

    With ``enabled``: enables mixed precision (:func:`torch_facade.amp.enable_mixed_precision`),
    patches every function registered with ``register_*_function``, activates the
    ``*_function`` decorators, and warns whenever an optimizer steps with the float16 half
    dtype but no ``GradScaler`` (as the reference does). The reference also patches torch's own
    functions from apex's op lists; that is not done here (``cstorch.amp.autocast()`` casts
    per op, per device), and a ``UserWarning`` says so once.

    Args:
        enabled: ``False`` returns a handle whose casts are off.
        enable_caching: accepted for the reference's signature; casts are not cached here.
        verbose: print every cast.
        allow_banned: accepted for the reference's signature; no torch function is banned here
            (none is patched).

    Returns:
        The :class:`AmpHandle`.

    Raises:
        TypeError: an argument that is not a bool.

    Example:
        >>> import warnings, torch, torch_facade as cstorch
        >>> twice = cstorch.amp.half_function(lambda x: x * 2)
        >>> with warnings.catch_warnings():
        ...     warnings.simplefilter("ignore")
        ...     handle = cstorch.amp.init()
        >>> twice(torch.ones(1)).dtype, handle.is_active()
        (torch.float16, True)
        >>> with cstorch.amp.disable_casts():
        ...     twice(torch.ones(1)).dtype
        torch.float32
        >>> handle._deactivate(); _ = cstorch.amp.enable_mixed_precision(False)
    """
    for argument, value in (
        ("enabled", enabled),
        ("enable_caching", enable_caching),
        ("verbose", verbose),
        ("allow_banned", allow_banned),
    ):
        if not isinstance(value, bool):
            raise TypeError(f"{argument} must be a bool; got {value!r} ({type(value).__name__})")
    if _STATE.handle is not None:
        return _STATE.handle
    handle = AmpHandle(enabled, verbose)
    if enabled:
        precision.enable_mixed_precision(True)
        for module, name, kind in _STATE.registry:
            handle._patch(module, name, functools.partial(_casting_wrapper, kind=kind))
        _STATE.registry.clear()
        handle._hook = register_optimizer_step_pre_hook(_warn_float16_without_scaler)
    _STATE.handle = handle
    if not enabled:
        return handle
    warnings.warn(
        "cstorch.amp.init(): the functions registered with register_*_function and decorated "
        "with *_function now cast; torch's own functions are not patched here (the reference "
        "patches apex's op lists): run the forward pass under cstorch.amp.autocast() for "
        "per-op casting",
        UserWarning,
        stacklevel=_caller.stacklevel(),
    )
    return handle


@contextlib.contextmanager
def disable_casts() -> Iterator[None]:
    """Turns the facade's casting off inside the ``with`` block.

    Inside it the apex-style casts (:func:`half_function` and the others, and the functions
    :func:`init` patched) pass their arguments unchanged, an autocast already open is turned off
    on every device (``cstorch.amp.autocast()``'s, and ``torch.autocast``'s alike), and a
    ``cstorch.amp.autocast()`` entered inside autocasts nothing: ops run in their inputs' dtypes.
    On exit everything is as before.

    Example:
        >>> import torch, torch_facade as cstorch
        >>> with cstorch.amp.autocast(torch.bfloat16):
        ...     with cstorch.amp.disable_casts():
        ...         inner = torch.nn.Linear(2, 2)(torch.ones(1, 2)).dtype
        ...     outer = torch.nn.Linear(2, 2)(torch.ones(1, 2)).dtype
        >>> inner, outer
        (torch.float32, torch.bfloat16)
    """
    with contextlib.ExitStack() as stack:
        for device_type in _DEVICE_TYPES:
            if torch.is_autocast_enabled(device_type):
                stack.enter_context(precision.autocast_off(device_type))
        stack.enter_context(precision.casts_disabled())
        yield
