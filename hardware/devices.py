"""Device facts: the JAX backend, its native half dtypes, and the JAX device for a torch device.

Nothing runs at import time; every answer that asks JAX is computed on first use and cached
(JAX's backends do not change within a process). No torch import: torch devices are duck-typed.
"""

from __future__ import annotations

import functools
from typing import Any

import jax

_BACKEND_ALIASES = {"cuda": "gpu", "rocm": "gpu"}
_RECOMMENDED_HALF_DTYPE = {"cpu": "bfloat16", "tpu": "bfloat16", "gpu": "float16"}
_MIN_BFLOAT16_CUDA_CAPABILITY = (8, 0)  # Ampere: first NVIDIA GPUs with bfloat16 arithmetic


@functools.cache
def backend() -> str:
    """Returns the platform of JAX's default backend: ``"cpu"``, ``"gpu"`` or ``"tpu"``.

    CUDA and ROCm both report ``"gpu"``; other plugin platforms are returned as JAX names them.

    Example:
        >>> backend() in ("cpu", "gpu", "tpu")
        True
    """
    platform = jax.default_backend()
    return _BACKEND_ALIASES.get(platform, platform)


@functools.cache
def native_half_dtypes() -> tuple[str, ...]:
    """Returns the 16-bit dtypes JAX computes in natively on the default backend, preferred first.

    "Natively" means as a real JAX dtype, not emulated in a float32 container: cbfloat16 is never
    native (only Cerebras hardware has it). CPU: bfloat16 and float16 (XLA evaluates each
    operation in float32 and rounds the result, so the numerics are those of the 16-bit dtype).
    TPU: bfloat16. NVIDIA GPUs: float16, plus bfloat16 from compute capability 8.0 (Ampere) on;
    other GPUs: float16 and bfloat16. Unknown platforms: none.

    Example:
        >>> "cbfloat16" in native_half_dtypes()
        False
    """
    return _native_half_dtypes_for(backend(), jax.devices())


def _native_half_dtypes_for(platform: str, devices: list[Any]) -> tuple[str, ...]:
    if platform == "cpu":
        return ("bfloat16", "float16")
    if platform == "tpu":
        return ("bfloat16",)
    if platform == "gpu":
        capabilities = [_cuda_capability(device) for device in devices]
        if any(c is not None and c < _MIN_BFLOAT16_CUDA_CAPABILITY for c in capabilities):
            return ("float16",)
        return ("float16", "bfloat16")
    return ()


def _cuda_capability(device: Any) -> tuple[int, int] | None:
    text = getattr(device, "compute_capability", None)
    try:
        major, minor = str(text).split(".")[:2]
        return int(major), int(minor)
    except ValueError:
        return None


@functools.cache
def recommended_half_dtype() -> str:
    """Returns the half dtype to train in on the default backend.

    ``"bfloat16"`` on CPU and TPU (no loss scaling needed: float32's exponent range), and
    ``"float16"`` on GPUs (fast everywhere; use it with dynamic loss scaling). Unknown
    platforms get ``"bfloat16"``.

    Example:
        >>> recommended_half_dtype() in ("float16", "bfloat16")
        True
    """
    return _recommended_half_dtype_for(backend())


def _recommended_half_dtype_for(platform: str) -> str:
    return _RECOMMENDED_HALF_DTYPE.get(platform, "bfloat16")


def jax_device_for(torch_device: Any) -> jax.Device:
    """Returns the JAX device that shares memory with a torch device, for DLPack transfers.

    Args:
        torch_device: a ``torch.device`` (or any object with ``.type`` and ``.index``), or a
            string such as ``"cpu"``, ``"cuda"`` or ``"cuda:1"``. ``"cuda"`` without an index
            means device 0 (a tensor's ``.device`` always carries its index).

    Returns:
        The JAX CPU device for ``"cpu"``; the local JAX GPU whose hardware id is the CUDA
        index for ``"cuda"`` (torch and JAX number GPUs alike, both after
        ``CUDA_VISIBLE_DEVICES``). A GPU is matched by position only on a jaxlib that reports
        no hardware ids.

    Raises:
        RuntimeError: JAX has no matching device (for example a CUDA tensor with a CPU-only
            jaxlib, or an index beyond the visible GPUs), or the device type has no JAX
            counterpart here. The message names the torch device and the JAX devices.

    Example:
        >>> jax_device_for("cpu").platform
        'cpu'
    """
    kind, index = _torch_device_parts(torch_device)
    return _jax_device(kind, index)


@functools.cache
def _jax_device(kind: str, index: int | None) -> jax.Device:
    described = kind if index is None else f"{kind}:{index}"
    if kind == "cpu":
        return jax.local_devices(backend="cpu")[0]
    if kind != "cuda":
        raise RuntimeError(
            f"torch device {described!r} has no JAX counterpart: only 'cpu' and 'cuda' tensors "
            f"can be exchanged with JAX here (JAX devices: {_describe(jax.devices())})"
        )
    try:
        gpus = jax.local_devices(backend="gpu")
    except RuntimeError:
        raise RuntimeError(
            f"torch device {described!r} has no matching JAX device: this jaxlib has no GPU "
            f"backend (JAX devices: {_describe(jax.devices())}). Install jax with the CUDA "
            f"plugin matching torch's CUDA version (pip install 'cstorch-amp[cuda13]' for "
            f"torch's default CUDA 13 wheels, 'cstorch-amp[cuda12]' for its cu12 builds) or "
            f"move the tensors to the CPU."
        ) from None
    wanted = 0 if index is None else index
    hardware_ids = [getattr(device, "local_hardware_id", None) for device in gpus]
    for device, hardware_id in zip(gpus, hardware_ids, strict=True):
        if hardware_id == wanted:
            return device
    # Only a jaxlib that reports no hardware ids at all is matched by position; one that reports
    # them but not this one sees other GPUs (a position would silently pick the wrong one).
    if all(hardware_id is None for hardware_id in hardware_ids) and 0 <= wanted < len(gpus):
        return gpus[wanted]
    raise RuntimeError(
        f"torch device {described!r} has no matching JAX device: JAX sees the GPUs "
        f"{_describe(gpus)} (check CUDA_VISIBLE_DEVICES)"
    )


def _torch_device_parts(torch_device: Any) -> tuple[str, int | None]:
    if isinstance(torch_device, str):
        kind, _, index = torch_device.partition(":")
        if index and not index.isdigit():
            raise ValueError(f"torch_device {torch_device!r} is not of the form 'type[:index]'")
        return kind, int(index) if index else None
    kind_attr = getattr(torch_device, "type", None)
    if not isinstance(kind_attr, str):
        raise ValueError(
            f"torch_device must be a torch.device, an object with .type and .index, or a string "
            f"such as 'cuda:0'; got {torch_device!r}"
        )
    index_attr = getattr(torch_device, "index", None)
    return kind_attr, None if index_attr is None else int(index_attr)


def _describe(devices: list[Any]) -> str:
    return "[" + ", ".join(f"{d.platform}:{d.id}" for d in devices) + "]"
