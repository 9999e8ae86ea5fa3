"""What a training loop logs and asks when steps are skipped: metrics and the overflow report."""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any

import jax
import torch

from torch_facade.amp import _bridge, _dtensor, _storage

if TYPE_CHECKING:
    from torch_facade.amp.grad_scaler import GradScaler


@dataclasses.dataclass(frozen=True)
class OverflowReport:
    """The gradients that held inf or NaN at a decision, by parameter name.

    Attributes:
        gradients: for every gradient that overflowed, in optimizer order, the number of its
            elements that are inf or NaN once unscaled (0 for finite values so large that their
            squares overflow float32, which also skips a step).
        total: how many gradients were read.
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


def overflow_report(scaler: GradScaler, module: torch.nn.Module | None = None) -> OverflowReport:
    """The :class:`OverflowReport` of ``scaler``'s current (or last) decision.

    See :meth:`GradScaler.nonfinite_gradients`. In a distributed job it covers this rank's
    gradients (its shards under FSDP2). In a scaler's first iteration the decision also read the
    parameters the scaled losses reached that no known optimizer holds yet; without ``module``
    to name them they are ``unregistered_params[k]``, in the order the losses reached them.

    Raises:
        RuntimeError: the scaler has not taken a decision yet.
    """
    decision = scaler._decision or scaler._last_decision
    if decision is None:
        raise RuntimeError(
            "nonfinite_gradients() needs a decision: call it after unscale_() or step()"
        )
    names = {id(p): name for name, p in module.named_parameters()} if module is not None else {}
    entries: list[tuple[str, torch.Tensor, float]] = []
    seen: set[int] = set()
    for index, optimizer in enumerate(scaler._optimizers):
        inv_scale = decision.inverse_scale_of(optimizer)
        for g, group in enumerate(optimizer.param_groups):
            for j, param in enumerate(group["params"]):
                seen.add(id(param))
                if param.grad is None:
                    continue
                name = names.get(id(param), f"optimizer{index}.param_groups[{g}].params[{j}]")
                local = _dtensor.local_values(param.grad)[0]
                entries.append((name, _storage.in_memory_order(local), inv_scale))
    unregistered = [p for p in dict.fromkeys(scaler._reached) if id(p) not in seen]
    if unregistered:  # still as scaled: no optimizer has unscaled them
        inv_scale = float(_bridge.inverse_scale(decision.state_before))
        for k, param in enumerate(unregistered):
            if param.grad is None:
                continue
            name = names.get(id(param), f"unregistered_params[{k}]")
            local = _dtensor.local_values(param.grad)[0]
            entries.append((name, _storage.in_memory_order(local), inv_scale))
    found: dict[str, int] = {}
    for inv_scale in sorted({inv for _, _, inv in entries}):
        chosen = [(name, t) for name, t, inv in entries if inv == inv_scale]
        arrays = _bridge.import_tensors([t for _, t in chosen])
        leaves = jax.device_get(_bridge.report_core()(list(arrays), inv_scale))
        for (name, _), leaf in zip(chosen, leaves, strict=True):
            if bool(leaf.overflows):
                found[name] = int(leaf.nonfinite_count)
    ordered = {name: found[name] for name, _, _ in entries if name in found}
    return OverflowReport(ordered, len(entries))


def scaler_metrics(scaler: GradScaler, *, as_tensors: bool = False) -> dict[str, Any]:
    """The scaler's numbers for a logger, under the names the Cerebras modelzoo logs.

    ``loss_scale``, ``num_skipped_steps``, ``global_norm`` (of the last step's unscaled
    gradients) and ``isfinite`` (whether the last step was applied), read after ``update()``.

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
    if as_tensors:
        return values
    return {key: value.item() for key, value in values.items()}
