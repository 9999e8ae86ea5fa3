"""Gradients as views of flat, aligned buffers: one DLPack import per dtype group and step.

Importing a torch tensor into JAX costs tens of microseconds, so a per-gradient design pays that
once per parameter and step. Instead, the :class:`GradientArena` owns one flat buffer per
dtype and installs a view of it as every parameter's ``.grad``. Backward then accumulates into the
views in place, and the whole gradient set reaches JAX as a few zero-copy arrays.

When a user drops the views (``zero_grad(set_to_none=True)``, the torch default) or replaces a
``.grad``, :meth:`GradientArena.sync` copies the new gradient into its slot and reinstalls the
view: slower by one copy, never wrong. A parameter whose ``.grad`` is ``None`` keeps ``None``
(optimizers skip it) and its slot is zeroed so that it adds nothing to the global norm.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import torch

_ALIGN_BYTES = 64  # DLPack is zero-copy into XLA only for 64-byte-aligned buffers.


@dataclasses.dataclass
class _Slot:
    param: torch.Tensor
    view: torch.Tensor
    live: bool  # the slot holds a gradient (else it is known to be all zeros)


@dataclasses.dataclass
class _Group:
    device: torch.device
    dtype: torch.dtype
    flat: torch.Tensor
    # [start, end) of each optimizer's parameters inside ``flat``, by optimizer index.
    ranges: dict[int, tuple[int, int]]


def _aligned_zeros(numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    itemsize = torch.empty((), dtype=dtype).element_size()
    pad = _ALIGN_BYTES // itemsize
    storage = torch.zeros(numel + pad, dtype=dtype, device=device)
    offset = (-storage.data_ptr() % _ALIGN_BYTES) // itemsize
    return storage[offset : offset + numel]


def _padded(numel: int, itemsize: int) -> int:
    step = _ALIGN_BYTES // itemsize
    return -(-numel // step) * step


class GradientArena:
    """Flat gradient storage for the parameters of a list of optimizers.

    Args:
        param_lists: one list of parameters per optimizer; a parameter may appear only once.

    Raises:
        ValueError: a parameter belongs to two optimizers, or parameters are not floating point.
    """

    def __init__(self, param_lists: Sequence[Sequence[torch.Tensor]]) -> None:
        seen: set[int] = set()
        layout: dict[tuple[torch.device, torch.dtype], list[tuple[int, torch.Tensor]]] = {}
        for index, params in enumerate(param_lists):
            for param in params:
                if id(param) in seen:
                    raise ValueError(
                        "a parameter appears twice among the optimizers known to this GradScaler "
                        f"(shape {tuple(param.shape)}); each parameter must belong to one "
                        "optimizer and one param group"
                    )
                seen.add(id(param))
                if not param.dtype.is_floating_point:
                    raise ValueError(
                        f"GradScaler needs floating-point parameters; got one of dtype {param.dtype}"
                    )
                layout.setdefault((param.device, param.dtype), []).append((index, param))

        self.groups: list[_Group] = []
        self.slots: list[_Slot] = []
        for (device, dtype), entries in layout.items():
            itemsize = torch.empty((), dtype=dtype).element_size()
            total = sum(_padded(p.numel(), itemsize) for _, p in entries)
            flat = _aligned_zeros(total, dtype, device)
            ranges: dict[int, tuple[int, int]] = {}
            start = 0
            for index, param in entries:
                numel = param.numel()
                view = flat[start : start + numel].view(param.shape)
                lo, _ = ranges.get(index, (start, start))
                start += _padded(numel, itemsize)
                ranges[index] = (lo, start)
                self.slots.append(_Slot(param, view, live=False))
                self._adopt(self.slots[-1])
            self.groups.append(_Group(device, dtype, flat, ranges))

    @staticmethod
    def _adopt(slot: _Slot) -> None:
        grad = slot.param.grad
        if grad is slot.view:
            return
        if grad is None:
            if slot.live:
                slot.view.zero_()
                slot.live = False
            return
        if grad.is_sparse:
            raise TypeError("GradScaler does not support sparse gradients")
        slot.view.copy_(grad)
        slot.param.grad = slot.view
        slot.live = True

    def sync(self) -> None:
        """Makes every non-``None`` gradient a view of the arena, copying fresh ones in."""
        for slot in self.slots:
            if slot.param.grad is not slot.view:
                self._adopt(slot)
            else:
                slot.live = True

    def flats(self) -> tuple[torch.Tensor, ...]:
        """The flat buffers, one per (device, dtype) group."""
        return tuple(group.flat for group in self.groups)

    def mul_(self, optimizer_index: int, multiplier: torch.Tensor) -> None:
        """Multiplies one optimizer's gradients in place (one kernel per dtype group)."""
        for group in self.groups:
            span = group.ranges.get(optimizer_index)
            if span is not None:
                group.flat[span[0] : span[1]].mul_(multiplier)

    def mul_all_(self, multiplier: torch.Tensor) -> None:
        """Multiplies every gradient in place."""
        for group in self.groups:
            group.flat.mul_(multiplier)
