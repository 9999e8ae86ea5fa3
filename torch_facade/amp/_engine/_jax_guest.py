"""JAX as a guest on torch's devices: its backends start only when the facade needs them.

JAX initializes every backend at once (the first ``jax.devices()``, array, jit call or DLPack
import, ``jax.devices("cpu")`` included), and its CUDA client then preallocates 75% of the
memory of every GPU it can see (``XLA_PYTHON_CLIENT_PREALLOCATE``, read once, at that moment).
Beside torch, which owns the model, that is an out-of-memory error waiting to happen; under
torchrun every rank would take 75% of every GPU.

The facade needs a few scalars in JAX. So nothing here runs at import or in
``GradScaler()``: :func:`start` is called before the facade's first JAX operation (its first
decision, or a cbfloat16 rounding), with the torch device the operation is for. If JAX's
backends are not running yet, it starts them with

* preallocation off, unless the user chose a memory setting (one of :data:`MEMORY_SETTINGS` in
  the environment, or ``jax_pjrt_client_create_options``);
* only the GPU of that torch device visible to JAX, when it is a GPU and the user has not
  restricted JAX's GPUs (``jax_cuda_visible_devices``/``jax_rocm_visible_devices`` left at
  ``"all"``); a later decision on another GPU then gets an error saying how to widen it.

Both settings apply to that one initialization only: the environment and JAX's configuration
are restored afterwards, so child processes see what the user set. If JAX was started earlier
by something else, with the default preallocation, the first GPU decision warns once and names
the remedy.
"""

from __future__ import annotations

import contextlib
import os
import warnings
from collections.abc import Iterator
from typing import Any

import jax
import torch

from hardware import devices

MEMORY_SETTINGS = (
    "XLA_PYTHON_CLIENT_PREALLOCATE",
    "XLA_CLIENT_MEM_FRACTION",
    "XLA_PYTHON_CLIENT_MEM_FRACTION",
    "XLA_PYTHON_CLIENT_ALLOCATOR",
)
"""Environment variables with which a user chooses how JAX's GPU client takes memory."""

_started = False  # JAX's backends are known to be running (by us or by someone else)
_started_by_facade = False
_warned_preallocation = False
_opened_only: str | None = None  # the one GPU the facade let JAX open, if it restricted them
_REMEDY = (
    "Set XLA_PYTHON_CLIENT_PREALLOCATE=false in the environment before JAX starts (before the "
    "first JAX call of the process), or let the facade start JAX: it then takes only what it "
    "needs. See the docs page 'GPUs' (docs/gpus.md), section 'Sharing a GPU with torch'."
)


def backends_started() -> bool:
    """Whether JAX's backends are running (``True`` if this jax cannot tell: assume they are)."""
    try:
        from jax._src import xla_bridge

        return bool(xla_bridge.backends_are_initialized())
    except Exception:
        return True


def start(device: torch.device) -> None:
    """Makes sure JAX's backends run, starting them as a guest if nobody has yet.

    Cheap after the first call (one global check, then the one-time warning check on a GPU).

    Args:
        device: the torch device the facade is about to use JAX for.
    """
    global _started, _started_by_facade
    if not _started:
        if not backends_started():
            kind, index = device.type, device.index
            if kind == "cpu" and torch.cuda.is_available() and torch.cuda.is_initialized():
                # A CPU decision first (no gradients yet, a cbfloat16 cast) in a process whose
                # torch uses a GPU: JAX opens that GPU only, as a GPU decision would have it.
                kind = "cuda"
            if kind == "cuda" and index is None:
                index = torch.cuda.current_device()
            with guest_settings(kind, index, hip=torch.version.hip is not None):
                jax.devices()  # starts every backend, with the settings above
            _started_by_facade = True
        _started = True
    if device.type == "cuda" and not _started_by_facade:
        _warn_if_preallocated()


def jax_device_for(device: torch.device) -> jax.Device:
    """The JAX device that shares memory with ``device``, JAX started as a guest if needed.

    Raises:
        RuntimeError: a GPU tensor and no working JAX GPU backend (the message quotes the
            backend's own error and names the package extra for torch's CUDA version), or a
            GPU that JAX does not see.
    """
    start(device)
    try:
        return devices.jax_device_for(device)
    except RuntimeError as error:
        if device.type != "cuda":
            raise
        if _gpu_backend_works():
            if _opened_only is None:
                raise
            raise RuntimeError(
                f"{error}. The facade started JAX with only {_opened_only} visible to it (the "
                "GPU of its first decision), and this decision is on another GPU: to use "
                "several GPUs in one process, call jax.config.update('jax_cuda_visible_devices', "
                "'0,1') (the GPUs it needs) before the first decision"
            ) from error
        cause = _backend_error() or str(error)
        raise gpu_missing_error(str(device), torch.version.cuda, cause) from error


def _gpu_backend_works() -> bool:
    try:
        return bool(jax.local_devices(backend="gpu"))
    except RuntimeError:
        return False


def _backend_error() -> str | None:
    """The error with which JAX's CUDA or ROCm backend failed to start, if it recorded one."""
    try:
        from jax._src import xla_bridge

        errors = dict(xla_bridge._backend_errors)
    except Exception:
        return None
    found = [f"{name}: {errors[name]}" for name in ("cuda", "rocm") if errors.get(name)]
    return "; ".join(found) or None


@contextlib.contextmanager
def guest_settings(kind: str, index: int | None, *, hip: bool = False) -> Iterator[None]:
    """The environment and JAX configuration for a backend start, restored on exit."""
    saved_env: dict[str, str | None] = {}
    saved_config: dict[str, Any] = {}
    try:
        if not user_chose_memory():
            saved_env["XLA_PYTHON_CLIENT_PREALLOCATE"] = os.environ.get(
                "XLA_PYTHON_CLIENT_PREALLOCATE"
            )
            os.environ["XLA_PYTHON_CLIENT_PREALLOCATE"] = "false"
        if kind == "cuda":
            name = "jax_rocm_visible_devices" if hip else "jax_cuda_visible_devices"
            current = _config_value(name)
            if current == "all":
                saved_config[name] = current
                jax.config.update(name, str(0 if index is None else index))
                global _opened_only
                _opened_only = f"{kind}:{0 if index is None else index}"
        yield
    finally:
        for name, value in saved_env.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value
        for name, value in saved_config.items():
            jax.config.update(name, value)


def user_chose_memory() -> bool:
    """Whether the user set how JAX's GPU client takes memory (environment or client options)."""
    if any(os.environ.get(name) for name in MEMORY_SETTINGS):
        return True
    return _config_value("jax_pjrt_client_create_options") not in (None, "", {})


def _config_value(name: str) -> Any:
    """A JAX option's value (flags are read with ``read``, states as attributes), or ``None``
    for an option this jax does not have."""
    try:
        return jax.config.read(name)
    except Exception:
        return getattr(jax.config, name, None)


def _warn_if_preallocated() -> None:
    """Warns once when JAX was started by someone else with the default preallocation."""
    global _warned_preallocation
    if _warned_preallocation or user_chose_memory() or not _gpu_backend_works():
        return  # (a jaxlib without a GPU backend preallocates nothing)
    _warned_preallocation = True
    warnings.warn(
        "JAX's backends were started before the facade's first GPU decision, with JAX's "
        "default GPU memory preallocation (75% of every visible GPU's memory), which torch then "
        "cannot use. " + _REMEDY,
        RuntimeWarning,
        stacklevel=3,
    )


def gpu_missing_error(described: str, cuda_version: str | None, cause: str) -> RuntimeError:
    """The error for a torch GPU tensor when JAX has no working GPU backend.

    Quotes the backend's own error (``cause``), and names the package extra that matches
    torch's CUDA version.
    """
    major = (cuda_version or "").split(".")[0]
    extra = {"12": "cuda12", "13": "cuda13"}.get(major)
    if extra is not None:
        install = (
            f"torch here is built for CUDA {cuda_version}: pip install 'cstorch-amp[{extra}]' "
            f"(that is, jax[{extra}])"
        )
    else:
        install = (
            f"torch here reports CUDA {cuda_version!r}: install the jax CUDA plugin matching it "
            "(pip install 'cstorch-amp[cuda13]' for CUDA 13 builds of torch, "
            "'cstorch-amp[cuda12]' for CUDA 12 builds)"
        )
    return RuntimeError(
        f"torch device {described!r} needs a JAX GPU backend, and JAX has none that works: "
        f"{cause}. {install}; or move the model to the CPU."
    )
