"""The CPU crossing: jaxlib's lower-level DLPack functions, after a self-check.

``jax.dlpack.from_dlpack`` spends most of its time per tensor on device lookups, stream handling
and a ``jnp.asarray``; the call below it, with ``torch.utils.dlpack.to_dlpack``, skips them.
``torch.from_dlpack`` goes through ``__dlpack__``'s stream and version handling (slowest right
after a backward pass); jaxlib's export below it does not, and torch's
``torch._C._from_dlpack`` takes the capsule (what ``torch.utils.dlpack.from_dlpack`` calls for a
capsule, after its own checks). These are private functions, so the pair is used only if it passes
its self-check on this jaxlib and torch (same memory, same values); otherwise the documented DLPack calls are.

On the CPU the host is the device: an exported result is complete when torch sees it (jaxlib's
export waits for it without a stream), and reading it costs nothing extra.
"""

from __future__ import annotations

from typing import Any

import jax
import numpy as np
import torch

from torch_facade.amp._engine import _crossing_dlpack
from torch_facade.amp._engine._crossing import Crossing, views_its_input


def crossing() -> Crossing | None:
    """The CPU crossing, or ``None`` if neither private function passes its self-check."""
    importer, exporter = importer_or_none(), exporter_or_none()
    if importer is None and exporter is None:
        return None
    dlpack = _crossing_dlpack.crossing(host_is_device=True)
    return Crossing(
        name="cpu" if importer is not None else "dlpack",
        import_many=_many(importer) if importer is not None else dlpack.import_many,
        export=exporter or dlpack.export,
        host_is_device=True,
    )


def _many(importer: Any) -> Any:
    def import_many(tensors: Any) -> tuple[jax.Array, ...]:
        return tuple(map(importer, tensors))

    return import_many


def importer_or_none() -> Any:
    """``tensor -> jax.Array`` through ``dlpack_managed_tensor_to_buffer``, if it self-checks."""
    try:
        from jax._src.lib import _jax as jaxlib_ext

        convert = jaxlib_ext.dlpack_managed_tensor_to_buffer
        to_dlpack = torch.utils.dlpack.to_dlpack
        cpu = jax.devices("cpu")[0]
        kind = int(torch.utils.dlpack.DLDeviceType.kDLCPU)
    except Exception:
        return None

    def importer(tensor: torch.Tensor) -> jax.Array:
        return convert(to_dlpack(tensor), cpu, None, None, kind)

    probe = torch.arange(16, dtype=torch.float32)
    return importer if views_its_input(importer, probe, jax.Array) else None


def exporter_or_none() -> Any:
    """``jax.Array -> tensor`` through ``buffer_to_dlpack_managed_tensor``, if it self-checks."""
    try:
        from jax._src.lib import _jax as jaxlib_ext

        to_capsule = jaxlib_ext.buffer_to_dlpack_managed_tensor
        from_capsule = torch._C._from_dlpack  # what torch.utils.dlpack.from_dlpack calls
    except Exception:
        return None

    def exporter(array: jax.Array) -> torch.Tensor:
        return from_capsule(to_capsule(array))

    # Placed from NumPy: jnp.arange would compile an XLA computation in the first iteration.
    probe = jax.device_put(np.arange(16, dtype=np.float32), jax.devices("cpu")[0])
    return exporter if views_its_input(exporter, probe, torch.Tensor) else None
