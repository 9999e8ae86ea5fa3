"""DTensor gradients (FSDP2's ``fully_shard``): the local shard is what this rank reads and scales.

A gradient sharded over a 1-D device mesh holds a different part on every rank: its sum of
squares is added up across ranks. A replicated DTensor is the same on every rank. On a 2-D mesh
(HSDP: ``fully_shard`` over ``init_device_mesh(..., (replicas, shards))``) a gradient is
``Replicate()`` over the first dimension and sharded (or replicated) over the second: its
squares add up over the second dimension only, and each replica group holds a whole copy
(:func:`amp_core.combine_partials` with ``replicas``; :mod:`._distributed` says in which order
the ranks' rows come).

Refused with a clear error naming the mesh dimension and its placement, rather than decided
wrongly: a ``Partial`` placement (the gradient was never reduced over that dimension), a shard
over the first dimension of a 2-D mesh (tensor parallelism beside FSDP, or a gradient sharded
over both dimensions), and meshes of three or more dimensions.
"""

from __future__ import annotations

import functools
from typing import Any

import torch


@functools.cache
def _dtensor_type() -> type | None:
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # torch built without distributed support
        return None
    return DTensor


def is_dtensor(tensor: torch.Tensor) -> bool:
    """Whether ``tensor`` is a ``torch.distributed.tensor.DTensor``."""
    dtensor = _dtensor_type()
    return dtensor is not None and isinstance(tensor, dtensor)


def local_values(grad: torch.Tensor) -> tuple[torch.Tensor, bool, Any]:
    """This rank's values of ``grad``, whether they are a shard of it, and its device mesh.

    A plain tensor is its own values (replicated, in a distributed job; no mesh). The local
    tensor of a DTensor is the one FSDP2 reduce-scattered into; scaling it in place scales the
    DTensor. On a 2-D (HSDP) mesh, "a shard" means sharded over the mesh's second dimension and
    replicated over its first.

    Raises:
        ValueError: a DTensor with a ``Partial`` placement, sharded over the first dimension of
            a 2-D mesh, or on a mesh of three or more dimensions.
    """
    if type(grad) is torch.Tensor or not is_dtensor(grad):  # the first test is the fast path
        return grad, False, None
    dtensor: Any = grad  # a DTensor: torch.Tensor's annotations lack its attributes
    mesh = dtensor.device_mesh
    return dtensor._local_tensor, is_sharded(tuple(dtensor.placements), mesh), mesh


def is_sharded(placements: tuple[Any, ...], mesh: Any) -> bool:
    """Whether a DTensor with ``placements`` on ``mesh`` holds a shard on each rank (its squares
    add up over the mesh's last dimension), or a replica (the same values on every rank).

    Raises:
        ValueError: a placement this module does not support (see the module's docstring).
    """
    for dim, placement in enumerate(placements):
        if placement.is_partial():
            raise ValueError(
                "GradScaler got a DTensor gradient with a Partial placement over mesh dimension "
                f"{describe_dim(mesh, dim)}: {placement!r} (placements {placements}), not yet "
                "reduced across that dimension's ranks; reduce it (redistribute it to Shard or "
                "Replicate) before the scaler reads it"
            )
    if mesh.ndim == 1:
        return bool(placements[0].is_shard())
    if mesh.ndim == 2:
        first = placements[0]
        if not first.is_replicate():
            raise ValueError(
                "GradScaler got a DTensor gradient sharded over mesh dimension "
                f"{describe_dim(mesh, 0)}: {first!r} (placements {placements}). On a 2-D mesh it "
                "supports HSDP's layout: Replicate() over dimension 0 and Shard or Replicate over "
                "dimension 1 (fully_shard over init_device_mesh(..., (replicas, shards))); a "
                "gradient sharded over dimension 0 (tensor parallelism beside FSDP, or sharded "
                "over both dimensions) is not supported"
            )
        return bool(placements[1].is_shard())
    dims = "; ".join(
        f"dimension {describe_dim(mesh, dim)}: {placement!r}"
        for dim, placement in enumerate(placements)
    )
    raise ValueError(
        "GradScaler supports DTensor gradients on a 1-D device mesh (FSDP2's fully_shard) or a "
        f"2-D one (HSDP); got a {mesh.ndim}-D mesh with placements over {dims}"
    )


def describe_dim(mesh: Any, dim: int) -> str:
    """Mesh dimension ``dim`` for a message: its index, and its name when the mesh has names."""
    names = mesh.mesh_dim_names
    return f"{dim} ({names[dim]!r})" if names else str(dim)
