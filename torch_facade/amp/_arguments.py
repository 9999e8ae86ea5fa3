"""Argument checks the public modules share (each names the argument, what was expected and
what was got)."""

from __future__ import annotations

from typing import Any

import torch


def check_optimizer(value: Any, argument: str) -> torch.optim.Optimizer:
    """``value`` if it is a ``torch.optim.Optimizer``.

    Raises:
        TypeError: it is not.
    """
    if not isinstance(value, torch.optim.Optimizer):
        raise TypeError(f"{argument} must be a torch.optim.Optimizer; got {type(value).__name__}")
    return value


def optimizer_list(value: Any, argument: str) -> list[torch.optim.Optimizer]:
    """One optimizer, or a non-empty list or tuple of them, as a list.

    Raises:
        TypeError: anything else.
    """
    if isinstance(value, torch.optim.Optimizer):
        return [value]
    if isinstance(value, (list, tuple)) and value:
        return [check_optimizer(o, f"{argument}[{i}]") for i, o in enumerate(value)]
    raise TypeError(
        f"{argument} must be a torch.optim.Optimizer or a non-empty list or tuple of them; "
        f"got {value!r}"
    )
