"""Which torch tensors one overflow decision reads, and which it multiplies.

The decision reads every gradient once, zero-copy, wherever torch keeps it. Gradients come from
several sources, each handled by one small module behind the same two questions:

* what holds this rank's values of a gradient, and are they a shard (summed across ranks) or a
  replica (the same on every rank)? :mod:`torch_facade.amp._engine._dtensor` answers for FSDP2's DTensor
  gradients; any other gradient is its own local tensor, replicated in a distributed job
  (DDP's all-reduced gradients, or a job that averages them itself).
* which tensors does JAX import to read those values? :mod:`torch_facade.amp._engine._storage` answers:
  gradients that are views tiling one flat buffer (DDP's bucket views with
  ``gradient_as_bucket_view=True``, FSDP2's reduce-scatter output) are read through that buffer,
  one import for the lot; every other gradient (the fresh tensors each backward makes after
  ``zero_grad()``, or tensors that persist with ``set_to_none=False``) is imported by itself.

Nothing is copied and nothing is kept: the imports live for one decision. The multiplier is then
applied in place to the local tensors, so every reference a user holds to a ``.grad`` sees it.

The gradients are fresh tensors after every ``zero_grad()``, but their structure (which
parameters have one, their types, dtypes, sizes and device) rarely changes. A :class:`Reader`
remembers what a full read found about a structure that is simple to check (every gradient a
plain tensor of its own, not a view, not a DTensor) and reads the next iteration's gradients
through it, checking per gradient only what is cheap to read and what the read depends on; any
difference falls back to the full read, which then remembers the new structure
(see :class:`Structure`). On the CPU the packed copy of the small gradients then goes into the
same buffer at every read (a :class:`KeptPack`), which crosses into JAX once instead of at every
decision.
"""

from __future__ import annotations

import dataclasses
import functools
import operator
from collections.abc import Iterable, Sequence
from typing import Any

import torch

from torch_facade.amp._engine import _dtensor, _storage

_GRAD = operator.attrgetter("grad")
_DTYPE = operator.attrgetter("dtype")
_NONE = type(None)
_PLAIN = frozenset((torch.Tensor, _NONE))


@dataclasses.dataclass(slots=True)
class GradientRead:
    """What one decision reads: the tensors to import, by kind.

    Attributes:
        sharded: tensors whose sums of squares add up across ranks (local shards).
        replicated: tensors every rank holds a copy of (everything in one process).
        covered: ``id`` of every parameter whose gradient was read.
        device: the device of the gradients (``None`` when there are none).
        meshes: the device meshes of the DTensor gradients (each once).
        tensors: when every gradient present is a plain tensor of its own, those gradients in
            parameter order: the list to multiply in place, as :func:`local_tensors` would
            build it again (``None`` otherwise).
        dtypes: the dtypes of ``tensors`` (``None`` with them).
        kept: for each of ``replicated``, the :class:`KeptPack` whose buffer it is, or ``None``
            for a tensor to import now (``None`` altogether when no unit is a kept buffer).
        graph: whether any of ``tensors`` may require grad (gradients made with
            ``create_graph=True``), so that multiplying them in place needs ``no_grad``.
    """

    sharded: tuple[torch.Tensor, ...]
    replicated: tuple[torch.Tensor, ...]
    covered: frozenset[int]
    device: torch.device | None
    meshes: tuple[Any, ...]
    tensors: list[torch.Tensor] | None = None
    dtypes: frozenset[torch.dtype] | None = None
    kept: tuple[KeptPack | None, ...] | None = None
    graph: bool = True


class KeptPack:
    """The flat copy of one dtype's small gradients, made into the same buffer at every read of a
    remembered structure on the CPU, so that it crosses into JAX once, not at every decision.

    The buffer is only ever written by :meth:`Structure.read` (``copy_`` of a flat copy of the
    same number of elements, not requiring grad, so it never moves) and only read by the decision's jitted core, which on the CPU has finished
    reading it when the decision's scalars reach torch: the next read's copy comes after that.

    Attributes:
        buffer: the flat buffer (torch-owned, on the CPU).
        imported: its JAX view, made by the first decision that reads it (``None`` before).
    """

    def __init__(self, numel: int, dtype: torch.dtype, device: torch.device) -> None:
        self.buffer = torch.empty(numel, dtype=dtype, device=device)
        self.imported: Any = None


def _read(
    params: Iterable[torch.Tensor],
) -> tuple[GradientRead, list[torch.Tensor | None] | None]:
    """Collects the gradients of ``params`` (``None`` gradients are skipped) for one read, and
    returns them in parameter order (``None`` where absent) too when every one present is a
    plain, non-empty, dense tensor of its own (see :class:`Structure`).

    Raises:
        ValueError: gradients on more than one device.
        TypeError: sparse gradients.
    """
    sharded: list[torch.Tensor] = []
    replicated: list[torch.Tensor] = []
    covered: set[int] = set()
    devices: set[torch.device] = set()
    meshes: dict[int, Any] = {}
    grads: list[torch.Tensor | None] = []
    simple = True
    for param in params:
        grad = param.grad
        grads.append(grad)
        if grad is None:
            continue
        if grad.is_sparse:
            raise TypeError("GradScaler does not support sparse gradients")
        local, is_shard, mesh = _dtensor.local_values(grad)
        if mesh is not None:
            meshes[id(mesh)] = mesh
        covered.add(id(param))
        simple = simple and type(grad) is torch.Tensor and _simple(grad)
        if local.numel() == 0:
            continue
        devices.add(local.device)
        (sharded if is_shard else replicated).append(local)
    if len(devices) > 1:
        raise ValueError(
            f"GradScaler needs all gradients on one device; got {sorted(map(str, devices))}"
        )
    result = GradientRead(
        sharded=_storage.import_units(sharded),
        replicated=_storage.import_units(replicated),
        covered=frozenset(covered),
        device=devices.pop() if devices else None,
        meshes=tuple(meshes.values()),
    )
    if not simple or result.device is None:
        return result, None
    present = [g for g in grads if g is not None]
    result = dataclasses.replace(result, tensors=present, dtypes=frozenset(map(_DTYPE, present)))
    return result, grads


def _simple(grad: torch.Tensor) -> bool:
    """A dense, non-empty tensor of its own (not a view: views may tile a buffer read whole)."""
    return grad.layout is torch.strided and not grad._is_view() and grad.numel() > 0


@dataclasses.dataclass(frozen=True)
class Structure:
    """What a full read found about the gradients of one list of parameters, to read the next
    iteration's fresh gradients without looking at each again.

    Remembered only when every gradient present is a plain ``torch.Tensor`` (not a DTensor or
    another subclass), dense, non-empty and not a view, all on one device (:func:`_read`). It
    says how they are read: the large ones (more than ``small_gradient`` elements) imported one
    by one, the small ones packed into one copy per dtype, in the order the full read uses, so
    that the jitted core sees the same arguments and never recompiles.

    :meth:`read` checks, each time:

    * the parameters: the same list object (the scaler rebuilds it whenever any parameter of
      any known optimizer is not the one it was, by identity);
    * per gradient present, in one pass: its dtype (the core unscales in it), which ``None``
      has not (a gradient that went away is seen); per gradient absent, that it still is;
    * that the gradients are plain tensors: a large gradient (or a small one read by itself)
      by its type; a packed copy by its own, since ``torch.cat`` gives a subclass's type for a
      subclass (a DTensor where a plain tensor was) or refuses a mixture. Two passes over
      every gradient (type, then dtype) cost measurably more than one in a training loop,
      where the caches are cold after the backward pass;
    * per imported tensor (a large gradient or a packed copy): dense layout, the device, and
      the number of elements (a packed copy's: a resized small gradient changes it); a large
      gradient must still not be a view (it may now tile a bucket read whole);
    * ``_storage.SMALL_GRADIENT``, as remembered.

    What it does not check per small gradient (its shape, strides, whether it became a view, its
    ``requires_grad``) cannot make the read wrong: the packed copy (``torch.cat``) copies every
    element of every small gradient once, whatever their layout, and refuses gradients on
    several devices or of mismatched dimensions (the full read then decides). Sparse gradients
    make it refuse or give a sparse copy, which the layout check catches.

    Attributes:
        params: the parameters whose gradients it describes.
        present: positions in ``params`` of the gradients present (``None``: all).
        absent: positions in ``params`` of the gradients absent (``None``).
        dtypes: the dtype of each gradient present.
        alone: positions (among those present) of the gradients imported by themselves.
        packs: per dtype, positions of its small gradients, their total number of elements and
            whether all are 1-D (one ``torch.cat``; else flattened first).
        device: the device of the gradients.
        covered: ``id`` of every parameter with a gradient.
        small_gradient: ``_storage.SMALL_GRADIENT`` when it was remembered.
        dtype_set: the distinct ``dtypes``.
        kept: per entry of ``packs``, its :class:`KeptPack` on the CPU (``None`` for a pack of
            one gradient, read by itself, and on other devices, where the crossing orders each
            import after torch's pending work on that tensor).
    """

    params: Sequence[torch.Tensor]
    present: tuple[int, ...] | None
    absent: tuple[int, ...]
    dtypes: tuple[torch.dtype, ...]
    alone: tuple[int, ...]
    packs: tuple[tuple[tuple[int, ...], int, bool], ...]
    device: torch.device
    covered: frozenset[int]
    small_gradient: int
    dtype_set: frozenset[torch.dtype]
    kept: tuple[KeptPack | None, ...]

    @classmethod
    def of(
        cls,
        params: Sequence[torch.Tensor],
        grads: list[torch.Tensor | None],
        device: torch.device,
        covered: frozenset[int],
    ) -> Structure:
        """The structure of ``grads`` (the gradients of ``params``, as :func:`_read` saw them)."""
        present = [g for g in grads if g is not None]
        small = _storage.SMALL_GRADIENT
        alone: list[int] = []
        packs: dict[torch.dtype, list[int]] = {}
        for i, grad in enumerate(present):
            if grad.numel() <= small:
                packs.setdefault(grad.dtype, []).append(i)
            else:
                alone.append(i)
        dtypes = tuple(map(_DTYPE, present))
        sizes = [(sum(present[i].numel() for i in indices), indices) for indices in packs.values()]
        return cls(
            params=params,
            present=None if len(present) == len(grads) else _positions(grads),
            absent=tuple(i for i, grad in enumerate(grads) if grad is None),
            dtypes=dtypes,
            alone=tuple(alone),
            packs=tuple(
                (tuple(indices), numel, all(present[i].dim() == 1 for i in indices))
                for numel, indices in sizes
            ),
            device=device,
            covered=covered,
            small_gradient=small,
            dtype_set=frozenset(dtypes),
            kept=tuple(
                KeptPack(numel, present[indices[0]].dtype, device)
                if len(indices) > 1 and keeps_packs(device)
                else None
                for numel, indices in sizes
            ),
        )

    def read(self, params: Sequence[torch.Tensor]) -> GradientRead | None:
        """The read of the gradients of ``params`` now, or ``None`` if the structure changed."""
        if params is not self.params or _storage.SMALL_GRADIENT != self.small_gradient:
            return None
        grads = list(map(_GRAD, params))
        present = grads if self.present is None else [grads[i] for i in self.present]
        try:
            if tuple(map(_DTYPE, present)) != self.dtypes:
                return None
        except AttributeError:  # None has no dtype: a gradient went away
            return None
        for i in self.absent:
            if grads[i] is not None:  # a gradient appeared
                return None
        units = []
        graph = False  # whether a gradient requires grad (create_graph=True)
        for i in self.alone:
            grad = present[i]
            if type(grad) is not torch.Tensor or grad._is_view() or not self._imports(grad):
                return None
            graph = graph or grad.requires_grad
            units.append(_storage.in_memory_order(grad))
        for (indices, numel, one_dim), kept in zip(self.packs, self.kept, strict=True):
            if len(indices) == 1:  # imported by itself, as the full read does
                unit = present[indices[0]]
                if type(unit) is not torch.Tensor or not self._imports(unit):
                    return None
                graph = graph or unit.requires_grad
                unit = _storage.in_memory_order(unit)
            else:
                group = present if len(indices) == len(present) else [present[i] for i in indices]
                try:
                    unit = _storage.flat_copy(group, one_dim)
                except Exception:  # devices, dimensions or kinds changed: the full read decides
                    return None
                if unit.requires_grad:
                    graph = True
                    unit = unit.detach()
                # a subclass among them (a DTensor) gives its own type
                if type(unit) is not torch.Tensor or not self._imports(unit):
                    return None
            if unit.numel() != numel:
                return None
            units.append(unit if kept is None else kept.buffer.copy_(unit))
        return GradientRead(
            (),
            tuple(units),
            self.covered,
            self.device,
            (),
            present,
            self.dtype_set,
            self.kept_units,
            graph,
        )

    @functools.cached_property
    def kept_units(self) -> tuple[KeptPack | None, ...] | None:
        """:attr:`GradientRead.kept` of a read through this structure."""
        if not any(self.kept):
            return None
        return (None,) * len(self.alone) + self.kept

    def _imports(self, tensor: torch.Tensor) -> bool:
        """Whether ``tensor`` is dense, non-empty and on the remembered device."""
        return (
            tensor.layout is torch.strided and tensor.device == self.device and tensor.numel() > 0
        )


def keeps_packs(device: torch.device) -> bool:
    """Whether the packed copies of small gradients on ``device`` go into :class:`KeptPack`
    buffers: on the CPU only (elsewhere the crossing orders each import after torch's pending
    work on that tensor, so a copy is imported at every read)."""
    return device.type == "cpu"


def _positions(grads: list[torch.Tensor | None]) -> tuple[int, ...]:
    return tuple(i for i, grad in enumerate(grads) if grad is not None)


class Reader:
    """Reads a decision's gradients, through the remembered :class:`Structure` when it still
    holds, else fully (remembering the new structure when it is simple enough)."""

    def __init__(self) -> None:
        self._structure: Structure | None = None
        self.full_reads = 0  # how many reads looked at every gradient (tests watch it)

    def read(self, params: Sequence[torch.Tensor]) -> GradientRead:
        """The gradients of ``params`` for one decision (see :func:`_read`).

        Raises:
            ValueError: gradients on more than one device.
            TypeError: sparse gradients.
        """
        structure = self._structure
        if structure is not None:
            result = structure.read(params)
            if result is not None:
                return result
        self.full_reads += 1
        self._structure = None
        result, grads = _read(params)
        if grads is not None and not result.sharded and result.device is not None:
            self._structure = Structure.of(params, grads, result.device, result.covered)
        return result


def device_of(params: Iterable[torch.Tensor]) -> torch.device | None:
    """The device of the first gradient of ``params`` (``None`` when none has one)."""
    for param in params:
        if param.grad is not None:
            return _dtensor.local_values(param.grad)[0].device
    return None


def local_tensors(params: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """The tensors holding this rank's gradient values of ``params``, to multiply in place."""
    grads = list(map(_GRAD, params))
    kinds = set(map(type, grads))
    if kinds <= _PLAIN:  # plain tensors (and None): each is its own values
        return [g for g in grads if g is not None] if _NONE in kinds else grads
    return [_dtensor.local_values(grad)[0] for grad in grads if grad is not None]


def multiply_read_(read: GradientRead, multiplier: torch.Tensor) -> None:
    """:func:`multiply_` for the gradients a decision just read (``read.tensors``), by a
    multiplier on their device: their device and dtypes are known, and ``no_grad`` (several
    microseconds a call) is entered only if one of them may require grad."""
    tensors = read.tensors
    assert tensors is not None and read.device is not None and read.dtypes is not None
    if read.graph:
        with torch.no_grad():
            _multiply_kernel(tensors, multiplier, read.device, read.dtypes)
    else:
        _multiply_kernel(tensors, multiplier, read.device, read.dtypes)


def multiply_(
    tensors: list[torch.Tensor],
    multiplier: torch.Tensor,
    dtypes: frozenset[torch.dtype] | None = None,
) -> None:
    """Multiplies gradients in place by a 0-d float32 tensor (computed in float32 per element).

    ``dtypes``: the distinct dtypes of ``tensors``, when known (else they are looked at).

    On the CPU, gradients of the dtypes torch's loss-scaling kernel takes go through
    ``torch._amp_foreach_non_finite_check_and_unscale_`` as a plain multiply: per element it
    computes ``g * multiplier`` in float32 (float64 for float64) and rounds once to the
    gradient's dtype, as ``torch._foreach_mul_`` does, and it costs less a gradient on the CPU
    (one unary kernel each instead of a broadcasting binary one). Its
    own overflow flag goes to a scratch tensor nobody reads: the decision is amp_core's. Other
    dtypes (which that kernel would refuse part-way through the list) and other devices use
    ``torch._foreach_mul_``.
    """
    if not tensors:
        return
    device = tensors[0].device
    multiplier = on_device(multiplier, device)
    if dtypes is None:
        dtypes = frozenset(map(_DTYPE, tensors))
    with torch.no_grad():
        _multiply_kernel(tensors, multiplier, device, dtypes)


def _multiply_kernel(
    tensors: list[torch.Tensor],
    multiplier: torch.Tensor,
    device: torch.device,
    dtypes: frozenset[torch.dtype],
) -> None:
    if device.type == "cpu" and dtypes <= _UNSCALE_DTYPES:
        torch._amp_foreach_non_finite_check_and_unscale_(tensors, _scratch_flag(), multiplier)
    else:
        torch._foreach_mul_(tensors, multiplier)


_UNSCALE_DTYPES = frozenset((torch.float16, torch.bfloat16, torch.float32, torch.float64))
_SCRATCH: list[torch.Tensor] = []


def _scratch_flag() -> torch.Tensor:
    """A float32[1] CPU tensor for the overflow flag the loss-scaling kernel writes, unread."""
    if not _SCRATCH:
        _SCRATCH.append(torch.zeros(1))
    return _SCRATCH[0]


def on_device(tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
    """``tensor`` on ``device``: as it is if it is there; a copy otherwise, which the host waits
    for when it goes to the CPU (a non-blocking copy from a GPU could be read before it lands)."""
    if tensor.device == device:
        return tensor
    return tensor.to(device, non_blocking=tensor.device.type == "cpu")
