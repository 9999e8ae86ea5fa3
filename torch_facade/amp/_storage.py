"""Gradient memory as JAX reads it: one import per flat buffer of views, else one per tensor.

DDP with ``gradient_as_bucket_view=True`` makes every ``.grad`` a view into a flat bucket, and
FSDP2's sharded gradients are views into its reduce-scatter output. When the views of one such
buffer tile it exactly (every element belongs to exactly one of the gradients being read), the
buffer is imported once: one zero-copy DLPack import, aligned, instead of one per view (views
at arbitrary offsets are not 64-byte aligned, and DLPack would copy them). Any other gradient is
imported by itself; a dense gradient with permuted strides (channels-last) is read through a
permuted view that is contiguous in memory, since a sum of squares does not depend on order.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


def import_units(tensors: Sequence[torch.Tensor]) -> tuple[torch.Tensor, ...]:
    """The contiguous tensors to import so that every element of ``tensors`` is read once.

    ``tensors`` must not overlap in memory (each is one parameter's gradient).
    """
    units: list[torch.Tensor] = []
    by_base: dict[int, list[torch.Tensor]] = {}
    bases: dict[int, torch.Tensor] = {}
    for tensor in tensors:
        if not tensor._is_view():  # a tensor of its own (fresh gradients after zero_grad())
            units.append(in_memory_order(tensor))
            continue
        base = tensor._base
        if _is_flat(base) and tensor.is_contiguous():
            by_base.setdefault(id(base), []).append(tensor)
            bases[id(base)] = base
        else:
            units.append(in_memory_order(tensor))
    for key, views in by_base.items():
        base = bases[key]
        if _tile(base, views):
            units.append(_detached(base))
        else:
            units.extend(_detached(view) for view in views)
    return tuple(units)


def _is_flat(tensor: torch.Tensor) -> bool:
    return tensor.dim() == 1 and tensor.is_contiguous()


def _tile(base: torch.Tensor, views: list[torch.Tensor]) -> bool:
    """Whether ``views`` cover ``base`` exactly, without gaps or overlaps."""
    if sum(view.numel() for view in views) != base.numel():
        return False
    end = base.storage_offset()
    for view in sorted(views, key=lambda v: v.storage_offset()):
        if view.dtype != base.dtype or view.storage_offset() != end:
            return False
        end += view.numel()
    return end == base.storage_offset() + base.numel()


def in_memory_order(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor`` as a contiguous tensor over the same memory where possible, else a copy."""
    tensor = _detached(tensor)
    if tensor.is_contiguous():
        return tensor
    order = sorted(range(tensor.dim()), key=lambda d: tensor.stride(d), reverse=True)
    permuted = tensor.permute(order)
    if permuted.is_contiguous():
        return permuted
    return tensor.contiguous()  # overlapping or gapped strides: rare, and read correctly


def _detached(tensor: torch.Tensor) -> torch.Tensor:
    # DLPack refuses tensors that require grad (gradients made with create_graph=True).
    return tensor.detach() if tensor.requires_grad else tensor
