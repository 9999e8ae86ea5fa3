"""Which layer overflowed: the modules whose outputs or gradients left the half format's range.

:func:`locate_overflow` is a context manager over one debugging pass (a forward, and a backward
when the loss is differentiated inside it). While it is open, every module of the model has

* a forward hook that reads the module's output (a tensor, or the float tensors inside a tuple,
  list, dict, dataclass or Hugging Face ``ModelOutput``): a **forward** event when it holds inf
  or NaN or an element above the threshold;
* a forward pre-hook that puts a tensor hook on each floating-point input that requires grad:
  when the backward pass reaches that input, a **backward** event when the gradient there holds
  inf or NaN or exceeds the threshold. The gradient w.r.t. a module's inputs is what that
  module's backward produced, so the event names the module whose backward overflowed. (An
  input that feeds several modules, as around a residual connection, receives the sum of their
  gradients: the event then names each consumer.)

Tensor hooks are used rather than ``register_full_backward_hook``, which wraps a module's
outputs in a custom function and makes an in-place op that follows it (``ReLU(inplace=True)``)
raise. A hook registered before an in-place op sees the gradient of the value before it, so an
in-place module's event is about its own input.

Every hook is removed on exit, also when the body raises, and the tensor hooks left on a graph
that is differentiated after exit are removed with them: outside the context nothing runs. Inside
it each module call launches one small reduction per float tensor, and the values are read
(one host synchronisation per device) only when the result is first looked at.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterator, Mapping
from typing import Any

import torch

import amp_core.locate_overflow as amp_core_locate
from amp_core.locate_overflow import OverflowEvent
from torch_facade.amp import precision

_FORWARD = "forward"
_BACKWARD = "backward"

__all__ = ["LocatedOverflow", "OverflowEvent", "locate_overflow"]


@dataclasses.dataclass
class _Check:
    name: str
    module_type: str
    kind: str
    abs_max: torch.Tensor  # a 0-d float32 tensor, read on the host when the result is read
    call: int


class LocatedOverflow(amp_core_locate.LocatedOverflow):
    """What :func:`locate_overflow` recorded: the overflowed modules, in the order they ran.

    The JAX door's :class:`amp_core.locate_overflow.LocatedOverflow` (``first``, ``events``,
    ``calls``, the table of ``str()``), whose maxima stay on the device until first read:
    reading ``events``, ``first``, ``calls`` or ``str()`` after new checks copies them to the
    host (one synchronisation per device).

    Attributes:
        threshold: the largest magnitude that counts as in range.
        dtype: the half format the threshold is the maximum of, or ``None`` for an explicit
            ``threshold``.

    Example:
        >>> import torch
        >>> import torch_facade as cstorch
        >>> model = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.ReLU())
        >>> _ = torch.nn.init.ones_(model[0].weight)
        >>> with cstorch.amp.locate_overflow(model) as found:
        ...     _ = model(torch.full((1, 2), 1e6))
        >>> found.first, [event.call for event in found.events], found.calls
        ('0', [0, 1, 2], 3)
        >>> found.threshold, found.dtype
        (65504.0, 'float16')
    """

    def __init__(self, threshold: float, dtype: str | None) -> None:
        super().__init__(threshold, dtype)
        self._pending: list[_Check] = []

    def _record(self, name: str, module_type: str, kind: str, tensors: list[torch.Tensor]) -> None:
        self._pending.append(_Check(name, module_type, kind, _abs_max(tensors), self._next_call()))

    def _resolve(self) -> None:
        if not self._pending:
            return
        pending, self._pending = self._pending, []
        by_device: dict[torch.device, list[_Check]] = {}
        for check in pending:
            by_device.setdefault(check.abs_max.device, []).append(check)
        for checks in by_device.values():
            host = torch.stack([check.abs_max for check in checks]).tolist()
            for check, value in zip(checks, host, strict=True):
                self._add(check.name, check.module_type, check.kind, value, check.call)


def _abs_max(tensors: list[torch.Tensor]) -> torch.Tensor:
    """The largest magnitude over ``tensors`` as a 0-d float32 tensor (NaN if any is NaN)."""
    maxima = [t.detach().abs().amax().float() for t in tensors]
    device = maxima[0].device
    if len(maxima) == 1:
        return maxima[0]
    return torch.stack([m.to(device) for m in maxima]).amax()


def _float_tensors(value: Any) -> list[torch.Tensor]:
    """The non-empty floating-point tensors inside ``value`` (nested containers, dataclasses)."""
    found: list[torch.Tensor] = []
    seen: set[int] = set()
    stack = [value]
    while stack:
        item = stack.pop()
        if isinstance(item, torch.Tensor):
            if item.is_floating_point() and item.numel() > 0:
                found.append(item)
            continue
        if id(item) in seen:
            continue
        if isinstance(item, Mapping):  # includes transformers' ModelOutput (an OrderedDict)
            seen.add(id(item))
            stack.extend(reversed(list(item.values())))
        elif isinstance(item, list | tuple):
            seen.add(id(item))
            stack.extend(reversed(item))
        elif dataclasses.is_dataclass(item) and not isinstance(item, type):
            seen.add(id(item))
            fields = [getattr(item, f.name, None) for f in dataclasses.fields(item)]
            stack.extend(reversed(fields))
    return found


def locate_overflow(
    model: torch.nn.Module, *, dtype: Any = None, threshold: float | None = None
) -> contextlib.AbstractContextManager[LocatedOverflow]:
    """Records which modules' outputs or input gradients overflow during the block.

    A debugging tool, in the spirit of transformers' ``DebugUnderflowOverflow``
    (huggingface/transformers#11076, #12225): run one failing step inside it and read
    ``found.first``. A module's **forward** event is its output (every float tensor of a tuple,
    list, dict, dataclass or ``ModelOutput``; other outputs are ignored) holding inf or NaN or
    an element above the threshold; its **backward** event is the gradient w.r.t. its
    floating-point inputs, which its backward produced, doing the same. Events are in the
    order the checks ran: forward events in the order the modules returned (a layer before the
    block that contains it), then backward events as the backward pass reaches each module.

    The threshold is the maximum of the half dtype in force
    (:func:`~torch_facade.amp.get_half_dtype_str`: 65504 for float16, about 3.39e38 for
    bfloat16, about 4.29e9 for cbfloat16), so a float32 model run without autocast shows the
    layers whose activations would not fit in it. Scaled gradients are compared as they are:
    a loss scale that makes the last layer's gradient exceed float16's maximum shows as that
    layer's backward event.

    Off, it costs nothing: every hook is removed on exit, also when the block raises. On, each
    module call launches a reduction per float tensor; the values reach the host (one
    synchronisation per device) when the result is first read. Run the pass on the uncompiled
    module (``compiled._orig_mod``): hooks added to a compiled model recompile it.

    Args:
        model: the ``torch.nn.Module`` whose modules (``model.named_modules()``) to watch.
        dtype: the half format whose maximum is the threshold (``"float16"``, ``"bfloat16"``,
            ``"cbfloat16"``, ``torch.float16``, ``torch.bfloat16``); ``None`` (default) takes
            the half dtype in force.
        threshold: an explicit largest in-range magnitude instead (``math.inf``: record inf
            and NaN only). Give ``dtype`` or ``threshold``, not both.

    Returns:
        A context manager whose ``__enter__`` returns the :class:`LocatedOverflow` it fills.

    Raises:
        TypeError: ``model`` is not a ``torch.nn.Module``, or ``threshold`` is not a number.
        ValueError: ``dtype`` names no half dtype, ``threshold`` is not positive, or both
            were given.

    Example:
        >>> import torch
        >>> import torch_facade as cstorch
        >>> model = torch.nn.Sequential(
        ...     torch.nn.Linear(4, 8), torch.nn.Linear(8, 8), torch.nn.Linear(8, 1)
        ... )
        >>> for layer, weight in zip(model, (1.0, 1e4, 1.0)):  # layer 1 is the planted one
        ...     _ = torch.nn.init.constant_(layer.weight, weight)
        ...     _ = torch.nn.init.zeros_(layer.bias)
        >>> with cstorch.amp.locate_overflow(model) as found:
        ...     model(torch.ones(2, 4)).sum().backward()
        >>> found.first
        '1'
        >>> [(e.name, e.kind, e.abs_max) for e in found.events]  # doctest: +NORMALIZE_WHITESPACE
        [('1', 'forward', 320000.0), ('2', 'forward', 2560000.0), ('', 'forward', 2560000.0),
         ('1', 'backward', 80000.0)]
    """
    if not isinstance(model, torch.nn.Module):
        raise TypeError(
            "locate_overflow: model must be a torch.nn.Module (for flax or equinox models use "
            f"amp_core.locate_overflow.locate_overflow); got {type(model).__name__}"
        )
    limit, name = amp_core_locate.resolve_threshold(
        dtype, threshold, precision.get_half_dtype_str()
    )
    return _session(model, LocatedOverflow(limit, name))


@contextlib.contextmanager
def _session(model: torch.nn.Module, found: LocatedOverflow) -> Iterator[LocatedOverflow]:
    handles: list[Any] = []  # module hooks and the tensor hooks they add

    def watch(name: str, module: torch.nn.Module) -> None:
        module_type = type(module).__name__

        def on_gradient(gradient: torch.Tensor) -> None:
            if gradient.is_floating_point() and gradient.numel() > 0:
                found._record(name, module_type, _BACKWARD, [gradient])

        def before(_: torch.nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
            if not torch.is_grad_enabled():
                return
            for tensor in _float_tensors((args, kwargs)):
                if tensor.requires_grad:
                    handles.append(tensor.register_hook(on_gradient))

        def after(_: torch.nn.Module, args: tuple[Any, ...], output: Any) -> None:
            tensors = _float_tensors(output)
            if tensors:
                found._record(name, module_type, _FORWARD, tensors)

        handles.append(module.register_forward_pre_hook(before, with_kwargs=True))
        handles.append(module.register_forward_hook(after))

    try:
        for name, module in model.named_modules():
            watch(name, module)
        yield found
    finally:
        for handle in handles:
            handle.remove()
