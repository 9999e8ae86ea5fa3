"""Crossing between torch and JAX: DLPack conversion and the jitted cores the facade calls.

The cores only read gradients (they stay torch-owned: XLA could not write into them anyway) and
return a handful of scalars, so no large XLA output is ever allocated. Every number they return
comes from ``amp_core``.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import torch

import amp_core
from hardware.devices import jax_device_for


def to_jax(tensor: torch.Tensor) -> jax.Array:
    """Zero-copy import of one torch tensor (see :func:`import_tensors`)."""
    return _importer_for(tensor)(tensor)


def _public_import(tensor: torch.Tensor) -> jax.Array:
    """Import through the public DLPack API (any device).

    Zero-copy when the tensor is contiguous and 64-byte aligned; otherwise JAX copies.
    """
    return jax.dlpack.from_dlpack(tensor)


def _cpu_importer() -> Any:
    """The lower-level DLPack import under ``jax.dlpack.from_dlpack``, for CPU tensors.

    ``from_dlpack`` spends most of its ~90 us per tensor on device lookups, stream handling and a
    ``jnp.asarray``; the call below it takes ~7 us with ``torch.utils.dlpack.to_dlpack``. It is a
    private jaxlib function, so it is used only after a self-check on this jaxlib (same memory,
    same values), else the public API.
    """
    try:
        from jax._src.lib import _jax as jaxlib_ext

        convert = jaxlib_ext.dlpack_managed_tensor_to_buffer
        to_dlpack = torch.utils.dlpack.to_dlpack
        cpu = jax.devices("cpu")[0]
        kind = int(torch.utils.dlpack.DLDeviceType.kDLCPU)
    except Exception:
        return _public_import

    def importer(tensor: torch.Tensor) -> jax.Array:
        return convert(to_dlpack(tensor), cpu, None, None, kind)

    probe = torch.arange(16, dtype=torch.float32)
    return importer if _views_its_input(importer, probe, jax.Array) else _public_import


def _views_its_input(crossing: Any, probe: Any, result_type: type) -> bool:
    """Whether ``crossing(probe)`` (``probe``: float32 0..15) gives a ``result_type`` over the
    same memory with the same values: the self-check of a private jaxlib crossing."""
    try:
        result = crossing(probe)
        return (
            isinstance(result, result_type)
            and tuple(result.shape) == (16,)
            and str(result.dtype).endswith("float32")
            and _address(result) == _address(probe)
            and float(result.sum()) == 120.0
        )
    except Exception:
        return False


def _address(value: Any) -> int:
    if isinstance(value, torch.Tensor):
        return value.data_ptr()
    return value.unsafe_buffer_pointer()


@functools.cache
def _fast_cpu_import() -> Any:
    return _cpu_importer()


def import_tensors(tensors: Sequence[torch.Tensor]) -> tuple[jax.Array, ...]:
    """Imports gradients for one read by a jitted core, zero-copy where DLPack allows.

    On the CPU this uses the fast importer (about 7 us a tensor). Elsewhere the public API, which
    orders the read after torch's pending work on the device's stream.
    """
    if not tensors:
        return ()
    return tuple(map(_importer_for(tensors[0]), tensors))


def _importer_for(tensor: torch.Tensor) -> Any:
    return _fast_cpu_import() if tensor.device.type == "cpu" else _public_import


def to_torch(array: jax.Array) -> torch.Tensor:
    """Zero-copy export of a JAX array (waits until it is computed).

    Always a normal tensor, even when called under ``torch.inference_mode()``: the scaler keeps
    some of these (its scale) and a later ``scale(loss)`` saves them for backward.
    """
    if torch.is_inference_mode_enabled():
        with torch.inference_mode(False):
            return _export(array)
    return _export(array)


def _export(array: jax.Array) -> torch.Tensor:
    exporter = _fast_cpu_export()
    if exporter is not None and array.device.platform == "cpu":
        return exporter(array)
    return torch.from_dlpack(array)  # orders the read after JAX's work on the device's stream


def _cpu_exporter() -> Any:
    """The lower-level DLPack export under ``jax.Array.__dlpack__``, for CPU arrays, or None.

    ``torch.from_dlpack`` goes through ``__dlpack__``'s stream and version handling (about 10 us
    a call warm, 110 us right after a backward pass); the jaxlib call below it about 1.5 us
    warm. It is a private jaxlib function, so it is used only after a self-check on this
    jaxlib (same memory, same values).
    """
    try:
        from jax._src.lib import _jax as jaxlib_ext

        to_capsule = jaxlib_ext.buffer_to_dlpack_managed_tensor
        from_capsule = torch.utils.dlpack.from_dlpack
    except Exception:
        return None

    def exporter(array: jax.Array) -> torch.Tensor:
        return from_capsule(to_capsule(array))

    probe = jnp.arange(16, dtype=jnp.float32)
    return exporter if _views_its_input(exporter, probe, torch.Tensor) else None


@functools.cache
def _fast_cpu_export() -> Any:
    return _cpu_exporter()


def place_state(state: amp_core.LossScaleState, torch_device: torch.device) -> Any:
    """Moves the scaler state to the JAX device matching ``torch_device`` (no-op if there)."""
    device = jax_device_for(torch_device)
    if state.loss_scale.devices() == {device}:
        return state
    return jax.device_put(state, device)


class FacadeStep(NamedTuple):
    """The outputs of one decision, still as JAX arrays.

    The float32 numbers torch needs every step are packed into ``scalars`` so that they cross
    into torch with one DLPack export (see :class:`StepScalars`), not several.
    """

    next_state: amp_core.LossScaleState
    isfinite: jax.Array
    global_norm: jax.Array
    scalars: jax.Array  # float32[8], in the field order of StepScalars


class StepScalars(NamedTuple):
    """Torch views of :attr:`FacadeStep.scalars` (0-d float32 tensors, no copies)."""

    multiplier: torch.Tensor  # what this step's gradients are multiplied by
    grad_scale: torch.Tensor  # ``1 / multiplier``, for fused optimizers
    found_inf: torch.Tensor  # 1.0 on overflow, for fused optimizers
    loss_scale: torch.Tensor  # the next state's loss scale
    inverse_scale: torch.Tensor  # ``1 / loss_scale``
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
            amp_core.inverse_scale(next_state),
            next_state.overflows_at_min_scale.astype(jnp.float32),
            consistent.astype(jnp.float32),
            clip,
        ]
    )
    return FacadeStep(next_state, result.isfinite, result.global_norm, scalars)


def _local_step(
    config: amp_core.LossScaleConfig,
    state: amp_core.LossScaleState,
    grads: tuple[jax.Array, ...],
    optimizer_steps: jax.Array,
) -> FacadeStep:
    total = amp_core.sum_of_unscaled_squares(grads, amp_core.inverse_scale(state))
    return _finish(config, state, total, optimizer_steps, jnp.asarray(True))


def _partials(
    state: amp_core.LossScaleState,
    sharded: tuple[jax.Array, ...],
    replicated: tuple[jax.Array, ...],
) -> jax.Array:
    inv = amp_core.inverse_scale(state)
    return jnp.stack(
        [
            amp_core.sum_of_unscaled_squares(sharded, inv),
            amp_core.sum_of_unscaled_squares(replicated, inv),
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


@functools.cache
def local_core(config: amp_core.LossScaleConfig) -> Any:
    """One process: read the gradients, decide, update. Compiles once per gradient structure."""
    return jax.jit(functools.partial(_local_step, config))


@functools.cache
def partials_core() -> Any:
    """A distributed job's local half: this rank's sharded and replicated sums, and the scale and
    counters every rank must agree on (``float32[5]``)."""
    return jax.jit(_partials)


@functools.cache
def distributed_core(config: amp_core.LossScaleConfig) -> Any:
    """A distributed job's finish, from every rank's gathered partials (``float32[ranks, 5]``)."""
    return jax.jit(functools.partial(_distributed_step, config))


def step_scalars(step: FacadeStep) -> StepScalars:
    """Waits for the core call and views its scalars from torch (one DLPack export)."""
    return StepScalars(*to_torch(step.scalars.block_until_ready()).unbind())


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
