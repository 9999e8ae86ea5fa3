"""Says what cbfloat16 is off Cerebras hardware, once, at a scaler's first overflow decision.

Most ModelZoo configurations set ``fp16_type: cbfloat16`` with dynamic loss scaling. The
scaler then takes cbfloat16's defaults (``init_scale`` and ``max_loss_scale`` ``2**31``), sized
for cbfloat16's range (about ``2**32``). Off Cerebras hardware a model cast to the float16
proxy dtype (or autocast to it) computes with float16 numerics, which overflow above 65504: the
first steps overflow and are skipped while the scale halves down to float16's range, and
nothing else would tell the user why.

So at a dynamic scaler's first decision, if the half dtype it was built for is cbfloat16, its
scale is still beyond float16's range and the step computed in the float16 proxy (float16
gradients, or ``cstorch.amp.autocast()`` with the cbfloat16 half dtype since the last
decision or ``set_half_dtype``), it warns once, naming the two remedies. A model inside
``cstorch.amp.cbfloat16_numerics`` (float32 gradients, real cbfloat16 rounding) is not warned.
"""

from __future__ import annotations

import warnings
import weakref
from collections.abc import Callable, Iterable
from typing import Any

import torch

import amp_core
from torch_facade.amp import _caller, _half_state

FLOAT16_MAX = float(torch.finfo(torch.float16).max)
"""65504: a loss scale above it overflows any float16 loss of magnitude 1 or more."""

_CHECKED: weakref.WeakSet[Any] = weakref.WeakSet()


def _float16_gradients(params: Iterable[torch.Tensor]) -> bool:
    return any(p.grad is not None and p.grad.dtype is torch.float16 for p in params)


def message(scale: float) -> str:
    """The warning's text for a scaler whose first decision found the scale ``scale``.

    Example:
        >>> from torch_facade.amp._engine._cbfloat16_notice import message
        >>> "cbfloat16_numerics" in message(2.0**31) and "init_scale=2**15" in message(2.0**31)
        True
    """
    return (
        f"GradScaler: the half dtype is cbfloat16 and the loss scale is {scale:g} (cbfloat16's "
        "dynamic-loss-scaling default, 2**31, sized for its range of about 2**32), but this "
        "step computed in cbfloat16's float16 proxy dtype: off Cerebras hardware that is "
        "float16 numerics, which overflow above 65504. So the first steps overflow and are "
        "skipped while the scale halves down to float16's range. For cbfloat16 numerics, keep "
        "the model in float32 and run it inside cstorch.amp.cbfloat16_numerics(model); for "
        "float16 numerics without the skipped steps, build the scaler with init_scale=2**15 "
        "(and max_loss_scale=2**15), the float16 defaults."
    )


def check(
    owner: Any,
    config: amp_core.LossScaleConfig,
    scale: Callable[[], float],
    params: Iterable[torch.Tensor],
) -> None:
    """Warns once per scaler, at its first decision, when cbfloat16 defaults meet float16.

    The engine calls it at every overflow decision, with the parameters whose gradients the
    decision read; it clears the record of a cbfloat16-proxy autocast each time, and only
    looks at a scaler's first decision.

    Args:
        owner: the deciding scaler's engine (remembered, weakly, once looked at).
        config: its configuration.
        scale: reads its current loss scale (a host read, made at most once per scaler).
        params: the parameters whose gradients the decision read.
    """
    proxy_autocast = _half_state.take_proxy_autocast_seen()
    if owner in _CHECKED:
        return
    _CHECKED.add(owner)
    if not isinstance(config, amp_core.DynamicLossScale) or config.half_dtype != "cbfloat16":
        return
    if not (proxy_autocast or _float16_gradients(params)):
        return
    value = scale()
    if value > FLOAT16_MAX:
        warnings.warn(message(value), UserWarning, stacklevel=_caller.stacklevel())
