"""The CUDA crossing: one event and wait per decision, the lower-level import per tensor.

The public ``jax.dlpack.from_dlpack`` costs, per tensor, a device lookup, a stream lookup, an event
recorded on torch's stream and waited for by JAX's external-ready stream, and a ``jnp.asarray``.
Here the waiting is done once per decision, for all the tensors: JAX's external-ready stream
waits on one event recorded on torch's current stream (``Stream.wait_stream``), then each tensor
goes through ``torch.utils.dlpack.to_dlpack`` (no stream work) and jaxlib's
``dlpack_managed_tensor_to_buffer`` on that stream, which records the buffer's ready event there.
JAX's computation waits for those events on the device; the host never waits.

Views whose data pointer XLA:GPU would reject (it checks the alignment of entry parameters) are
copied first, on torch's stream, before the event is recorded. Everything runs under a device
guard: torch refuses DLPack for a tensor that is not on the current CUDA device.

Private jaxlib calls, so the whole path is used only after its self-check on this device: a probe
written by torch behind a queued device sleep must reach JAX with its new values (the ordering),
over the same memory; JAX's result must reach torch likewise. Not yet run on a GPU (see
"Sharing a GPU with torch" in docs/gpus.md).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import torch

from torch_facade.amp._engine import _crossing_dlpack, _storage
from torch_facade.amp._engine._crossing import Crossing, address

# About 20 ms of device time at 1-2 GHz: long enough that an unordered read would see the zeros.
_PROBE_SLEEP_CYCLES = 30_000_000

last_failure: str | None = None
"""Why the last :func:`crossing` returned ``None`` (the device check reports it)."""


def crossing(device: torch.device, jax_device: Any | None = None) -> Crossing | None:
    """The CUDA crossing for ``device``, or ``None`` if it is unavailable or fails its self-check.

    Args:
        device: a torch CUDA device (with its index).
        jax_device: the matching JAX device (looked up when ``None``).
    """
    global last_failure
    try:
        from jax._src.lib import _jax as jaxlib_ext

        from hardware.devices import jax_device_for

        convert = jaxlib_ext.dlpack_managed_tensor_to_buffer
        to_dlpack = torch.utils.dlpack.to_dlpack
        jax_device = jax_device or jax_device_for(device)
        stream_handle = jax_device.get_stream_for_external_ready_events()
        with torch.cuda.device(device):
            external = torch.cuda.ExternalStream(stream_handle, device=device)
            kind = int(torch.empty(1, device=device).__dlpack_device__()[0])
    except Exception as error:
        last_failure = f"unavailable: {type(error).__name__}: {error}"
        return None

    def convert_one(tensor: torch.Tensor) -> jax.Array:
        return convert(to_dlpack(tensor), jax_device, stream_handle, None, kind)

    import_many = ordered_imports(
        lambda: torch.cuda.device(device),
        lambda: external.wait_stream(torch.cuda.current_stream(device)),
        convert_one,
    )
    candidate = Crossing("cuda", import_many, _crossing_dlpack.export, host_is_device=False)
    if self_check(candidate, device):
        last_failure = None
        return candidate
    last_failure = "failed its self-check"
    return None


def ordered_imports(
    guard: Callable[[], Any], wait: Callable[[], Any], convert_one: Callable[[torch.Tensor], Any]
) -> Callable[[Sequence[torch.Tensor]], tuple[jax.Array, ...]]:
    """``import_many`` of the CUDA crossing, from its three device operations.

    Under ``guard()``: every tensor XLA:GPU would refuse is copied first (on torch's stream),
    then ``wait()`` makes JAX's external-ready stream wait once for all of torch's work queued so
    far (the copies included), then each tensor is converted on that stream.
    """

    def import_many(tensors: Sequence[torch.Tensor]) -> tuple[jax.Array, ...]:
        if not tensors:
            return ()
        with guard():
            units = [_storage.aligned(t, _storage.XLA_GPU_ALIGNMENT) for t in tensors]
            wait()  # one event, one wait, after the copies
            return tuple(map(convert_one, units))

    return import_many


def self_check(candidate: Crossing, device: torch.device) -> bool:
    """Whether ``candidate`` reads what torch wrote last, over the same memory, and back."""
    try:
        with torch.cuda.device(device):
            probe = torch.zeros(16, dtype=torch.float32, device=device)
            sleep = getattr(torch.cuda, "_sleep", None)
            if sleep is not None:
                sleep(_PROBE_SLEEP_CYCLES)  # the write below waits behind it on torch's stream
            probe.copy_(torch.arange(16, dtype=torch.float32, device=device))
            (array,) = candidate.import_many([probe])
            if address(array) != address(probe) or float(jnp.sum(array)) != 120.0:
                return False
            back = candidate.export(array * 2)
            expected = torch.arange(0, 32, 2, dtype=torch.float32, device=device)
            return bool(torch.equal(back, expected))
    except Exception:
        return False
