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
import numpy as np

import amp_core
from torch_facade.amp._engine import _core_cache, _spikes
from torch_facade.amp._engine._carry import Slot, pack, unpack


def _finish(
    config: amp_core.LossScaleConfig,
    state: amp_core.LossScaleState,
    sum_of_squares: jax.Array,
    optimizer_steps: jax.Array,
    disagreement: jax.typing.ArrayLike,
) -> jax.Array:
    next_state, scalars = _decide(config, state, sum_of_squares, optimizer_steps, disagreement)
    return pack(next_state, jnp.stack([scalars[slot] for slot in sorted(scalars)]))


def _decide(
    config: amp_core.LossScaleConfig,
    state: amp_core.LossScaleState,
    sum_of_squares: jax.Array,
    optimizer_steps: jax.Array,
    disagreement: jax.typing.ArrayLike,
) -> tuple[amp_core.LossScaleState, dict[Slot, jax.Array]]:
    """amp_core's decision and the step's scalars; ``disagreement``: what the ranks disagreed
    on (:func:`_disagreement`; 0 in one process)."""
    mask = jnp.asarray(disagreement, jnp.int32)
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
        Slot.CONSISTENT: jnp.where(mask == 0, jnp.float32(1.0), -mask.astype(jnp.float32)),
        Slot.CLIP_MULTIPLIER: clip,
    }
    return next_state, scalars


def _finish_with_spikes(
    config: amp_core.DynamicLossScale,
    state: amp_core.LossScaleState,
    sum_of_squares: jax.Array,
    optimizer_steps: jax.Array,
    disagreement: jax.typing.ArrayLike,
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
    next_state, scalars = _decide(config, state, sum_of_squares, optimizer_steps, disagreement)
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
    return _finish(config, state, total, optimizer_steps, _AGREED)


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
    return _finish_with_spikes(config, state, total, optimizer_steps, _AGREED, spikes, _loss(loss))


def _loss(loss: jax.Array | None) -> jax.Array | None:
    """The iteration's loss as a 0-d float32 (the sum of its elements, as ``scale`` kept it)."""
    return None if loss is None else jnp.sum(jnp.asarray(loss, jnp.float32))


def _partials(
    branch_free: bool,
    carry: jax.Array,
    spikes: jax.Array | None,
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
            *_fingerprint(state, spikes),
            *extra,
        ]
    )


_AGREED = np.int32(0)
"""The disagreement of one process with itself: none (NumPy: importing starts no JAX backend)."""

_FINGERPRINT_PARTS = (
    (slice(0, 3), 1, "the loss scale or its counters"),
    (slice(3, 4), 2, "the overflows hysteresis absorbed (absorbed_overflows)"),
    (slice(4, 6), 4, "the spike window (spike_window, spike_applied, num_spike_skips)"),
)
"""The fingerprint's parts (:func:`_fingerprint`): its entries, the bit a disagreement on them
sets in :func:`_disagreement`'s mask, and what the error names."""


def _fingerprint(state: amp_core.LossScaleState, spikes: jax.Array | None) -> list[jax.Array]:
    """What every rank's scaler must agree on before a joint decision, as float32: the loss
    scale, its two counters, the overflows hysteresis absorbed, and the two halves of a digest
    of the spike window (zeros without one)."""
    return [
        state.loss_scale,
        state.steps_since_rescale.astype(jnp.float32),
        state.overflows_since_rescale.astype(jnp.float32),
        state.absorbed_overflows.astype(jnp.float32),
        *_window_digest(spikes),
    ]


def _window_digest(spikes: jax.Array | None) -> list[jax.Array]:
    """A 32-bit checksum of a packed spike window's values, ``applied`` and ``num_spike_skips``
    (:mod:`~torch_facade.amp._engine._spikes`; not the last step's ``spiked`` and
    ``threshold``, which a load resets), as two float32 halves of 16 bits, each exact.

    The checksum is ``sum(mix(bits[i] ^ salt[i])) mod 2**32`` over the entries' bits, ``salt``
    a different constant per position and ``mix`` a bijection of 32-bit words that spreads
    every bit over all of them (MurmurHash3's finaliser): two windows that differ in any one
    entry (a value, the ring's position, a count) always differ in it; windows that differ in
    several collide with a chance of about ``2**-32``, whatever their values' bit patterns.
    """
    if spikes is None:
        return [jnp.float32(0.0), jnp.float32(0.0)]
    kept = spikes.shape[0] - _spikes.TAIL + 2  # the values, applied, num_spike_skips
    bits = jax.lax.bitcast_convert_type(spikes[:kept], jnp.uint32)
    salt = jnp.arange(kept, dtype=jnp.uint32) * jnp.uint32(0x9E3779B9)
    digest = jnp.sum(_mix(bits ^ salt), dtype=jnp.uint32)
    return [
        (digest >> jnp.uint32(16)).astype(jnp.float32),
        (digest & jnp.uint32(0xFFFF)).astype(jnp.float32),
    ]


def _mix(words: jax.Array) -> jax.Array:
    """MurmurHash3's 32-bit finaliser, element-wise: a bijection of ``uint32`` words (each
    step, a shift-xor or a multiplication by an odd constant, is invertible)."""
    words = words ^ (words >> jnp.uint32(16))
    words = words * jnp.uint32(0x85EBCA6B)
    words = words ^ (words >> jnp.uint32(13))
    words = words * jnp.uint32(0xC2B2AE35)
    return words ^ (words >> jnp.uint32(16))


_PARTIALS = 8
"""Entries of a rank's partials before the loss (the two sums, then the fingerprint)."""


def _disagreement(
    gathered: jax.Array, state: amp_core.LossScaleState, spikes: jax.Array | None
) -> jax.Array:
    """A mask of the fingerprint's parts on which some rank's gathered partials differ from this
    rank's state (0 when every rank agrees; bits of :data:`_FINGERPRINT_PARTS`)."""
    same = gathered[:, 2:_PARTIALS] == jnp.stack(_fingerprint(state, spikes))
    mask = jnp.zeros((), jnp.int32)
    for entries, bit, _ in _FINGERPRINT_PARTS:
        mask = mask | jnp.where(jnp.all(same[:, entries]), jnp.int32(0), jnp.int32(bit))
    return mask


def disagreement_text(code: float) -> str:
    """What the ranks disagreed on, from a decision's ``CONSISTENT`` scalar (``-mask``)."""
    mask = int(-code) if code < 0 else 0
    parts = [text for _, bit, text in _FINGERPRINT_PARTS if mask & bit]
    return " and ".join(parts) or "their state"


def _distributed_step(
    config: amp_core.LossScaleConfig,
    replicas: int,
    carry: jax.Array,
    gathered: jax.Array,
    optimizer_steps: jax.Array,
) -> jax.Array:
    state = unpack(carry)
    total = amp_core.combine_partials(gathered[:, :2], replicas=replicas)
    disagreement = _disagreement(gathered, state, None)
    return _finish(config, state, total, optimizer_steps, disagreement)


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
    disagreement = _disagreement(gathered, state, spikes)
    # metric="loss": each rank's loss is its own batch's; the job's is their mean.
    loss = jnp.mean(gathered[:, _PARTIALS]) if gathered.shape[1] > _PARTIALS else None
    return _finish_with_spikes(config, state, total, optimizer_steps, disagreement, spikes, loss)


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
    """A distributed job's local half: this rank's sharded and replicated sums, and the
    fingerprint of the state every rank must agree on (:func:`_fingerprint`: the scale, its
    counters, the absorbed overflows, a digest of the spike window; ``float32[8]`` in all),
    from ``(carry, spikes, sharded, replicated)`` (``spikes`` the packed spike window, or
    ``None`` without ``spike_skip``); given a fifth argument, this rank's loss, it is appended
    (``float32[9]``)."""
    return _partials_core(branch_free)


@functools.cache
def _partials_core(branch_free: bool) -> Any:
    return jax.jit(functools.partial(_partials, branch_free))


@functools.cache
def distributed_core(config: amp_core.LossScaleConfig, replicas: int = 1) -> Any:
    """A distributed job's finish, ``core(carry, gathered, optimizer_steps)``, from every rank's
    gathered partials (``float32[ranks, 8]``); returns the next carry, whose ``CONSISTENT``
    scalar is 1 where every rank's fingerprint is this rank's, else minus a mask of the parts
    that differ (:func:`disagreement_text` names them). ``replicas``: the replica
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
