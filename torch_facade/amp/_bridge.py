"""Crossing between torch and JAX: DLPack conversion and the jitted per-step core."""

from __future__ import annotations

import functools
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import torch

import amp_core
from hardware.devices import jax_device_for


def to_jax(tensor: torch.Tensor) -> jax.Array:
    """Zero-copy import of a contiguous, 64-byte-aligned torch tensor."""
    return jax.dlpack.from_dlpack(tensor)


def to_torch(array: jax.Array) -> torch.Tensor:
    """Zero-copy export of a JAX array (waits until it is computed).

    Always a normal tensor, even when called under ``torch.inference_mode()``: the scaler keeps
    some of these (its scale) and a later ``scale(loss)`` saves them for backward.
    """
    with torch.inference_mode(False):
        return torch.from_dlpack(array)


def place_state(state: amp_core.LossScaleState, torch_device: torch.device) -> Any:
    """Moves the scaler state to the JAX device matching ``torch_device`` (no-op if there)."""
    device = jax_device_for(torch_device)
    if state.loss_scale.devices() == {device}:
        return state
    return jax.device_put(state, device)


class FacadeStep(NamedTuple):
    """The outputs of one jitted core call, still as JAX arrays.

    The five float32 numbers torch needs every step are packed into ``scalars`` so that they
    cross into torch with one DLPack export (see :class:`StepScalars`), not five.
    """

    next_state: amp_core.LossScaleState
    isfinite: jax.Array
    global_norm: jax.Array
    scalars: jax.Array  # float32[5], in the field order of StepScalars


class StepScalars(NamedTuple):
    """Torch views of :attr:`FacadeStep.scalars` (0-d float32 tensors, no copies)."""

    multiplier: torch.Tensor  # what this step's gradients are multiplied by
    grad_scale: torch.Tensor  # ``1 / multiplier``, for fused optimizers
    found_inf: torch.Tensor  # 1.0 on overflow, for fused optimizers
    loss_scale: torch.Tensor  # the next state's loss scale
    inverse_scale: torch.Tensor  # ``1 / loss_scale``


def _facade_step(
    config: amp_core.LossScaleConfig,
    unscaled: bool,
    state: amp_core.LossScaleState,
    flats: tuple[jax.Array, ...],
) -> FacadeStep:
    result = amp_core.check_and_update(config, state, flats, unscaled=unscaled)
    grad_scale, found_inf = amp_core.fused_optimizer_args(result)
    next_state = result.next_state
    scalars = jnp.stack(
        [
            result.multiplier,
            grad_scale,
            found_inf,
            next_state.loss_scale,
            amp_core.inverse_scale(next_state),
        ]
    )
    return FacadeStep(next_state, result.isfinite, result.global_norm, scalars)


def step_scalars(step: FacadeStep) -> StepScalars:
    """Waits for the core call and views its scalars from torch (one DLPack export)."""
    return StepScalars(*to_torch(step.scalars.block_until_ready()).unbind())


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
