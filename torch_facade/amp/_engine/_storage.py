"""Gradient memory as JAX reads it: one import per flat buffer of views, one packed copy of the
small gradients, one import per other gradient.

DDP with ``gradient_as_bucket_view=True`` makes every ``.grad`` a view into a flat bucket, and
FSDP2's sharded gradients are views into its reduce-scatter output. When the views of one such
buffer tile it exactly (every element belongs to exactly one of the gradients being read), the
buffer is imported once: one zero-copy DLPack import, aligned, instead of one per view (views
at arbitrary offsets are not 64-byte aligned, and DLPack would copy them).

Small gradients (biases, norms' scales: at most :data:`SMALL_GRADIENT` elements) that would be
imported by themselves are copied into one flat buffer per dtype and read through it: copying a few KB costs less than a DLPack import
(and its share of the jitted call's arguments), and a model of
a thousand small tensors then crosses in a handful of imports. Only the read uses the copy; the
gradients themselves are unscaled in place.

Any other gradient is imported by itself; a dense gradient with permuted strides (channels-last)
is read through a permuted view that is contiguous in memory, since a sum of squares does not
depend on order. On a GPU a view at an offset XLA:GPU rejects is copied by the crossing
(:func:`aligned`).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

SMALL_GRADIENT = 4096
"""Elements: gradients up to this size are read through one packed copy per dtype (copying 16 KB
of float32 costs less than one import)."""


def import_units(tensors: Sequence[torch.Tensor]) -> tuple[torch.Tensor, ...]:
    """The contiguous tensors to import so that every element of ``tensors`` is read once.

    ``tensors`` must not overlap in memory (each is one parameter's gradient).
    """
    units: list[torch.Tensor] = []
    alone: list[torch.Tensor] = []  # imported by themselves, unless small
    by_base: dict[int, list[torch.Tensor]] = {}
    bases: dict[int, torch.Tensor] = {}
    for tensor in tensors:
        if not tensor._is_view():  # a tensor of its own (fresh gradients after zero_grad())
            alone.append(tensor)
            continue
        base = tensor._base
        if base is not None and _is_flat(base) and tensor.is_contiguous():
            by_base.setdefault(id(base), []).append(tensor)
            bases[id(base)] = base
        else:
            alone.append(tensor)
    for key, views in by_base.items():
        base = bases[key]
        if _tile(base, views):
            units.append(_detached(base))
        else:
            alone.extend(views)
    small: dict[torch.dtype, list[torch.Tensor]] = {}
    for tensor in alone:
        if tensor.numel() <= SMALL_GRADIENT:
            small.setdefault(tensor.dtype, []).append(tensor)
        else:
            units.append(in_memory_order(tensor))
    units.extend(_packed(group) for group in small.values())
    return tuple(units)


def _packed(group: list[torch.Tensor]) -> torch.Tensor:
    """One tensor holding the values of ``group``: the tensor itself if it is alone, else a
    flat copy of all of them (one torch kernel)."""
    if len(group) == 1:
        return in_memory_order(group[0])
    return concatenated(group, all(t.dim() == 1 for t in group))


def concatenated(group: list[torch.Tensor], one_dim: bool) -> torch.Tensor:
    """A flat copy of the values of every tensor of ``group`` (one dtype, one device), in order.

    ``one_dim``: all are 1-D, so ``torch.cat`` takes them as they are (cheaper than flattening
    each first, as other shapes need). The copy never
    requires grad: of gradients made with ``create_graph=True``, which do, it is detached (not
    made under ``no_grad``, which costs several microseconds a call that every other read would
    pay for nothing).

    Raises:
        RuntimeError: torch refuses them together (several devices; ``one_dim`` and a tensor
            that is not 1-D; a sparse tensor among dense ones).
    """
    return _detached(flat_copy(group, one_dim))


def flat_copy(group: list[torch.Tensor], one_dim: bool) -> torch.Tensor:
    """:func:`concatenated`, which requires grad if any of ``group`` does."""
    return torch.cat(group) if one_dim else torch._utils._flatten_dense_tensors(group)


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


XLA_GPU_ALIGNMENT = 16
"""Bytes: XLA:GPU rejects an entry parameter whose address is not a multiple of this (XLA:CPU
copies such a buffer instead)."""


def aligned(tensor: torch.Tensor, alignment: int) -> torch.Tensor:
    """``tensor`` if its data pointer is a multiple of ``alignment`` bytes, else a copy (which
    torch's allocator aligns): for a view at an odd offset into a flat buffer."""
    if tensor.data_ptr() % alignment == 0:
        return tensor
    return tensor.clone()


def _detached(tensor: torch.Tensor) -> torch.Tensor:
    # DLPack refuses tensors that require grad (gradients made with create_graph=True).
    return tensor.detach() if tensor.requires_grad else tensor
