"""The jitted cores the engine calls: every number of a decision comes out of ``amp_core`` here.

The cores only read gradients (they stay torch-owned: XLA could not write into them anyway) and
return one small array, the next carry (:mod:`~torch_facade.amp._engine._carry`), so no large
XLA output is ever allocated.
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp

import amp_core
from torch_facade.amp._engine import _core_cache, _spikes
from torch_facade.amp._engine._carry import Slot, pack, unpack


def _finish(
    config: amp_core.LossScaleConfig,
    state: amp_core.LossScaleState,
    sum_of_squares: jax.Array,
    optimizer_steps: jax.Array,
    consistent: jax.Array,
) -> jax.Array:
    next_state, scalars = _decide(config, state, sum_of_squares, optimizer_steps, consistent)
    return pack(next_state, jnp.stack([scalars[slot] for slot in sorted(scalars)]))


def _decide(
    config: amp_core.LossScaleConfig,
    state: amp_core.LossScaleState,
    sum_of_squares: jax.Array,
    optimizer_steps: jax.Array,
    consistent: jax.Array,
) -> tuple[amp_core.LossScaleState, dict[Slot, jax.Array]]:
    result = amp_core.check_sum_and_update(
        config, state, sum_of_squares, optimizer_steps=optimizer_steps
    )
    grad_scale, found_inf = amp_core.fused_optimizer_args(result)
    clip = amp_core.check_sum_of_squares(config, state, sum_of_squares, unscaled=True).multiplier
    next_state = result.next_state
    scalars = {
        Slot.MULTIPLIER: result.multiplier,
        Slot.GRAD_SCALE: grad_scale,
        Slot.FOUND_INF: found_inf,
        Slot.NEXT_LOSS_SCALE: next_state.loss_scale,
        Slot.UNSCALE: amp_core.inverse_scale(state),
        Slot.STALL_COUNT: next_state.overflows_at_min_scale.astype(jnp.float32),
        Slot.CONSISTENT: consistent.astype(jnp.float32),
        Slot.CLIP_MULTIPLIER: clip,
    }
    return next_state, scalars


def _finish_with_spikes(
    config: amp_core.DynamicLossScale,
    state: amp_core.LossScaleState,
    sum_of_squares: jax.Array,
    optimizer_steps: jax.Array,
    consistent: jax.Array,
    spikes: jax.Array,
    loss: jax.Array | None,
) -> tuple[jax.Array, jax.Array]:
    """:func:`_finish`, then :func:`amp_core.check_spike` on the norm (or the loss).

    A spike is skipped as an overflow is (``FOUND_INF`` is 1: the optimizers do not step) but it
    is not one: the scale and its counters stay as they were, and the state's ``isfinite`` says
    that the gradients were finite, as in the JAX door (the window's ``spiked`` says the rest).
    Returns the next carry and the next packed spike window.
    """
    spike_skip = config.spike_skip
    assert spike_skip is not None
    next_state, scalars = _decide(config, state, sum_of_squares, optimizer_steps, consistent)
    metric = next_state.global_norm if loss is None else loss
    spike, window = amp_core.check_spike(
        spike_skip, _spikes.unpack(spikes), metric, next_state.isfinite
    )
    kept = state._replace(isfinite=next_state.isfinite, global_norm=next_state.global_norm)
    next_state = jax.tree_util.tree_map(
        lambda old, new: jnp.where(spike, old, new), kept, next_state
    )
    scalars[Slot.FOUND_INF] = jnp.where(spike, jnp.float32(1.0), scalars[Slot.FOUND_INF])
    scalars[Slot.NEXT_LOSS_SCALE] = next_state.loss_scale
    scalars[Slot.STALL_COUNT] = next_state.overflows_at_min_scale.astype(jnp.float32)
    carry = pack(next_state, jnp.stack([scalars[slot] for slot in sorted(scalars)]))
    return carry, _spikes.pack(window)


def _local_step(
    config: amp_core.LossScaleConfig,
    branch_free: bool,
    carry: jax.Array,
    grads: tuple[jax.Array, ...],
    optimizer_steps: jax.Array,
) -> jax.Array:
    state = unpack(carry)
    inv = amp_core.inverse_scale(state)
    total = amp_core.sum_of_unscaled_squares(grads, inv, branch_free=branch_free)
    return _finish(config, state, total, optimizer_steps, jnp.asarray(True))


def _local_spike_step(
    config: amp_core.DynamicLossScale,
    branch_free: bool,
    carry: jax.Array,
    spikes: jax.Array,
    grads: tuple[jax.Array, ...],
    optimizer_steps: jax.Array,
    loss: jax.Array | None,
) -> tuple[jax.Array, jax.Array]:
    state = unpack(carry)
    inv = amp_core.inverse_scale(state)
    total = amp_core.sum_of_unscaled_squares(grads, inv, branch_free=branch_free)
    return _finish_with_spikes(
        config, state, total, optimizer_steps, jnp.asarray(True), spikes, _loss(loss)
    )


def _loss(loss: jax.Array | None) -> jax.Array | None:
    """The iteration's loss as a 0-d float32 (the sum of its elements, as ``scale`` kept it)."""
    return None if loss is None else jnp.sum(jnp.asarray(loss, jnp.float32))


def _partials(
    branch_free: bool,
    carry: jax.Array,
    sharded: tuple[jax.Array, ...],
    replicated: tuple[jax.Array, ...],
    loss: jax.Array | None = None,
) -> jax.Array:
    state = unpack(carry)
    inv = amp_core.inverse_scale(state)
    extra = [] if loss is None else [jnp.sum(jnp.asarray(loss, jnp.float32))]
    return jnp.stack(
        [
            amp_core.sum_of_unscaled_squares(sharded, inv, branch_free=branch_free),
            amp_core.sum_of_unscaled_squares(replicated, inv, branch_free=branch_free),
            *_fingerprint(state),
            *extra,
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
    replicas: int,
    carry: jax.Array,
    gathered: jax.Array,
    optimizer_steps: jax.Array,
) -> jax.Array:
    state = unpack(carry)
    total = amp_core.combine_partials(gathered[:, :2], replicas=replicas)
    consistent = jnp.all(gathered[:, 2:_PARTIALS] == jnp.stack(_fingerprint(state)))
    return _finish(config, state, total, optimizer_steps, consistent)


_PARTIALS = 5
"""Entries of a rank's partials before the loss (the two sums, then the fingerprint)."""


def _distributed_spike_step(
    config: amp_core.DynamicLossScale,
    replicas: int,
    carry: jax.Array,
    spikes: jax.Array,
    gathered: jax.Array,
    optimizer_steps: jax.Array,
) -> tuple[jax.Array, jax.Array]:
    state = unpack(carry)
    total = amp_core.combine_partials(gathered[:, :2], replicas=replicas)
    consistent = jnp.all(gathered[:, 2:_PARTIALS] == jnp.stack(_fingerprint(state)))
    # metric="loss": each rank's loss is its own batch's; the job's is their mean.
    loss = jnp.mean(gathered[:, _PARTIALS]) if gathered.shape[1] > _PARTIALS else None
    return _finish_with_spikes(config, state, total, optimizer_steps, consistent, spikes, loss)


def local_core(config: amp_core.LossScaleConfig, branch_free: bool = False) -> Any:
    """One process: read the gradients, decide, update. Compiles once per gradient structure.

    Called as ``core(carry, grads, optimizer_steps)``: the packed state (see :class:`Carry`),
    the gradients' JAX views, the optimizer step count; returns the next carry.

    ``branch_free``: no ``lax.cond`` inside (accelerators, where XLA would evaluate its
    predicate on the host; see :func:`amp_core.sum_of_unscaled_squares`).
    """
    return _local_core(config, branch_free)


@functools.cache
def _local_core(config: amp_core.LossScaleConfig, branch_free: bool) -> Any:
    jitted = jax.jit(functools.partial(_local_step, config, branch_free))
    return _core_cache.persistent(jitted, f"local branch_free={branch_free} {config!r}")


def partials_core(branch_free: bool = False) -> Any:
    """A distributed job's local half: this rank's sharded and replicated sums, and the scale and
    counters every rank must agree on (``float32[5]``), from ``(carry, sharded, replicated)``;
    given a fourth argument, this rank's loss, it is appended (``float32[6]``)."""
    return _partials_core(branch_free)


@functools.cache
def _partials_core(branch_free: bool) -> Any:
    return jax.jit(functools.partial(_partials, branch_free))


@functools.cache
def distributed_core(config: amp_core.LossScaleConfig, replicas: int = 1) -> Any:
    """A distributed job's finish, ``core(carry, gathered, optimizer_steps)``, from every rank's
    gathered partials (``float32[ranks, 5]``); returns the next carry. ``replicas``: the replica
    groups of an HSDP mesh, rows in replica-major order (``amp_core.combine_partials``)."""
    return jax.jit(functools.partial(_distributed_step, config, replicas))


def local_spike_core(config: amp_core.DynamicLossScale, branch_free: bool = False) -> Any:
    """:func:`local_core` for a configuration with ``spike_skip``.

    Called as ``core(carry, spikes, grads, optimizer_steps, loss)``: ``spikes`` the packed
    window (:mod:`~torch_facade.amp._engine._spikes`), ``loss`` the iteration's loss for
    ``SpikeSkip(metric="loss")`` (``None`` for the norm); returns ``(next carry, next spikes)``.
    """
    return _local_spike_core(config, branch_free)


@functools.cache
def _local_spike_core(config: amp_core.DynamicLossScale, branch_free: bool) -> Any:
    jitted = jax.jit(functools.partial(_local_spike_step, config, branch_free))
    return _core_cache.persistent(jitted, f"local spikes branch_free={branch_free} {config!r}")


@functools.cache
def distributed_spike_core(config: amp_core.DynamicLossScale, replicas: int = 1) -> Any:
    """:func:`distributed_core` for a configuration with ``spike_skip``:
    ``core(carry, spikes, gathered, optimizer_steps)`` -> ``(next carry, next spikes)``; with
    ``metric="loss"`` each rank's partials end with its loss (:func:`partials_core`)."""
    return jax.jit(functools.partial(_distributed_spike_step, config, replicas))


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
