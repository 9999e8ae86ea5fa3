"""The carry: the scaler state and one step's scalars, packed into one small int32 array.

A decision's core takes the state packed into one array and returns the next state packed the
same way followed by the step's scalars (:class:`Slot` says where each number sits): one
argument and one result instead of a pytree of nine arrays each way, since each JAX array a
call takes or makes costs host time (the call checks it, creates it, later frees it).
"""

from __future__ import annotations

import enum
import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import torch

import amp_core
from torch_facade.amp._engine import _crossing, _jax_guest
from torch_facade.amp._engine._dlpack import place_state, to_torch


class Slot(enum.IntEnum):
    """The position of every number in a carry: the state's fields, then the step's scalars.

    The state's entries hold a float as its bits and an integer or a bool as an int32; the
    scalars (float32, as bits) are what torch needs after a decision.
    """

    # The packed state, in amp_core.LossScaleState's field order.
    LOSS_SCALE = 0
    NON_CLAMPED_SCALE = 1
    STEPS_SINCE_RESCALE = 2
    OVERFLOWS_SINCE_RESCALE = 3
    NUM_SKIPPED_STEPS = 4
    ISFINITE = 5
    GLOBAL_NORM = 6
    OVERFLOWS_AT_MIN_SCALE = 7
    ABSORBED_OVERFLOWS = 8
    # The step's scalars.
    MULTIPLIER = 9  # what this step's gradients are multiplied by
    GRAD_SCALE = 10  # 1 / MULTIPLIER, for fused optimizers
    FOUND_INF = 11  # 1.0 on overflow, for fused optimizers
    NEXT_LOSS_SCALE = 12  # the next state's loss scale
    UNSCALE = 13  # 1 / loss_scale of the state that scaled these gradients
    STALL_COUNT = 14  # the next state's overflows_at_min_scale
    CONSISTENT = 15  # 1.0 unless the ranks disagreed on the loss scale (distributed)
    CLIP_MULTIPLIER = 16  # the multiplier for gradients unscaled already (GCC's clip)


STATE_SIZE = Slot.MULTIPLIER.value
"""Entries of a carry that hold the packed state (one per state field, in field order)."""

CARRY_SIZE = len(Slot)
"""Entries of a carry: the packed state, then the step's scalars."""

SCALAR_COUNT = CARRY_SIZE - STATE_SIZE

_STATE_SLOTS = tuple(Slot(i) for i in range(STATE_SIZE))
if tuple(s.name.lower() for s in _STATE_SLOTS) != amp_core.LossScaleState._fields:
    raise ImportError("Slot's state entries must follow amp_core.LossScaleState's fields")


def state_slot(name: str) -> Slot:
    """The slot of the :class:`amp_core.LossScaleState` field ``name``."""
    return Slot[name.upper()]


def pack(state: amp_core.LossScaleState, scalars: jax.Array) -> jax.Array:
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
    """:func:`pack` by NumPy, for a state of NumPy arrays (zeros for the scalars)."""
    fields = [
        leaf.view(np.int32) if leaf.dtype == np.float32 else leaf.astype(np.int32)
        for leaf in (np.asarray(leaf).reshape(()) for leaf in state)
    ]
    scalars = np.zeros(SCALAR_COUNT, np.int32)  # float32 zeros, as bits
    return np.concatenate([np.stack(fields), scalars])


def unpack(carry: jax.Array) -> amp_core.LossScaleState:
    """The state packed at the front of ``carry`` (the inverse of :func:`pack`)."""
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


# How each state entry of a carry reads: "float" as it is, "int" its bits as an int32, "bool"
# those bits as 0/1.
_KINDS = {
    slot: "float" if dtype == jnp.float32 else "bool" if dtype == jnp.bool_ else "int"
    for slot, dtype in zip(_STATE_SLOTS, _STATE_DTYPES, strict=True)
}


@functools.cache
def _pack_core() -> Any:
    return jax.jit(lambda state: pack(state, jnp.zeros(SCALAR_COUNT, jnp.float32)))


@functools.cache
def _unpack_core() -> Any:
    return jax.jit(unpack)


class Carry:
    """The scaler state between decisions, as the jitted cores read and write it.

    A decision's core takes the state packed into one int32 array (:data:`STATE_SIZE` entries,
    then :data:`SCALAR_COUNT` scalars it ignores) and returns the next state packed the same
    way, followed by the step's scalars (see :class:`Slot`).

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

    def field(self, slot: Slot) -> torch.Tensor:
        """The state entry at ``slot`` as a 0-d torch tensor of its dtype, over the carry's
        memory where it can be (a new tensor for the bool ``isfinite``); no JAX call when torch
        views the carry."""
        view = self._view
        if view is None:
            return to_torch(self.state[slot])
        kind = _KINDS[slot]
        if kind == "float":
            return view[slot]
        integer = view.view(torch.int32)[slot]
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


def exported_carry(carry: jax.Array, crossing: _crossing.Crossing) -> torch.Tensor:
    """Views a core's result from torch, as float32 (one DLPack export; ``float32[CARRY_SIZE]``:
    its float entries, the step's scalars among them, read as they are; its integer ones
    are bits, not numbers).

    No host wait on an accelerator: torch's stream waits for JAX's result on the device, so
    every torch kernel queued afterwards (the multiply, the fused step, a reuse of the gradients'
    memory) comes after the core's read. On the CPU the export returns once the result exists.
    """
    if torch.is_inference_mode_enabled():  # see to_torch
        with torch.inference_mode(False):
            return crossing.export(carry).view(torch.float32)
    return crossing.export(carry).view(torch.float32)
