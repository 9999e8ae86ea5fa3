"""DTensor gradients (FSDP2's ``fully_shard``): the local shard is what this rank reads and scales.

A gradient sharded over a 1-D device mesh holds a different part on every rank: its sum of
squares is added up across ranks. A replicated DTensor is the same on every rank. A ``Partial``
placement means the gradient was never reduced, and a mesh of more than one dimension (HSDP,
tensor parallelism) would need a reduction per mesh dimension: both are refused with a clear
error rather than decided wrongly.
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
    DTensor.

    Raises:
        ValueError: a DTensor on a mesh of more than one dimension, or with a ``Partial``
            (unreduced) placement.
    """
    if type(grad) is torch.Tensor or not is_dtensor(grad):  # the first test is the fast path
        return grad, False, None
    dtensor: Any = grad  # a DTensor: torch.Tensor's annotations lack its attributes
    placements = dtensor.placements
    mesh = dtensor.device_mesh
    if mesh.ndim != 1:
        raise ValueError(
            "GradScaler supports DTensor gradients on a 1-D device mesh (FSDP2's fully_shard); "
            f"got a {mesh.ndim}-D mesh with placements {placements}"
        )
    placement = placements[0]
    if placement.is_partial():
        raise ValueError(
            "GradScaler got a DTensor gradient with a Partial placement (not yet reduced across "
            "ranks); reduce it before the scaler reads it"
        )
    return dtensor._local_tensor, placement.is_shard(), mesh
