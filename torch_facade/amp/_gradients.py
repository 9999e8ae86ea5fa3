"""Which torch tensors one overflow decision reads, and which it multiplies.

The decision reads every gradient once, zero-copy, wherever torch keeps it. Gradients come from
several sources, each handled by one small module behind the same two questions:

* what holds this rank's values of a gradient, and are they a shard (summed across ranks) or a
  replica (the same on every rank)? :mod:`torch_facade.amp._dtensor` answers for FSDP2's DTensor
  gradients; any other gradient is its own local tensor, replicated in a distributed job
  (DDP's all-reduced gradients, or a job that averages them itself).
* which tensors does JAX import to read those values? :mod:`torch_facade.amp._storage` answers:
  gradients that are views tiling one flat buffer (DDP's bucket views with
  ``gradient_as_bucket_view=True``, FSDP2's reduce-scatter output) are read through that buffer,
  one import for the lot; every other gradient (the fresh tensors each backward makes after
  ``zero_grad()``, or tensors that persist with ``set_to_none=False``) is imported by itself.

Nothing is copied and nothing is kept: the imports live for one decision. The multiplier is then
applied in place to the local tensors, so every reference a user holds to a ``.grad`` sees it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Sequence
from typing import Any

import torch

from torch_facade.amp import _dtensor, _storage


@dataclasses.dataclass(frozen=True)
class GradientRead:
    """What one decision reads: the tensors to import, by kind.

    Attributes:
        sharded: tensors whose sums of squares add up across ranks (local shards).
        replicated: tensors every rank holds a copy of (everything in one process).
        covered: ``id`` of every parameter whose gradient was read.
        device: the device of the gradients (``None`` when there are none).
        mesh_groups: the process groups of the DTensor gradients' device meshes.
    """

    sharded: tuple[torch.Tensor, ...]
    replicated: tuple[torch.Tensor, ...]
    covered: frozenset[int]
    device: torch.device | None
    mesh_groups: tuple[Any, ...]


def read(params: Iterable[torch.Tensor]) -> GradientRead:
    """Collects the gradients of ``params`` (``None`` gradients are skipped) for one read.

    Raises:
        ValueError: gradients on more than one device.
        TypeError: sparse gradients.
    """
    sharded: list[torch.Tensor] = []
    replicated: list[torch.Tensor] = []
    covered: set[int] = set()
    devices: set[torch.device] = set()
    meshes: dict[int, Any] = {}
    for param in params:
        grad = param.grad
        if grad is None:
            continue
        if grad.is_sparse:
            raise TypeError("GradScaler does not support sparse gradients")
        local, is_shard, mesh = _dtensor.local_values(grad)
        if mesh is not None:
            meshes[id(mesh)] = mesh
        covered.add(id(param))
        if local.numel() == 0:
            continue
        devices.add(local.device)
        (sharded if is_shard else replicated).append(local)
    if len(devices) > 1:
        raise ValueError(
            f"GradScaler needs all gradients on one device; got {sorted(map(str, devices))}"
        )
    return GradientRead(
        sharded=_storage.import_units(sharded),
        replicated=_storage.import_units(replicated),
        covered=frozenset(covered),
        device=devices.pop() if devices else None,
        mesh_groups=tuple(mesh.get_group() for mesh in meshes.values()),
    )


def device_of(params: Iterable[torch.Tensor]) -> torch.device | None:
    """The device of the first gradient of ``params`` (``None`` when none has one)."""
    for param in params:
        if param.grad is not None:
            return _dtensor.local_values(param.grad)[0].device
    return None


def local_tensors(params: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """The tensors holding this rank's gradient values of ``params``, to multiply in place."""
    result = []
    for param in params:
        grad = param.grad
        if grad is not None:
            result.append(_dtensor.local_values(grad)[0])
    return result


def multiply_(tensors: list[torch.Tensor], multiplier: torch.Tensor) -> None:
    """Multiplies gradients in place by a 0-d float32 tensor (computed in float32 per element)."""
    if not tensors:
        return
    with torch.no_grad():
        torch._foreach_mul_(tensors, on_device(multiplier, tensors[0].device))


def on_device(tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
    """``tensor`` on ``device``: as it is if it is there; a copy otherwise, which the host waits
    for when it goes to the CPU (a non-blocking copy from a GPU could be read before it lands)."""
    if tensor.device == device:
        return tensor
    return tensor.to(device, non_blocking=tensor.device.type == "cpu")
