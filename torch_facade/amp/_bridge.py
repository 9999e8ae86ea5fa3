"""Crossing between torch and JAX: DLPack conversion and the jitted cores the facade calls.

The cores only read gradients (they stay torch-owned: XLA could not write into them anyway) and
return a handful of scalars, so no large XLA output is ever allocated. Every number they return
comes from ``amp_core``.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any, NamedTuple, cast

import jax
import jax.numpy as jnp
import numpy as np
import torch

import amp_core
from torch_facade.amp import _crossing, _crossing_cpu, _crossing_cuda, _crossing_public, _jax_guest


def crossing_for(device: torch.device) -> _crossing.Crossing:
    """The crossing for tensors on ``device`` (:mod:`~torch_facade.amp._crossing`), chosen once
    per device after the private variants' self-checks; JAX is started as a guest first."""
    return _chosen_crossing(device)


@functools.cache
def _chosen_crossing(device: torch.device) -> _crossing.Crossing:
    if device.type == "cpu":
        _jax_guest.start(device)
        return _crossing_cpu.crossing() or _crossing_public.crossing(host_is_device=True)
    jax_device = _jax_guest.jax_device_for(device)  # a clear error when JAX has no such device
    if device.type == "cuda":
        chosen = _crossing_cuda.crossing(device, jax_device)
        return chosen or _crossing_public.crossing(host_is_device=False)
    return _crossing_public.crossing(host_is_device=False)


def to_jax(tensor: torch.Tensor) -> jax.Array:
    """Zero-copy import of one torch tensor (see :func:`import_tensors`)."""
    return crossing_for(tensor.device).import_many([tensor])[0]


def import_tensors(tensors: Sequence[torch.Tensor]) -> tuple[jax.Array, ...]:
    """Imports tensors of one device for a read by a jitted core, zero-copy where DLPack allows.

    Through the crossing of their device (:mod:`~torch_facade.amp._crossing`): ordered after
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
    return _crossing_public.export(array)  # orders torch's stream after JAX's work


_CPU = torch.device("cpu")


def place_state(state: amp_core.LossScaleState, torch_device: torch.device) -> Any:
    """Moves the scaler state to the JAX device matching ``torch_device`` (no-op if there).

    A state not placed yet (NumPy arrays, :func:`amp_core.init_on_host`) is put there; JAX is
    started as a guest first if nothing has started it (:mod:`~torch_facade.amp._jax_guest`).
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
    """A state of writable NumPy copies of ``leaves`` (host values, in the state's order)."""
    # NumPy leaves stand in for jax.Array: every amp_core function accepts them.
    return amp_core.LossScaleState(*(cast(jax.Array, np.array(leaf)) for leaf in leaves))


class FacadeStep(NamedTuple):
    """The outputs of one decision, still as JAX arrays.

    The float32 numbers torch needs every step are packed into ``scalars`` so that they cross
    into torch with one DLPack export (see :class:`StepScalars`), not several. The step's flag
    and norm are the next state's (amp_core records them there), not outputs of their own: each
    output is an array to create on every call.
    """

    next_state: amp_core.LossScaleState
    scalars: jax.Array  # float32[8], in the field order of StepScalars

    @property
    def isfinite(self) -> jax.Array:
        """Whether this step's gradients were finite (0-d bool)."""
        return self.next_state.isfinite

    @property
    def global_norm(self) -> jax.Array:
        """The global L2 norm of this step's unscaled gradients (0-d float32)."""
        return self.next_state.global_norm


class StepScalars(NamedTuple):
    """Torch views of :attr:`FacadeStep.scalars` (0-d float32 tensors, no copies)."""

    multiplier: torch.Tensor  # what this step's gradients are multiplied by
    grad_scale: torch.Tensor  # ``1 / multiplier``, for fused optimizers
    found_inf: torch.Tensor  # 1.0 on overflow, for fused optimizers
    loss_scale: torch.Tensor  # the next state's loss scale
    unscale: torch.Tensor  # ``1 / loss_scale`` of the state that scaled these gradients
    overflows_at_min_scale: torch.Tensor  # the next state's stall counter
    consistent: torch.Tensor  # 1.0 unless ranks disagreed on the loss scale (distributed)
    clip_multiplier: torch.Tensor  # the multiplier for gradients unscaled already (GCC's clip)


def _finish(
    config: amp_core.LossScaleConfig,
    state: amp_core.LossScaleState,
    sum_of_squares: jax.Array,
    optimizer_steps: jax.Array,
    consistent: jax.Array,
) -> FacadeStep:
    result = amp_core.check_sum_and_update(
        config, state, sum_of_squares, optimizer_steps=optimizer_steps
    )
    grad_scale, found_inf = amp_core.fused_optimizer_args(result)
    clip = amp_core.check_sum_of_squares(config, state, sum_of_squares, unscaled=True).multiplier
    next_state = result.next_state
    scalars = jnp.stack(
        [
            result.multiplier,
            grad_scale,
            found_inf,
            next_state.loss_scale,
            amp_core.inverse_scale(state),
            next_state.overflows_at_min_scale.astype(jnp.float32),
            consistent.astype(jnp.float32),
            clip,
        ]
    )
    return FacadeStep(next_state, scalars)


def _local_step(
    config: amp_core.LossScaleConfig,
    branch_free: bool,
    state: amp_core.LossScaleState,
    grads: tuple[jax.Array, ...],
    optimizer_steps: jax.Array,
) -> FacadeStep:
    inv = amp_core.inverse_scale(state)
    total = amp_core.sum_of_unscaled_squares(grads, inv, branch_free=branch_free)
    return _finish(config, state, total, optimizer_steps, jnp.asarray(True))


def _partials(
    branch_free: bool,
    state: amp_core.LossScaleState,
    sharded: tuple[jax.Array, ...],
    replicated: tuple[jax.Array, ...],
) -> jax.Array:
    inv = amp_core.inverse_scale(state)
    return jnp.stack(
        [
            amp_core.sum_of_unscaled_squares(sharded, inv, branch_free=branch_free),
            amp_core.sum_of_unscaled_squares(replicated, inv, branch_free=branch_free),
            *_fingerprint(state),
        ]
    )


def _fingerprint(state: amp_core.LossScaleState) -> list[jax.Array]:
    """What every rank's scaler must agree on before a joint decision (as float32)."""
    return [
        state.loss_scale,
        state.steps_since_rescale.astype(jnp.float32),
        state.overflows_since_rescale.astype(jnp.float32),
    ]


def _distributed_step(
    config: amp_core.LossScaleConfig,
    state: amp_core.LossScaleState,
    gathered: jax.Array,
    optimizer_steps: jax.Array,
) -> FacadeStep:
    total = amp_core.combine_partials(gathered[:, :2])
    consistent = jnp.all(gathered[:, 2:] == jnp.stack(_fingerprint(state)))
    return _finish(config, state, total, optimizer_steps, consistent)


def local_core(config: amp_core.LossScaleConfig, branch_free: bool = False) -> Any:
    """One process: read the gradients, decide, update. Compiles once per gradient structure.

    ``branch_free``: no ``lax.cond`` inside (accelerators, where XLA would evaluate its
    predicate on the host; see :func:`amp_core.sum_of_unscaled_squares`).
    """
    return _local_core(config, branch_free)


@functools.cache
def _local_core(config: amp_core.LossScaleConfig, branch_free: bool) -> Any:
    return jax.jit(functools.partial(_local_step, config, branch_free))


def partials_core(branch_free: bool = False) -> Any:
    """A distributed job's local half: this rank's sharded and replicated sums, and the scale and
    counters every rank must agree on (``float32[5]``)."""
    return _partials_core(branch_free)


@functools.cache
def _partials_core(branch_free: bool) -> Any:
    return jax.jit(functools.partial(_partials, branch_free))


@functools.cache
def distributed_core(config: amp_core.LossScaleConfig) -> Any:
    """A distributed job's finish, from every rank's gathered partials (``float32[ranks, 5]``)."""
    return jax.jit(functools.partial(_distributed_step, config))


def packed_scalars(step: FacadeStep, crossing: _crossing.Crossing) -> torch.Tensor:
    """Views the core call's packed scalars from torch (one DLPack export; ``float32[8]`` in
    the field order of :class:`StepScalars`).

    No host wait on an accelerator: torch's stream waits for JAX's result on the device, so
    every torch kernel queued afterwards (the multiply, the fused step, a reuse of the gradients'
    memory) comes after the core's read. On the CPU the export returns once the result exists.
    """
    return _normal_tensor(crossing.export, step.scalars)


@functools.cache
def _inverse_scale_core() -> Any:
    return jax.jit(amp_core.inverse_scale)


def inverse_scale(state: amp_core.LossScaleState) -> jax.Array:
    """``1 / loss_scale`` from amp_core, jitted."""
    return _inverse_scale_core()(state)


@functools.cache
def _recount_core() -> Any:
    return jax.jit(amp_core.recount_skipped_steps)


def recount_skipped_steps(
    previous: amp_core.LossScaleState, state: amp_core.LossScaleState, optimizer_steps: int
) -> amp_core.LossScaleState:
    """``amp_core.recount_skipped_steps``, jitted (the step count is data: no recompiles)."""
    steps = jax.device_put(jnp.int32(optimizer_steps), next(iter(state.loss_scale.devices())))
    return _recount_core()(previous, state, steps)


@functools.cache
def report_core() -> Any:
    """``amp_core.nonfinite_report``, jitted (diagnostics only; never on the hot path)."""
    return jax.jit(amp_core.nonfinite_report)
