"""One decision for every rank: the cross-rank half of the overflow check.

Each rank computes its partial sums of squares (sharded and replicated, see
:func:`amp_core.combine_partials`) and its loss scale and counters in JAX; this module gathers
those five float32 numbers from every rank with one ``all_gather`` of the process group, and amp_core
combines them identically on every rank. The gradients themselves never travel.

With HSDP (DTensor gradients on a 2-D device mesh, replicated over its first dimension) the
group's ranks form replica groups that each hold every shard once: :func:`mesh_layout` says how
many, and in which order the gathered rows must come for :func:`amp_core.combine_partials` to
add the shards up within each replica group only (a row permutation, no arithmetic).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import torch

try:
    import torch.distributed as dist
except ImportError:  # pragma: no cover - torch built without distributed support
    dist = None  # type: ignore[assignment]


_BUILT_WITH_DISTRIBUTED = dist is not None and dist.is_available()


def _available() -> bool:
    return _BUILT_WITH_DISTRIBUTED and dist.is_initialized()


class Collective:
    """The all-gather of one decision's partials over a process group.

    Args:
        group: the process group (``None``: the default group).
    """

    def __init__(self, group: Any) -> None:
        self.group = group
        self.world_size = dist.get_world_size(group)

    def gather(self, partials: torch.Tensor) -> torch.Tensor:
        """``partials`` (``float32[k]``) of every rank, as ``float32[world_size, k]``."""
        flat = partials.reshape(-1).contiguous()
        out = torch.empty(self.world_size * flat.numel(), dtype=flat.dtype, device=flat.device)
        _all_gather_single()(out, flat, group=self.group)
        return out.view(self.world_size, *partials.shape)


def _all_gather_single() -> Any:
    """torch's all-gather into one tensor, under the name this torch has without a warning.

    torch 2.13 deprecates ``all_gather_into_tensor`` (a ``FutureWarning``) for
    ``all_gather_single``; older versions have only the former.
    """
    return getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


def ranks(group: Any) -> list[int]:
    """The global ranks of a process group (``None``: the default group)."""
    return dist.get_process_group_ranks(group or dist.group.WORLD)


def check_group(process_group: Any) -> None:
    """Validates a ``process_group`` given to the scaler (``None`` passes).

    Raises:
        RuntimeError: torch.distributed is not initialized.
        ValueError: this rank is not a member of ``process_group``.
        TypeError: not a process group.
    """
    if process_group is None:
        return
    if not _available():
        raise RuntimeError(
            "process_group was given but torch.distributed is not initialized; call "
            "torch.distributed.init_process_group first"
        )
    if process_group is dist.GroupMember.NON_GROUP_MEMBER:
        raise ValueError(
            f"this rank ({dist.get_rank()}) is not a member of process_group: a GradScaler can "
            "only be used on the ranks of the group it was given"
        )
    if not isinstance(process_group, dist.ProcessGroup):
        raise TypeError(
            "process_group must be a torch.distributed.ProcessGroup or None; got "
            f"{type(process_group).__name__}"
        )


def collective(process_group: Any) -> Collective | None:
    """The collective for a decision, or ``None`` when this is a one-process job.

    The default group is used when torch.distributed is initialized (it may be initialized after
    the scaler was made) and has more than one rank.
    """
    if process_group is not None:
        return Collective(process_group)
    if not _available() or dist.get_world_size() == 1:
        return None
    return Collective(None)


@dataclasses.dataclass(frozen=True)
class MeshLayout:
    """How the gathered partials of one decision combine (see :func:`mesh_layout`).

    Attributes:
        replicas: the replica groups the ranks form (1: every rank holds a different shard).
        order: the gathered rows (process-group order) that make the replica-major order of the
            mesh's ranks, or ``None`` when they already come in it.
    """

    replicas: int = 1
    order: tuple[int, ...] | None = None

    def arrange(self, gathered: torch.Tensor) -> torch.Tensor:
        """``gathered`` (``[ranks, k]``, process-group order) with its rows in this order."""
        return gathered if self.order is None else gathered[list(self.order)]


ONE_COPY = MeshLayout()
"""No replica groups: the layout of FSDP2 on a 1-D mesh, of plain gradients, of one process."""


def mesh_layout(meshes: Sequence[Any], process_group: Any) -> MeshLayout:
    """The layout of the decision's DTensor gradients on ``meshes`` over ``process_group``.

    Every mesh must hold exactly the ranks of the process group (``None``: the default group),
    so that the decision is taken once for all of them; a 2-D mesh (HSDP) has as many replica
    groups as its first dimension is long.

    Raises:
        ValueError: a mesh over other ranks than the process group, or meshes that split the
            ranks into replica groups differently.
    """
    if not meshes:
        return ONE_COPY
    group_ranks = ranks(process_group)
    position = {rank: row for row, rank in enumerate(group_ranks)}
    layouts: set[MeshLayout] = set()
    for mesh in meshes:
        mesh_ranks = [int(rank) for rank in mesh.mesh.reshape(-1).tolist()]
        if sorted(mesh_ranks) != sorted(group_ranks):
            if mesh.ndim == 1:
                advice = "Pass process_group=mesh.get_group()."
            else:
                advice = (
                    "Leave process_group=None (the default group) or pass a group of all the "
                    "mesh's ranks, dist.new_group(mesh.mesh.flatten().tolist())."
                )
            raise ValueError(
                "GradScaler's process group and the device mesh of the DTensor gradients "
                f"hold different ranks ({group_ranks} vs {mesh_ranks}): the decision must be "
                f"taken over the ranks that shard the gradients. {advice}"
            )
        if mesh.ndim == 1:
            layouts.add(ONE_COPY)
            continue
        order = tuple(position[rank] for rank in mesh_ranks)
        replicas = int(mesh.shape[0])
        layouts.add(MeshLayout(replicas, None if order == tuple(range(len(order))) else order))
    if len(layouts) > 1:
        raise ValueError(
            "GradScaler got DTensor gradients on device meshes that group the ranks into "
            f"replicas differently ({sorted(map(repr, layouts))}); put every fully_shard of "
            "the model on one mesh"
        )
    return layouts.pop()
