"""Moving tensors and the scaler state between torch and JAX: the crossing of each device.

:func:`crossing_for` chooses a device's crossing once (:mod:`~torch_facade.amp._engine._crossing`:
one module per device kind) after starting JAX as a guest on it
(:mod:`~torch_facade.amp._engine._jax_guest`); the rest convert through it, zero-copy (DLPack):
gradients into JAX for a core to read, a core's result back to torch, and the state onto a
device or back to the host.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any, cast

import jax
import numpy as np
import torch

import amp_core
from torch_facade.amp._engine import (
    _crossing,
    _crossing_cpu,
    _crossing_cuda,
    _crossing_dlpack,
    _jax_guest,
)


def crossing_for(device: torch.device) -> _crossing.Crossing:
    """The crossing for tensors on ``device`` (:mod:`~torch_facade.amp._engine._crossing`), chosen once
    per device after the private variants' self-checks; JAX is started as a guest first."""
    return _chosen_crossing(device)


@functools.cache
def _chosen_crossing(device: torch.device) -> _crossing.Crossing:
    if device.type == "cpu":
        _jax_guest.start(device)
        return _crossing_cpu.crossing() or _crossing_dlpack.crossing(host_is_device=True)
    jax_device = _jax_guest.jax_device_for(device)  # a clear error when JAX has no such device
    if device.type == "cuda":
        chosen = _crossing_cuda.crossing(device, jax_device)
        return chosen or _crossing_dlpack.crossing(host_is_device=False)
    return _crossing_dlpack.crossing(host_is_device=False)


def to_jax(tensor: torch.Tensor) -> jax.Array:
    """Zero-copy import of one torch tensor (see :func:`import_tensors`)."""
    return crossing_for(tensor.device).import_many([tensor])[0]


def import_tensors(tensors: Sequence[torch.Tensor]) -> tuple[jax.Array, ...]:
    """Imports tensors of one device for a read by a jitted core, zero-copy where DLPack allows.

    Through the crossing of their device (:mod:`~torch_facade.amp._engine._crossing`): ordered after
    torch's pending work on them, with no host wait.
    """
    if not tensors:
        return ()
    return crossing_for(tensors[0].device).import_many(tensors)


def to_torch(array: Any) -> torch.Tensor:
    """Zero-copy export of a JAX array (or a view of a NumPy array: a state not yet placed).

    Always a normal tensor, even when called under ``torch.inference_mode()``: the scaler keeps
    some of these (its scale) and a later ``scale(loss)`` saves them for backward.
    """
    return _normal_tensor(_export, array)


def _normal_tensor(export: Any, array: Any) -> torch.Tensor:
    """``export(array)``, outside inference mode (whose tensors autograd refuses to save)."""
    if torch.is_inference_mode_enabled():
        with torch.inference_mode(False):
            return export(array)
    return export(array)


def _export(array: Any) -> torch.Tensor:
    if isinstance(array, np.ndarray):
        return torch.from_numpy(array)
    if array.device.platform == "cpu":
        return crossing_for(_CPU).export(array)
    return _crossing_dlpack.export(array)  # orders torch's stream after JAX's work


_CPU = torch.device("cpu")


def place_state(state: amp_core.LossScaleState, torch_device: torch.device) -> Any:
    """Moves the scaler state to the JAX device matching ``torch_device`` (no-op if there).

    A state not placed yet (NumPy arrays, :func:`amp_core.init_on_host`) is put there; JAX is
    started as a guest first if nothing has started it (:mod:`~torch_facade.amp._engine._jax_guest`).
    """
    device = _jax_guest.jax_device_for(torch_device)
    if not isinstance(state.loss_scale, np.ndarray) and state.loss_scale.devices() == {device}:
        return state
    return jax.device_put(state, device)


def counter_on(torch_device: torch.device, value: int) -> jax.Array:
    """``value`` as an int32 JAX array on the JAX device matching ``torch_device``."""
    return jax.device_put(np.int32(value), _jax_guest.jax_device_for(torch_device))


def on_host(state: amp_core.LossScaleState) -> amp_core.LossScaleState:
    """The state as (writable) NumPy arrays: a host synchronisation if it is on a device."""
    return host_state(jax.device_get(tuple(state)))


def host_state(leaves: Any) -> amp_core.LossScaleState:
    """A state of writable NumPy copies of ``leaves`` (host values, in the state's order).

    Eight leaves (a state pickled before ``absorbed_overflows`` existed) are completed with a
    zero, the value a new scaler starts from.
    """
    # NumPy leaves stand in for jax.Array: every amp_core function accepts them.
    given = [np.array(leaf) for leaf in leaves]
    missing = len(amp_core.LossScaleState._fields) - len(given)
    given += [np.zeros((), np.int32) for _ in range(missing)]
    return amp_core.LossScaleState(*(cast(jax.Array, leaf) for leaf in given))
