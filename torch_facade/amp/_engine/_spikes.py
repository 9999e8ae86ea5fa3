"""The spike window of a scaler with ``spike_skip``: ``amp_core.SpikeState`` packed into one array.

A scaler built with ``GradScaler(spike_skip=cstorch.amp.SpikeSkip(...))`` keeps, beside its
carry (:mod:`~torch_facade.amp._engine._carry`), the rolling window of the metric of its last
applied steps. Like the carry it is one small int32 array on the gradients' JAX device, passed
into the jitted core and returned by it (the core calls :func:`amp_core.check_spike`); the
facade computes nothing of it. Layout: the ``window`` values (float32, as bits), then
``applied``, ``num_spike_skips``, ``spiked`` (0/1) and ``threshold`` (float32, as bits).

A scaler without ``spike_skip`` has no window and its cores never see one.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import torch

import amp_core
from torch_facade.amp._engine import _jax_guest
from torch_facade.amp._engine._dlpack import to_torch

TAIL = 4
"""Entries after the window values: applied, num_spike_skips, spiked, threshold."""

STATE_KEYS = ("spike_window", "spike_applied", "num_spike_skips")
"""The keys a checkpoint of a scaler with ``spike_skip`` holds beside the scaler's own."""


def pack(spikes: amp_core.SpikeState) -> jax.Array:
    """One int32 array from ``spikes`` (jittable; bit casts, so every value comes back exactly)."""
    return jnp.concatenate(
        [
            jax.lax.bitcast_convert_type(spikes.values.astype(jnp.float32), jnp.int32),
            jnp.stack(
                [
                    spikes.applied.astype(jnp.int32),
                    spikes.num_spike_skips.astype(jnp.int32),
                    spikes.spiked.astype(jnp.int32),
                    jax.lax.bitcast_convert_type(spikes.threshold.astype(jnp.float32), jnp.int32),
                ]
            ),
        ]
    )


def unpack(packed: jax.Array) -> amp_core.SpikeState:
    """The :class:`amp_core.SpikeState` packed in ``packed`` (the inverse of :func:`pack`)."""
    window = packed.shape[0] - TAIL
    return amp_core.SpikeState(
        values=jax.lax.bitcast_convert_type(packed[:window], jnp.float32),
        applied=packed[window],
        num_spike_skips=packed[window + 1],
        spiked=packed[window + 2] != 0,
        threshold=jax.lax.bitcast_convert_type(packed[window + 3], jnp.float32),
    )


def initial(spike_skip: amp_core.SpikeSkip) -> np.ndarray:
    """The packed empty window of ``spike_skip``, on the host (no JAX call)."""
    packed = np.zeros(spike_skip.window + TAIL, np.int32)
    packed[-1] = np.array(np.inf, np.float32).view(np.int32)
    return packed


class SpikeWindow:
    """One scaler's spike window, on the host until a decision places it.

    Args:
        spike_skip: the configuration.
        packed: the packed window on the host (a pickled scaler's); empty if ``None``.
    """

    __slots__ = ("_array", "_view", "device", "spike_skip")

    def __init__(self, spike_skip: amp_core.SpikeSkip, packed: Any = None) -> None:
        self.spike_skip = spike_skip
        self._array: Any = initial(spike_skip) if packed is None else np.array(packed, np.int32)
        if self._array.shape != (spike_skip.window + TAIL,):
            raise ValueError(
                f"a spike window of {spike_skip.window} values needs "
                f"{spike_skip.window + TAIL} packed entries; got shape {self._array.shape}"
            )
        self.device: torch.device | None = None
        self._view: torch.Tensor | None = None

    def packed_on(self, device: torch.device) -> jax.Array:
        """The packed window on the JAX device matching ``device`` (placed once)."""
        if self.device != device or isinstance(self._array, np.ndarray):
            self._array = jax.device_put(self._array, _jax_guest.jax_device_for(device))
            self.device = device
            self._view = None
        return self._array

    def adopt(self, packed: jax.Array, device: torch.device | None) -> None:
        """Adopts a core's result, on ``device``'s JAX device."""
        self._array = packed
        self.device = device
        self._view = None

    def _torch_view(self) -> torch.Tensor:
        if self._view is None:
            self._view = to_torch(self._array)
        return self._view

    def num_spike_skips(self) -> torch.Tensor:
        """Steps skipped as spikes so far: a new 0-d int64 tensor (no host synchronisation)."""
        return self._torch_view()[-3].to(torch.int64)

    def spiked(self) -> torch.Tensor:
        """Whether the last decided step was skipped as a spike: a new 0-d bool tensor."""
        return self._torch_view()[-2] != 0

    def host(self) -> np.ndarray:
        """A writable NumPy copy of the packed window (a host synchronisation on a device)."""
        return np.array(jax.device_get(self._array), np.int32)

    def state_dict(self) -> dict[str, torch.Tensor]:
        """The window for a checkpoint: ``spike_window`` (float32 ``[window]``),
        ``spike_applied`` and ``num_spike_skips`` (int64), exact (one host read)."""
        packed = self.host()
        window = self.spike_skip.window
        return {
            "spike_window": torch.from_numpy(packed[:window].view(np.float32).copy()),
            "spike_applied": torch.tensor(int(packed[window]), dtype=torch.int64),
            "num_spike_skips": torch.tensor(int(packed[window + 1]), dtype=torch.int64),
        }

    def load(self, state_dict: Mapping[str, Any]) -> None:
        """Loads the keys of :data:`STATE_KEYS` present in ``state_dict`` (absent keys keep
        their values); the window goes back on the host until the next decision.

        Raises:
            ValueError: a window of another length, a count out of range.
            TypeError: a value that is not numeric.
        """
        self.adopt_host(self.loaded(state_dict))

    def adopt_host(self, packed: np.ndarray) -> None:
        """Adopts a packed window on the host (from :meth:`loaded`)."""
        self._array = packed
        self.device = None
        self._view = None

    def loaded(self, state_dict: Mapping[str, Any]) -> np.ndarray:
        """The packed window :meth:`load` would adopt, checked, without adopting it."""
        packed = self.host()
        window = self.spike_skip.window
        if "spike_window" in state_dict:
            values = _numeric("spike_window", state_dict["spike_window"])
            if values.shape != (window,):
                raise ValueError(
                    f"spike_window must hold {window} values (SpikeSkip(window={window})); "
                    f"got shape {values.shape}"
                )
            packed[:window] = values.astype(np.float32).view(np.int32)
        for key, index in (("spike_applied", window), ("num_spike_skips", window + 1)):
            if key in state_dict:
                value = _numeric(key, state_dict[key])
                if value.shape != () or not float(value).is_integer():
                    raise ValueError(f"{key} must be a whole number; got {state_dict[key]!r}")
                if not 0 <= int(value) <= 2**30:
                    raise ValueError(f"{key} must be from 0 to 2**30; got {int(value)}")
                packed[index] = int(value)
        packed[window + 2] = 0  # no step decided since the load
        packed[window + 3] = np.array(np.inf, np.float32).view(np.int32)
        return packed


def _numeric(key: str, value: Any) -> np.ndarray:
    if isinstance(value, torch.Tensor):
        value = value.detach().cpu().numpy()
    array = np.asarray(value)
    if array.dtype == np.bool_ or not np.issubdtype(array.dtype, np.number):
        raise TypeError(f"{key} must be numeric; got {value!r}")
    return array
