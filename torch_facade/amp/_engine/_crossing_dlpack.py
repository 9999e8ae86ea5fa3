"""The DLPack crossing: the documented ``jax.dlpack.from_dlpack`` and ``torch.from_dlpack``, on any
device.

The fallback of every faster crossing. On a GPU each import hands JAX one of the device's
external-ready streams; torch records an event on its current stream and makes that stream wait
on it, so JAX's read is ordered after torch's pending work, with no host wait. Each export makes
torch's current stream wait on the JAX result's event (a device-side wait). It is the slowest
crossing per tensor (an event and a stream per tensor on a GPU; docs/performance-notes.md).

``__dlpack__`` refuses a CUDA tensor that is not on the current device, so imports run under a
device guard; views XLA:GPU would reject as unaligned are copied first.
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence

import jax
import torch

from torch_facade.amp._engine import _storage
from torch_facade.amp._engine._crossing import Crossing


def crossing(*, host_is_device: bool) -> Crossing:
    """The DLPack crossing (``host_is_device``: see :class:`~torch_facade.amp._engine._crossing.Crossing`)."""
    return Crossing("dlpack", import_many, export, host_is_device)


def import_many(tensors: Sequence[torch.Tensor]) -> tuple[jax.Array, ...]:
    """``jax.dlpack.from_dlpack`` per tensor (all on one device), aligned, under a device guard."""
    if not tensors:
        return ()
    device = tensors[0].device
    if device.type != "cuda":
        return tuple(map(jax.dlpack.from_dlpack, tensors))
    units = [_storage.aligned(t, _storage.XLA_GPU_ALIGNMENT) for t in tensors]
    with device_guard(device):
        return tuple(map(jax.dlpack.from_dlpack, units))


def export(array: jax.Array) -> torch.Tensor:
    """``torch.from_dlpack``: orders torch's current stream after JAX's work on the array."""
    return torch.from_dlpack(array)


def device_guard(device: torch.device) -> contextlib.AbstractContextManager[None]:
    """``torch.cuda.device(device)`` for a CUDA device, else nothing."""
    if device.type == "cuda":
        return torch.cuda.device(device)
    return contextlib.nullcontext()
