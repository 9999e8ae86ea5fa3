"""Crossing between torch and JAX: DLPack conversion and the jitted per-step core."""

from __future__ import annotations

import functools
from typing import Any, NamedTuple

import jax
import torch

import amp_core
from hardware.devices import jax_device_for


def to_jax(tensor: torch.Tensor) -> jax.Array:
    """Zero-copy import of a contiguous, 64-byte-aligned torch tensor."""
    return jax.dlpack.from_dlpack(tensor)


def to_torch(array: jax.Array) -> torch.Tensor:
    """Zero-copy export of a JAX array (waits until it is computed)."""
    return torch.from_dlpack(array)


def place_state(state: amp_core.LossScaleState, torch_device: torch.device) -> Any:
    """Moves the scaler state to the JAX device matching ``torch_device`` (no-op if there)."""
    device = jax_device_for(torch_device)
    if state.loss_scale.devices() == {device}:
        return state
    return jax.device_put(state, device)


class FacadeStep(NamedTuple):
    """The outputs of one jitted core call, still as JAX arrays."""

    result: amp_core.StepResult
    grad_scale: jax.Array
    found_inf: jax.Array
    next_inverse_scale: jax.Array


def _facade_step(
    config: amp_core.LossScaleConfig,
    unscaled: bool,
    state: amp_core.LossScaleState,
    flats: tuple[jax.Array, ...],
) -> FacadeStep:
    result = amp_core.check_and_update(config, state, flats, unscaled=unscaled)
    grad_scale, found_inf = amp_core.fused_optimizer_args(result)
    next_inverse_scale = amp_core.inverse_scale(result.next_state)
    return FacadeStep(result, grad_scale, found_inf, next_inverse_scale)


@functools.cache
def step_core(config: amp_core.LossScaleConfig, unscaled: bool) -> Any:
    """The jitted core for one configuration; it compiles once per gradient structure.

    It only reads the gradients (they stay torch-owned: XLA could not write into them anyway)
    and returns a handful of scalars, so no large XLA output is ever allocated.
    """
    return jax.jit(functools.partial(_facade_step, config, unscaled))


@functools.cache
def _inverse_scale_core() -> Any:
    return jax.jit(amp_core.inverse_scale)


def inverse_scale(state: amp_core.LossScaleState) -> jax.Array:
    """``1 / loss_scale`` from amp_core, jitted."""
    return _inverse_scale_core()(state)
