"""One decision for every rank: the cross-rank half of the overflow check.

Each rank computes its partial sums of squares (sharded and replicated, see
:func:`amp_core.combine_partials`) and its loss scale and counters in JAX; this module gathers
those five float32 numbers from every rank with one ``all_gather`` of the process group, and amp_core
combines them identically on every rank. The gradients themselves never travel.
"""

from __future__ import annotations

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


def same_ranks(group_a: Any, group_b: Any) -> bool:
    """Whether two process groups (``None`` for the default) hold the same ranks."""
    return ranks(group_a) == ranks(group_b)
