"""Crossing between torch and JAX: DLPack conversion and the jitted cores the facade calls.

The cores only read gradients (they stay torch-owned: XLA could not write into them anyway) and
return one small array, the next scaler state packed with a handful of scalars (:class:`Carry`),
so no large XLA output is ever allocated. Every number they return comes from ``amp_core``.
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
from torch_facade.amp._engine import (
    _core_cache,
    _crossing,
    _crossing_cpu,
    _crossing_cuda,
    _crossing_public,
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
    return _crossing_public.export(array)  # orders torch's stream after JAX's work


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
    """A state of writable NumPy copies of ``leaves`` (host values, in the state's order)."""
    # NumPy leaves stand in for jax.Array: every amp_core function accepts them.
    return amp_core.LossScaleState(*(cast(jax.Array, np.array(leaf)) for leaf in leaves))


class StepScalars(NamedTuple):
    """The float32 numbers torch needs after a decision, in their order in a carry (after the
    packed state, see :class:`Carry`); :func:`scalar_index` gives their positions."""

    multiplier: float  # what this step's gradients are multiplied by
    grad_scale: float  # ``1 / multiplier``, for fused optimizers
    found_inf: float  # 1.0 on overflow, for fused optimizers
    loss_scale: float  # the next state's loss scale
    unscale: float  # ``1 / loss_scale`` of the state that scaled these gradients
    overflows_at_min_scale: float  # the next state's stall counter
    consistent: float  # 1.0 unless ranks disagreed on the loss scale (distributed)
    clip_multiplier: float  # the multiplier for gradients unscaled already (GCC's clip)


STATE_SIZE = len(amp_core.LossScaleState._fields)
"""Entries of a carry that hold the packed state (one per state field, in field order)."""

CARRY_SIZE = STATE_SIZE + len(StepScalars._fields)
"""Entries of a carry: the packed state, then the step's scalars."""


_SCALAR_INDEX = {name: STATE_SIZE + i for i, name in enumerate(StepScalars._fields)}


def scalar_index(name: str) -> int:
    """Position of a :class:`StepScalars` field in a carry."""
    return _SCALAR_INDEX[name]


def state_index(name: str) -> int:
    """Position of an :class:`amp_core.LossScaleState` field in a carry."""
    return _FIELD_KINDS[name][0]


def _pack(state: amp_core.LossScaleState, scalars: jax.Array) -> jax.Array:
    """One int32 array: each state field (a float as its bits, a bool as 0/1), then
    ``scalars`` (float32) as their bits. Bit casts, not conversions: every value comes back
    exactly (counters beyond 2**24, denormal norms)."""
    fields = [
        jax.lax.bitcast_convert_type(leaf, jnp.int32)
        if leaf.dtype == jnp.float32
        else leaf.astype(jnp.int32)
        for leaf in (jnp.asarray(leaf) for leaf in state)
    ]
    return jnp.concatenate([jnp.stack(fields), jax.lax.bitcast_convert_type(scalars, jnp.int32)])


def _readable_on_host(leaf: Any) -> bool:
    """Whether NumPy reads ``leaf`` with no device transfer (a NumPy array, a JAX CPU array)."""
    if isinstance(leaf, np.ndarray):
        return True
    devices = getattr(leaf, "devices", None)
    return devices is not None and all(d.platform == "cpu" for d in devices())


def _pack_on_host(state: amp_core.LossScaleState) -> np.ndarray:
    """:func:`_pack` by NumPy, for a state of NumPy arrays (zeros for the scalars)."""
    fields = [
        leaf.view(np.int32) if leaf.dtype == np.float32 else leaf.astype(np.int32)
        for leaf in (np.asarray(leaf).reshape(()) for leaf in state)
    ]
    scalars = np.zeros(len(StepScalars._fields), np.int32)  # float32 zeros, as bits
    return np.concatenate([np.stack(fields), scalars])


def _unpack(carry: jax.Array) -> amp_core.LossScaleState:
    """The state packed at the front of ``carry`` (the inverse of :func:`_pack`)."""
    floats = jax.lax.bitcast_convert_type(carry[:STATE_SIZE], jnp.float32)
    leaves = []
    for index, dtype in enumerate(_STATE_DTYPES):
        if dtype == jnp.float32:
            leaves.append(floats[index])
        elif dtype == jnp.bool_:
            leaves.append(carry[index] != 0)
        else:
            leaves.append(carry[index].astype(dtype))
    return amp_core.LossScaleState(*leaves)


_STATE_DTYPES = tuple(
    jnp.dtype(leaf.dtype) for leaf in amp_core.init_on_host(amp_core.DynamicLossScale())
)


# Per state field: its position in a carry and how its entry reads ("float": as it is;
# "int": its bits as an int32; "bool": those bits as 0/1).
_FIELD_KINDS = {
    name: (index, "float" if dtype == jnp.float32 else "bool" if dtype == jnp.bool_ else "int")
    for index, (name, dtype) in enumerate(
        zip(amp_core.LossScaleState._fields, _STATE_DTYPES, strict=True)
    )
}


@functools.cache
def _pack_core() -> Any:
    return jax.jit(lambda state: _pack(state, jnp.zeros(len(StepScalars._fields), jnp.float32)))


@functools.cache
def _unpack_core() -> Any:
    return jax.jit(_unpack)


class Carry:
    """The scaler state between decisions, as the jitted cores read and write it.

    A decision's core takes the state packed into one int32 array (:data:`STATE_SIZE` entries,
    then :data:`CARRY_SIZE` - :data:`STATE_SIZE` of scalars it ignores) and returns the next
    state packed the same way, followed by the step's :class:`StepScalars`: one argument and one
    result instead of a pytree of eight arrays each way. Each JAX array a call takes or makes
    costs host time (the call checks it, creates it, later frees it), several microseconds
    each when the call runs in a training loop's cold caches.

    A carry holds a :class:`amp_core.LossScaleState`, or a packed array, or both; the other is
    made when first asked for (unpacking is a jitted call, for checkpoints, pickling and the
    rare recount, never on a steady iteration; the accessors read torch's view instead).

    Args:
        state: the state (on the host, or on ``device``'s JAX device).
        packed: the packed state (a core's result, on ``device``'s JAX device).
        device: the torch device whose JAX device ``state`` or ``packed`` is on (``None`` for
            a state on the host).
        view: torch's float32 view of ``packed`` (:func:`exported_carry`), if there is one:
            :meth:`field` then reads from it.
    """

    __slots__ = ("_packed", "_state", "_view", "device")

    def __init__(
        self,
        state: amp_core.LossScaleState | None = None,
        packed: jax.Array | None = None,
        device: torch.device | None = None,
        view: torch.Tensor | None = None,
    ) -> None:
        if state is None and packed is None:
            raise ValueError("a Carry needs a state or a packed state")
        self._state = state
        self._packed = packed
        self.device = device
        self._view = view

    def field(self, name: str) -> torch.Tensor:
        """One state field as a 0-d torch tensor of its dtype, over the carry's memory where it
        can be (a new tensor for the bool ``isfinite``); no JAX call when torch views the carry.
        """
        view = self._view
        if view is None:
            return to_torch(getattr(self.state, name))
        index, kind = _FIELD_KINDS[name]
        if kind == "float":
            return view[index]
        integer = view.view(torch.int32)[index]
        return integer != 0 if kind == "bool" else integer

    @property
    def state(self) -> amp_core.LossScaleState:
        """The state as a :class:`amp_core.LossScaleState` (unpacked once, when first asked)."""
        if self._state is None:
            self._state = _unpack_core()(self._packed)
        return self._state

    def packed_on(self, device: torch.device) -> jax.Array:
        """The packed state on the JAX device matching ``device`` (packed and placed once).

        A state on the host (a new scaler's, a loaded one) or on JAX's CPU is packed by NumPy,
        with no jitted call: that would compile once per process, in the first iteration.
        """
        if self._packed is None or self.device != device:
            state = self.state
            if all(_readable_on_host(leaf) for leaf in state):
                jax_device = _jax_guest.jax_device_for(device)
                self._packed = jax.device_put(_pack_on_host(state), jax_device)
                self._state = place_state(state, device)
            else:
                self._state = place_state(state, device)
                self._packed = _pack_core()(self._state)
            self.device = device
        return self._packed


def _finish(
    config: amp_core.LossScaleConfig,
    state: amp_core.LossScaleState,
    sum_of_squares: jax.Array,
    optimizer_steps: jax.Array,
    consistent: jax.Array,
) -> jax.Array:
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
    return _pack(next_state, scalars)


def _local_step(
    config: amp_core.LossScaleConfig,
    branch_free: bool,
    carry: jax.Array,
    grads: tuple[jax.Array, ...],
    optimizer_steps: jax.Array,
) -> jax.Array:
    state = _unpack(carry)
    inv = amp_core.inverse_scale(state)
    total = amp_core.sum_of_unscaled_squares(grads, inv, branch_free=branch_free)
    return _finish(config, state, total, optimizer_steps, jnp.asarray(True))


def _partials(
    branch_free: bool,
    carry: jax.Array,
    sharded: tuple[jax.Array, ...],
    replicated: tuple[jax.Array, ...],
) -> jax.Array:
    state = _unpack(carry)
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
    carry: jax.Array,
    gathered: jax.Array,
    optimizer_steps: jax.Array,
) -> jax.Array:
    state = _unpack(carry)
    total = amp_core.combine_partials(gathered[:, :2])
    consistent = jnp.all(gathered[:, 2:] == jnp.stack(_fingerprint(state)))
    return _finish(config, state, total, optimizer_steps, consistent)


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
    counters every rank must agree on (``float32[5]``), from ``(carry, sharded, replicated)``."""
    return _partials_core(branch_free)


@functools.cache
def _partials_core(branch_free: bool) -> Any:
    return jax.jit(functools.partial(_partials, branch_free))


@functools.cache
def distributed_core(config: amp_core.LossScaleConfig) -> Any:
    """A distributed job's finish, ``core(carry, gathered, optimizer_steps)``, from every rank's
    gathered partials (``float32[ranks, 5]``); returns the next carry."""
    return jax.jit(functools.partial(_distributed_step, config))


def exported_carry(carry: jax.Array, crossing: _crossing.Crossing) -> torch.Tensor:
    """Views a core's result from torch, as float32 (one DLPack export; ``float32[CARRY_SIZE]``:
    its float entries, the :class:`StepScalars` among them, read as they are; its integer ones
    are bits, not numbers).

    No host wait on an accelerator: torch's stream waits for JAX's result on the device, so
    every torch kernel queued afterwards (the multiply, the fused step, a reuse of the gradients'
    memory) comes after the core's read. On the CPU the export returns once the result exists.
    """
    if torch.is_inference_mode_enabled():  # see to_torch
        with torch.inference_mode(False):
            return crossing.export(carry).view(torch.float32)
    return crossing.export(carry).view(torch.float32)


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
