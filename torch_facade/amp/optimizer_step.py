"""``cstorch.amp.optimizer_step``: backward, unscale, clip, step, update and zero_grad in one call."""

from __future__ import annotations

import math
from typing import Any

import torch

from torch_facade.amp._arguments import optimizer_list
from torch_facade.amp._engine import params_of
from torch_facade.amp._host_side import host_side
from torch_facade.amp.grad_scaler import GradScaler, decide_with_fused_clip, register_optimizers


def _clip_value(value: Any, argument: str) -> float | None:
    if value is None:
        return None
    if isinstance(value, (bool, str, bytes)) or not isinstance(value, (int, float)):
        raise TypeError(f"{argument} must be a number or None; got {value!r}")
    if not math.isfinite(value) or value < 0:
        raise ValueError(f"{argument} must be a finite number >= 0; got {value!r}")
    return float(value)


@host_side
def optimizer_step(
    loss: torch.Tensor,
    optimizer: torch.optim.Optimizer
    | list[torch.optim.Optimizer]
    | tuple[torch.optim.Optimizer, ...],
    grad_scaler: GradScaler,
    max_gradient_norm: float | None = None,
    max_gradient_value: float | None = None,
) -> None:
    """Performs loss scaling, gradient unscaling, optional clipping and the optimizer step.

    Order: validate every argument (before any backward) -> ``grad_scaler.scale(loss).backward()``
    -> unscale each optimizer -> clip by norm or by value over the parameters of **all** given
    optimizers -> ``step`` each -> ``update()`` once -> ``zero_grad()`` each.

    With dynamic loss scaling and ``max_gradient_norm``, the clipping is fused into the overflow
    check (one read of the gradients); the coefficient is ``clip_grad_norm_``'s,
    ``min(max_norm / (norm + 1e-6), 1)``.

    Args:
        loss: the (unscaled) loss tensor; backward is called here.
        optimizer: one optimizer, or a list or tuple of them.
        grad_scaler: the :class:`GradScaler`.
        max_gradient_norm: clip the global gradient norm to this value.
        max_gradient_value: clip every gradient element to ``[-value, value]``.

    Raises:
        TypeError: an argument of the wrong type.
        ValueError: a negative or non-finite clip value, both clip values, or a loss that is not
            a scalar requiring grad.

    Example:
        >>> import torch, torch_facade as cstorch
        >>> model = torch.nn.Linear(3, 1)
        >>> optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        >>> grad_scaler = cstorch.amp.GradScaler(loss_scale="dynamic")
        >>> loss = model(torch.ones(4, 3)).square().mean()
        >>> cstorch.amp.optimizer_step(loss, optimizer, grad_scaler, max_gradient_norm=1.0)
        >>> int(grad_scaler.get_num_skipped_steps())
        0
    """
    if not isinstance(loss, torch.Tensor):
        raise TypeError(f"loss must be a torch.Tensor; got {type(loss).__name__}")
    optimizers = optimizer_list(optimizer, "optimizer")
    if len(set(map(id, optimizers))) != len(optimizers):
        raise ValueError("optimizer lists the same optimizer more than once")
    if not isinstance(grad_scaler, GradScaler):
        raise TypeError(
            f"grad_scaler must be a torch_facade.amp.GradScaler; got {type(grad_scaler).__name__}"
        )
    norm = _clip_value(max_gradient_norm, "max_gradient_norm")
    value = _clip_value(max_gradient_value, "max_gradient_value")
    if norm is not None and value is not None:
        raise ValueError(
            "only one of max_gradient_norm and max_gradient_value may be set; got "
            f"max_gradient_norm={max_gradient_norm!r} and max_gradient_value={max_gradient_value!r}"
        )
    if loss.numel() != 1 or not loss.requires_grad:
        raise ValueError(
            "loss must be a single-element tensor that requires grad; got shape "
            f"{tuple(loss.shape)} with requires_grad={loss.requires_grad}"
        )
    register_optimizers(grad_scaler, optimizers)

    grad_scaler.scale(loss).backward()
    params = [p for opt in optimizers for p in params_of(opt)]
    # Nothing can observe the gradients between unscale and step here, so where it can the
    # unscale and the clip are left to the single fused pass (and to fused optimizers' kernels).
    if norm is None or not decide_with_fused_clip(grad_scaler, optimizers, norm):
        for opt in optimizers:
            grad_scaler.unscale_(opt)
        if norm is not None:
            torch.nn.utils.clip_grad_norm_(params, norm)
        elif value is not None:
            torch.nn.utils.clip_grad_value_(params, value)
    for opt in optimizers:
        grad_scaler.step(opt)
    grad_scaler.update()
    for opt in optimizers:
        opt.zero_grad()
