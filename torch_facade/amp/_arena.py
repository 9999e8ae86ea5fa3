"""Gradients as views of flat, aligned buffers: a few zero-copy arrays for JAX, not one per tensor.

Importing a torch tensor into JAX costs tens of microseconds, so a per-gradient design pays that
once per parameter and step. Instead, the :class:`GradientArena` owns one flat buffer per
dtype and installs a view of it as every parameter's ``.grad``. Backward then accumulates into the
views in place, and the whole gradient set reaches JAX as a few zero-copy arrays.

When a user drops the views (``zero_grad(set_to_none=True)``, the torch default) or replaces a
``.grad``, :meth:`GradientArena.sync` copies the new gradient into its slot and moves that
gradient tensor's storage into the arena (``Tensor.set_``): the tensor object stays ``.grad``,
so every reference a user holds to it sees what the optimizer sees. Slower by one copy, never
wrong. A parameter whose ``.grad`` is ``None`` keeps ``None`` (optimizers skip it) and its slot
is zeroed so that it adds nothing to the global norm. Slots have their parameter's strides
(fused optimizer kernels assume it), and a parameter that changes dtype, device or shape
(``module.to(...)``) makes the scaler build a new arena.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import torch

_ALIGN_BYTES = 64  # DLPack is zero-copy into XLA only for 64-byte-aligned buffers.


@dataclasses.dataclass
class _Slot:
    param: torch.Tensor
    memory: torch.Tensor  # the arena's own view of the slot; never handed out
    view: torch.Tensor  # the tensor installed as ``param.grad`` (its storage is ``memory``)
    live: bool  # the slot holds a gradient (else it is known to be all zeros)
    address: int = 0  # ``memory.data_ptr()``, which never changes

    def __post_init__(self) -> None:
        self.address = self.memory.data_ptr()


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


def _slot_view(slot: torch.Tensor, param: torch.Tensor) -> torch.Tensor:
    """``slot`` shaped as the gradient torch's autograd would create for ``param``.

    That is ``param``'s own strides when it is dense (a transposed or channels-last weight),
    else contiguous. Fused optimizer kernels assume that a gradient has its parameter's strides.
    """
    strides = torch.empty_like(param, device="meta").stride()
    return slot.as_strided(param.shape, strides)


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
                memory = _slot_view(flat[start : start + numel], param)
                lo, _ = ranges.get(index, (start, start))
                start += _padded(numel, itemsize)
                ranges[index] = (lo, start)
                self.slots.append(_Slot(param, memory, memory, live=False))
                self._adopt(self.slots[-1])
            self.groups.append(_Group(device, dtype, flat, ranges))

    @staticmethod
    def _adopt(slot: _Slot) -> bool:
        """Copies ``param.grad`` into the slot and makes it live there.

        Returns:
            ``False`` if the gradient no longer fits the slot: the parameter changed dtype,
            device or shape since the arena was built (``module.to(...)``).
        """
        grad = slot.param.grad
        if grad is None:
            if slot.live:
                slot.memory.zero_()
                slot.live = False
            return True
        if grad.is_sparse:
            raise TypeError("GradScaler does not support sparse gradients")
        memory = slot.memory
        if (grad.dtype, grad.shape, grad.device) != (memory.dtype, memory.shape, memory.device):
            return False
        if grad.data_ptr() != memory.data_ptr() or grad.stride() != memory.stride():
            with torch.no_grad():  # a gradient with a history must not give the arena one
                memory.copy_(grad)
        if grad.requires_grad:  # a gradient with a history (create_graph=True): replace it
            # By a new tensor over the slot, never ``memory`` itself: ``grad.data = other``
            # (``module.to(...)``) on what the user holds must not move the arena's own view.
            slot.param.grad = slot.view = memory.detach()
        else:
            # Move the gradient tensor itself into the arena rather than replacing it, so that
            # every reference to it (a user's list of grads) sees the in-place unscaling and
            # clipping, and in-place changes made through such a reference reach the optimizer.
            with torch.no_grad():
                grad.set_(memory)
            slot.view = grad
        slot.live = True
        return True

    def sync(self) -> bool:
        """Makes every non-``None`` gradient live in the arena, copying fresh ones in.

        Returns:
            ``False`` if a parameter changed dtype, device or shape since the arena was built:
            the arena must then be rebuilt.
        """
        for slot in self.slots:
            # Still the installed tensor, and still in the slot: ``grad.data = other`` (which
            # ``module.to(...)`` does) keeps the object but moves its storage out of the arena.
            grad = slot.param.grad
            if grad is slot.view and grad.data_ptr() == slot.address:
                slot.live = True
            elif not self._adopt(slot):
                return False
        return True

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
