"""How tensors cross between torch and JAX: one module per device kind, behind one interface.

A :class:`Crossing` answers the two questions every decision asks:

* ``import_many(tensors)``: JAX arrays over the same memory as ``tensors`` (all on one device),
  ordered after the work torch has queued on them;
* ``export(array)``: a torch tensor over the same memory as a JAX result, ordered after the
  JAX computation that produces it.

Variants, each in a module of its own:

* :mod:`~torch_facade.amp._engine._crossing_cpu`: jaxlib's lower-level DLPack calls (a small
  fraction of the documented calls' cost a tensor);
* :mod:`~torch_facade.amp._engine._crossing_cuda`: one event and wait per decision on JAX's
  external-ready stream, then the lower-level import per tensor (no event per tensor, no host
  wait), with a device guard and a copy for views XLA:GPU would reject as unaligned;
* :mod:`~torch_facade.amp._engine._crossing_dlpack`: the documented DLPack calls, on any device.

A faster variant (jaxlib's lower-level calls) is used only after its self-check passed on this jaxlib and this device (the
same memory, the same values, and on CUDA the ordering after torch's pending work); otherwise
the DLPack one: :func:`torch_facade.amp._engine._bridge.crossing_for` chooses, once per device. ROCm
builds of torch call their GPUs ``"cuda"`` and take the CUDA variant when its self-check passes
there.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import jax
import numpy as np
import torch


@dataclasses.dataclass(frozen=True)
class Crossing:
    """One way across, for the tensors of one torch device.

    Attributes:
        name: ``"cpu"``, ``"cuda"`` or ``"dlpack"`` (what the device check reports).
        import_many: ``tensors -> tuple of jax.Array`` over the same memory.
        export: ``jax.Array -> torch.Tensor`` over the same memory.
        host_is_device: results are complete when exported (the CPU): reading them on the host
            costs nothing, and the jitted core may branch. ``False`` on accelerators, where an
            exported result is still being computed and a host read waits for the device.
    """

    name: str
    import_many: Callable[[Sequence[torch.Tensor]], tuple[jax.Array, ...]]
    export: Callable[[jax.Array], torch.Tensor]
    host_is_device: bool


def views_its_input(crossing: Callable[[Any], Any], probe: Any, result_type: type[Any]) -> bool:
    """Whether ``crossing(probe)`` (``probe``: float32 0..15) gives a ``result_type`` over the
    same memory with the same values: the self-check of a faster crossing."""
    try:
        result = crossing(probe)
        return (
            isinstance(result, result_type)
            and tuple(result.shape) == (16,)
            and str(result.dtype).endswith("float32")
            and address(result) == address(probe)
            and _total(result) == 120.0
        )
    except Exception:
        return False


def _total(value: Any) -> float:
    """The sum of a torch tensor's or a JAX array's values (NumPy reads the JAX array: a
    ``jnp`` sum would compile an XLA computation in every process's first iteration)."""
    if isinstance(value, torch.Tensor):
        return float(value.sum())
    return float(np.asarray(value).sum())


def address(value: Any) -> int:
    """The data pointer of a torch tensor or a JAX array."""
    if isinstance(value, torch.Tensor):
        return value.data_ptr()
    return value.unsafe_buffer_pointer()
