"""The CPU crossing: jaxlib's lower-level DLPack functions, after a self-check.

``jax.dlpack.from_dlpack`` spends most of its ~90 us per tensor on device lookups, stream handling
and a ``jnp.asarray``; the call below it takes ~7 us with ``torch.utils.dlpack.to_dlpack``.
``torch.from_dlpack`` goes through ``__dlpack__``'s stream and version handling (about 10 us a call
warm, 110 us right after a backward pass); jaxlib's export below it about 1.5 us. Both are private
jaxlib functions, so each is used only if it passes its self-check on this jaxlib (same memory,
same values); otherwise the public API is.

On the CPU the host is the device: an exported result is complete when torch sees it (jaxlib's
export waits for it without a stream), and reading it costs nothing extra.

What the jitted core reads goes cheaper still (``core_arguments``): as NumPy views of the tensors
(``Tensor.numpy()``, no copy), which ``jax.jit`` takes on the CPU without a copy when they are
aligned, as torch's allocations are, and without creating a ``jax.Array`` (an import's
``jax.Array`` costs Python work in JAX for its sharding). Measured right after a backward pass
in the documented loop: about 30 us less per decision with one imported tensor, 80-140 us with
S's nine. That NumPy arguments are not copied is checked once (``jax.device_put`` of a NumPy view
must give an array over the tensor's memory: jit arguments go through the same conversion); if
not, imports are used. Other dtypes than float16 and float32 are imported (see
:data:`_NUMPY_DTYPES`).
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import torch

from torch_facade.amp import _crossing_public
from torch_facade.amp._crossing import Crossing, views_its_input


def crossing() -> Crossing | None:
    """The CPU crossing, or ``None`` if none of its private parts passes its self-check."""
    importer, exporter = importer_or_none(), exporter_or_none()
    numpy_ok = numpy_arguments_alias()
    if importer is None and exporter is None and not numpy_ok:
        return None
    public = _crossing_public.crossing(host_is_device=True)
    import_many = _many(importer) if importer is not None else public.import_many
    return Crossing(
        name="cpu" if importer is not None else "public",
        import_many=import_many,
        export=exporter or public.export,
        host_is_device=True,
        core_arguments=_numpy_arguments(import_many) if numpy_ok else None,
    )


_NUMPY_DTYPES = frozenset((torch.float16, torch.float32))
"""Gradient dtypes handed over as NumPy views: ``Tensor.numpy()`` refuses bfloat16 and the float8
types, and JAX converts a float64 NumPy array to float32 (a copy) unless 64-bit mode is on."""


def _numpy_arguments(import_many: Any) -> Any:
    def core_arguments(tensors: Any) -> tuple[Any, ...]:
        return tuple(_numpy_view(t, import_many) for t in tensors)

    return core_arguments


def _numpy_view(tensor: torch.Tensor, import_many: Any) -> Any:
    """A NumPy view of ``tensor`` (no copy), or its import where NumPy cannot view it."""
    if tensor.dtype in _NUMPY_DTYPES:
        try:
            return tensor.numpy()
        except (RuntimeError, TypeError):  # requires grad, or a conjugate or negative view
            pass
    return import_many([tensor])[0]


def numpy_arguments_alias() -> bool:
    """Whether JAX takes a NumPy view of a torch tensor on the CPU without a copy."""
    cpu = jax.devices("cpu")[0]
    probe = torch.arange(16, dtype=torch.float32)
    return views_its_input(lambda t: jax.device_put(t.numpy(), cpu), probe, jax.Array)


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
        from_capsule = torch.utils.dlpack.from_dlpack
    except Exception:
        return None

    def exporter(array: jax.Array) -> torch.Tensor:
        return from_capsule(to_capsule(array))

    probe = jnp.arange(16, dtype=jnp.float32)
    return exporter if views_its_input(exporter, probe, torch.Tensor) else None
