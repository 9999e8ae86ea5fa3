"""What a training loop logs and asks when steps are skipped: metrics, the overflow report and
the gradient-range report."""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable, Iterable
from typing import Any, Protocol

import jax
import torch

import amp_core
from hardware import canonical_half_dtype
from torch_facade.amp import precision
from torch_facade.amp._engine import import_tensors, local_gradient
from torch_facade.amp._host_side import host_side


class LossScaleStalledError(RuntimeError):
    """Dynamic loss scaling can no longer help: the scale sits at ``min_loss_scale`` and every
    step still overflows (raised with ``GradScaler(..., raise_on_stall=True)``).

    Attributes:
        report: the :class:`~torch_facade.amp.OverflowReport` of the last step: which gradients
            held inf or NaN.

    Example:
        >>> import torch, torch_facade as cstorch
        >>> model = torch.nn.Linear(2, 1)
        >>> optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        >>> scaler = cstorch.amp.GradScaler(
        ...     "dynamic", init_scale=1.0, min_loss_scale=1.0, stall_steps=1, raise_on_stall=True
        ... )
        >>> scaler.scale(model(torch.ones(1, 2)).sum()).backward()
        >>> model.bias.grad.fill_(float("nan"))
        tensor([nan])
        >>> scaler.step(optimizer)
        >>> try:
        ...     scaler.update()  # an overflow with the scale already at min_loss_scale
        ... except cstorch.amp.LossScaleStalledError as err:
        ...     print(err.report)
        1 of 2 gradients non-finite: optimizer0.param_groups[0].params[1] (1 element)
    """

    def __init__(self, message: str, report: Any) -> None:
        super().__init__(message)
        self.report = report


@dataclasses.dataclass(frozen=True)
class OverflowReport:
    """The gradients that held inf or NaN at a decision, by parameter name.

    It names the parameters; to find the layer whose output or backward first left the half
    format's range, rerun the step inside :func:`~torch_facade.amp.locate_overflow`.

    Attributes:
        gradients: for every gradient that overflowed, in optimizer order, the number of its
            elements that are inf or NaN once unscaled (0 for finite values so large that their
            squares overflow float32, which also skips a step).
        total: how many gradients were read.

    Example:
        >>> import torch_facade as cstorch
        >>> report = cstorch.amp.OverflowReport({"fc.weight": 3, "fc.bias": 1}, total=4)
        >>> bool(report), report.gradients["fc.weight"]
        (True, 3)
        >>> print(report)
        2 of 4 gradients non-finite: fc.weight (3 elements), fc.bias (1 element)
    """

    gradients: dict[str, int]
    total: int

    def __bool__(self) -> bool:
        return bool(self.gradients)

    def __str__(self) -> str:
        head = f"{len(self.gradients)} of {self.total} gradients non-finite"
        if not self.gradients:
            return head
        return f"{head}: " + ", ".join(
            f"{name} ({_elements(count)})" for name, count in self.gradients.items()
        )


def _elements(count: int) -> str:
    if count == 0:
        return "finite values too large to square in float32"
    return f"{count} element{'s' if count != 1 else ''}"


class _Readable(Protocol):
    """The accessors :func:`scaler_metrics` reads (a :class:`GradScaler` has them)."""

    def get_scale(self) -> torch.Tensor | float: ...
    def get_num_skipped_steps(self) -> torch.Tensor: ...
    def get_global_norm(self) -> torch.Tensor: ...
    def get_isfinite(self) -> torch.Tensor: ...


@host_side
def scaler_metrics(scaler: _Readable, *, as_tensors: bool = False) -> dict[str, Any]:
    """The scaler's numbers for a logger, under the names the Cerebras modelzoo logs.

    ``loss_scale``, ``num_skipped_steps``, ``global_norm`` (of the last step's unscaled
    gradients) and ``isfinite`` (whether the last step was applied), read after ``update()``;
    with ``spike_skip`` (:class:`cstorch.amp.SpikeSkip <amp_core.SpikeSkip>`), also
    ``num_spike_skips``.

    Args:
        scaler: the :class:`GradScaler`.
        as_tensors: return 0-d tensors (no host synchronisation) instead of Python numbers.

    Returns:
        ``{"loss_scale": ..., "num_skipped_steps": ..., "global_norm": ..., "isfinite": ...}``.

    Example:
        >>> import torch_facade as cstorch
        >>> scaler = cstorch.amp.GradScaler(loss_scale="dynamic")
        >>> cstorch.amp.scaler_metrics(scaler)
        {'loss_scale': 32768.0, 'num_skipped_steps': 0, 'global_norm': 0.0, 'isfinite': True}
    """
    scale = scaler.get_scale()
    values = {
        "loss_scale": scale if isinstance(scale, torch.Tensor) else torch.tensor(scale),
        "num_skipped_steps": scaler.get_num_skipped_steps(),
        "global_norm": scaler.get_global_norm(),
        "isfinite": scaler.get_isfinite(),
    }
    config = getattr(scaler, "config", None)
    if getattr(config, "spike_skip", None) is not None:
        values["num_spike_skips"] = scaler.get_num_spike_skips()  # type: ignore[attr-defined]
    if as_tensors:
        return values
    return {key: value.item() for key, value in values.items()}


@dataclasses.dataclass(frozen=True)
class GradientRangeReport:
    """How a model's gradients fit a half dtype at a loss scale, per parameter and in total.

    The numbers are :class:`amp_core.GradientRange`'s (Python ints, and a float headroom):
    ``size``, ``zeros``, ``underflows`` (nonzero elements that round to zero), ``subnormals``
    (elements that keep fewer significant bits), ``overflows``, ``nonfinite`` and ``headroom``
    (doublings of the scale left before the largest element overflows).

    Attributes:
        parameters: per parameter name (``module.named_parameters()`` names, or
            ``params[i]``), its :class:`amp_core.GradientRange`; parameters without a gradient
            are left out.
        total: the counts summed over every parameter, and the smallest headroom.
        half_dtype: the format checked against.
        loss_scale: the scale the gradients were multiplied by.
        suggested_loss_scale: the largest power of two that leaves ``headroom`` doublings
            below the format's largest value for the largest gradient element
            (``amp_core.suggested_loss_scale``; ``inf`` when every gradient is zero).
        headroom: the doublings the suggestion leaves.

    Example:
        >>> import torch, torch_facade as cstorch
        >>> model = torch.nn.Linear(2, 1)
        >>> model.weight.grad = torch.tensor([[1e-8, 3.0]])
        >>> model.bias.grad = torch.tensor([2e-5])
        >>> report = cstorch.amp.gradient_range_report(model, half_dtype="float16")
        >>> report.total.underflows, report.total.subnormals, report.total.headroom
        (1, 1, 14.0)
        >>> report.suggested_loss_scale  # 3.0 * 2**12 = 12288: 2 doublings below 65504
        4096.0
        >>> print(report)
        float16 at loss scale 1: 1 of 3 elements underflow (33.3%), 1 subnormal, 0 overflow
          weight: 1 of 2 underflow, 0 subnormal, 0 overflow, headroom 14
          bias: 0 of 1 underflow, 1 subnormal, 0 overflow, headroom 31
        suggested loss scale 2^12 (2 doublings of headroom)
    """

    parameters: dict[str, amp_core.GradientRange]
    total: amp_core.GradientRange
    half_dtype: str
    loss_scale: float
    suggested_loss_scale: float
    headroom: int

    @property
    def underflow_fraction(self) -> float:
        """The fraction of all gradient elements that underflow to zero (0 when there are none)."""
        size = int(self.total.size)
        return int(self.total.underflows) / size if size else 0.0

    def __str__(self) -> str:
        total = self.total
        lines = [
            f"{self.half_dtype} at loss scale {self.loss_scale:g}: {total.underflows} of "
            f"{total.size} elements underflow ({100 * self.underflow_fraction:.1f}%), "
            f"{total.subnormals} subnormal, {total.overflows} overflow"
        ]
        lines += [
            f"  {name}: {leaf.underflows} of {leaf.size} underflow, {leaf.subnormals} subnormal, "
            f"{leaf.overflows} overflow, headroom {leaf.headroom:g}"
            for name, leaf in self.parameters.items()
        ]
        lines.append(
            f"suggested loss scale {_power_of_two(self.suggested_loss_scale)} "
            f"({self.headroom} doublings of headroom)"
        )
        return "\n".join(lines)


@host_side
def gradient_range_report(
    parameters: torch.nn.Module | Iterable[torch.Tensor],
    *,
    half_dtype: Any = None,
    loss_scale: Any = 1.0,
    headroom: int = 2,
) -> GradientRangeReport:
    """How the gradients of ``parameters`` fit ``half_dtype`` at ``loss_scale``: per parameter,
    the elements that would underflow, lose precision or overflow, and the doublings of headroom.

    It answers "is my loss scale right?" before a run goes wrong. The gradients are read as
    *unscaled* (true) values: call it after ``grad_scaler.unscale_(optimizer)``, or on the
    gradients of a float32 backward pass. They are multiplied by ``loss_scale`` in float32 and
    rounded to the format by ``amp_core.gradient_range_report`` (the numbers all come from
    there). It reads every gradient element and synchronises with the host: call it now and then,
    not on every step. The report also suggests a loss scale, ``report.suggested_loss_scale``:
    the largest power of two that leaves ``headroom`` doublings between the largest gradient
    element and the format's largest value (``amp_core.suggested_loss_scale``).

    Args:
        parameters: a ``torch.nn.Module`` (its parameters, by name) or an iterable of tensors
            (named ``params[i]``); those whose ``.grad`` is ``None`` are left out.
        half_dtype: ``"float16"``, ``"bfloat16"``, ``"cbfloat16"``, ``torch.float16`` or
            ``torch.bfloat16``; ``None`` uses the current ``cstorch.amp.get_half_dtype_str()``.
        loss_scale: a positive number or 0-d tensor, or a :class:`GradScaler` (its current
            scale).
        headroom: the doublings the suggested loss scale leaves before the largest element
            overflows (a non-negative integer).

    Returns:
        The :class:`GradientRangeReport`.

    Raises:
        TypeError: ``parameters`` is neither a module nor an iterable of tensors.
        ValueError: ``half_dtype`` is not a half dtype, ``loss_scale`` is not positive and
            finite, ``headroom`` is not a non-negative integer, or no parameter has a gradient.

    Example:
        >>> import torch, torch_facade as cstorch
        >>> model = torch.nn.Linear(4, 1)
        >>> model(torch.full((1, 4), 1e-5)).sum().mul(1e-4).backward()  # weight gradients 1e-9
        >>> cstorch.amp.gradient_range_report(model, half_dtype="float16").total.underflows
        4
        >>> cstorch.amp.gradient_range_report(model, loss_scale=2.0**15).total.underflows
        0
        >>> cstorch.amp.gradient_range_report(model, half_dtype="float16").suggested_loss_scale
        134217728.0
    """
    named = _named_gradients(parameters)
    dtype = canonical_half_dtype(
        precision.get_half_dtype_str() if half_dtype is None else half_dtype,
        argument="half_dtype",
    )
    scale = _loss_scale_value(loss_scale)
    if isinstance(headroom, bool) or not isinstance(headroom, int) or headroom < 0:
        raise ValueError(f"headroom must be a non-negative integer (doublings); got {headroom!r}")
    arrays = list(import_tensors(list(named.values())))
    leaves, suggested = _range_core(dtype, headroom)(arrays, scale)
    leaves, total, suggested = jax.device_get(
        (leaves, amp_core.gradient_range_totals(leaves), suggested)
    )
    return GradientRangeReport(
        parameters={name: _as_python(leaf) for name, leaf in zip(named, leaves, strict=True)},
        total=_as_python(total),
        half_dtype=dtype,
        loss_scale=scale,
        suggested_loss_scale=float(suggested),
        headroom=headroom,
    )


@functools.cache
def _range_core(half_dtype: str, headroom: int) -> Callable[[list[jax.Array], float], Any]:
    return jax.jit(
        functools.partial(_gradient_ranges, half_dtype=half_dtype, headroom=headroom),
    )


def _gradient_ranges(
    grads: list[jax.Array], scale: jax.Array, *, half_dtype: str, headroom: int
) -> tuple[Any, jax.Array]:
    report = amp_core.gradient_range_report(grads, half_dtype=half_dtype, loss_scale=scale)
    return report, amp_core.suggested_loss_scale(grads, half_dtype=half_dtype, headroom=headroom)


def _power_of_two(value: float) -> str:
    """``2^k`` for a power of two, else ``%g``."""
    if 0 < value < math.inf and math.log2(value) == int(math.log2(value)):
        return f"2^{int(math.log2(value))}"
    return f"{value:g}"


def _named_gradients(parameters: Any) -> dict[str, torch.Tensor]:
    if isinstance(parameters, torch.nn.Module):
        pairs = list(parameters.named_parameters())
    elif isinstance(parameters, Iterable) and not isinstance(parameters, (str, torch.Tensor)):
        pairs = [(f"params[{i}]", p) for i, p in enumerate(parameters)]
        for name, p in pairs:
            if not isinstance(p, torch.Tensor):
                raise TypeError(
                    f"parameters must be a torch.nn.Module or an iterable of tensors; {name} "
                    f"is {type(p).__name__}"
                )
    else:
        raise TypeError(
            "parameters must be a torch.nn.Module or an iterable of tensors; got "
            f"{type(parameters).__name__}"
        )
    named = {name: local_gradient(p) for name, p in pairs if p.grad is not None}
    if not named:
        raise ValueError(
            "parameters: no parameter has a gradient (.grad is None for all "
            f"{len(pairs)}); call it after backward()"
        )
    return named


def _loss_scale_value(loss_scale: Any) -> float:
    if hasattr(loss_scale, "get_scale"):
        loss_scale = loss_scale.get_scale()
    if isinstance(loss_scale, torch.Tensor):
        if loss_scale.numel() != 1:
            raise ValueError(f"loss_scale must be 0-d; got shape {tuple(loss_scale.shape)}")
        loss_scale = loss_scale.item()
    if isinstance(loss_scale, bool) or not isinstance(loss_scale, (int, float)):
        raise ValueError(
            "loss_scale must be a positive number, a 0-d tensor or a GradScaler; got "
            f"{type(loss_scale).__name__}"
        )
    if not (loss_scale > 0 and loss_scale < float("inf")):
        raise ValueError(f"loss_scale must be positive and finite; got {loss_scale!r}")
    return float(loss_scale)


def _as_python(leaf: Any) -> amp_core.GradientRange:
    """The range with Python numbers (ints, a float headroom) in place of 0-d arrays."""
    return amp_core.GradientRange._make([*(int(v) for v in leaf[:-1]), float(leaf.headroom)])
