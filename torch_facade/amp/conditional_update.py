"""State that must not advance on a skipped step: ``update_if_finite`` and ``isfinite``.

On Cerebras hardware a skipped step still runs (branch-free): the reference snapshots the
parameters and optimizer state, steps, and selects the old values back when the gradients
overflowed. Code that keeps its own per-step state (cstorch's LR schedulers count steps in a
``last_epoch`` tensor, its sparsity schedules in a ``step`` tensor) marks that state with
``cstorch.amp.update_if_finite(optimizer, tensor)``, and reads the decision with
``cstorch.amp.isfinite(optimizer)``.

Here the same two calls work with plain torch optimizers:

* :func:`update_if_finite` marks a tensor for the iteration of the ``GradScaler`` that steps
  ``optimizer``. If that iteration's step was skipped, the tensor is restored to its value at
  marking: at the scaler's ``update()`` for tensors marked up to then, and at its next
  ``scale()`` for tensors marked after ``update()`` (an LR scheduler stepped after the scaler,
  as in torch's loop order). The restore is branch-free, ``torch.where(isfinite, tensor,
  saved)``, with no host synchronisation. Marking a tensor twice in an iteration keeps the
  later value, as in the reference.
* :func:`isfinite` is that scaler's overflow decision: this iteration's once taken, else the
  last one's.

An optimizer no ``GradScaler`` has met yet has no decision: ``update_if_finite`` does nothing
and ``isfinite`` is ``True``, as in the reference for an optimizer without amp state.

Example:
    >>> import torch, torch_facade as cstorch
    >>> model = torch.nn.Linear(2, 1)
    >>> optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    >>> scaler = cstorch.amp.GradScaler(loss_scale="dynamic")
    >>> counter = torch.tensor(0)
    >>> scaler.scale(model(torch.ones(1, 2)).sum()).backward()
    >>> model.bias.grad.fill_(float("inf"))  # this step overflows: it is skipped
    tensor([inf])
    >>> scaler.step(optimizer)
    >>> scaler.update()
    >>> cstorch.amp.update_if_finite(optimizer, counter)
    >>> counter += 1  # e.g. a scheduler's step counter
    >>> bool(cstorch.amp.isfinite(optimizer)), int(counter)
    (False, 1)
    >>> _ = scaler.scale(model(torch.ones(1, 2)).sum())  # the next iteration restores it
    >>> int(counter)
    0
"""

from __future__ import annotations

from typing import Any

import torch

from torch_facade.amp._engine import engine_of, mark
from torch_facade.amp._host_side import host_side

__all__ = ["isfinite", "setup_optimizer", "update_if_finite"]


def _check_optimizer(optimizer: Any) -> torch.optim.Optimizer | None:
    if optimizer is None or isinstance(optimizer, torch.optim.Optimizer):
        return optimizer
    raise TypeError(
        "optimizer must be a torch.optim.Optimizer (or None); got "
        f"{optimizer!r} ({type(optimizer).__name__})"
    )


@host_side
def update_if_finite(optimizer: torch.optim.Optimizer | None, tensor: torch.Tensor) -> None:
    """Marks ``tensor`` to be restored if this iteration's step of ``optimizer`` is skipped.

    The tensor's value now is saved; if the overflow decision of the ``GradScaler`` that steps
    ``optimizer`` skips this iteration's step, the tensor is set back to it (in place) at the
    scaler's ``update()``, or, for a tensor marked after ``update()``, at its next ``scale()``.
    Anything computed from the tensor in between is not recomputed. Does nothing for
    ``optimizer=None`` or an optimizer no ``GradScaler`` has met, as the reference does for an
    optimizer without amp state.

    Args:
        optimizer: the optimizer whose step the tensor's update belongs to.
        tensor: the tensor to restore on a skipped step (changed in place afterwards).

    Raises:
        TypeError: ``optimizer`` is not a ``torch.optim.Optimizer`` or ``None``, or ``tensor``
            is not a ``torch.Tensor``.

    Example:
        >>> import torch, torch_facade as cstorch
        >>> optimizer = torch.optim.SGD(torch.nn.Linear(1, 1).parameters(), lr=0.1)
        >>> cstorch.amp.update_if_finite(optimizer, torch.tensor(0))  # no scaler: nothing to do
    """
    optimizer = _check_optimizer(optimizer)
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"tensor must be a torch.Tensor; got {tensor!r} ({type(tensor).__name__})")
    engine = None if optimizer is None else engine_of(optimizer)
    if engine is None or not engine.dynamic:  # static scaling never skips
        return
    mark(engine, tensor)


@host_side
def isfinite(optimizer: torch.optim.Optimizer | None) -> torch.Tensor | bool:
    """Whether the step of ``optimizer`` was (or is being) applied: the scaler's decision.

    Returns:
        The 0-d bool tensor of the overflow decision of the ``GradScaler`` that steps
        ``optimizer`` (this iteration's once taken, at the first ``unscale_`` or ``step``, else
        the last iteration's); no host synchronisation. ``True`` (a Python bool) for ``None``
        or an optimizer no scaler has met, as in the reference.

    Raises:
        TypeError: ``optimizer`` is not a ``torch.optim.Optimizer`` or ``None``.

    Example:
        >>> import torch, torch_facade as cstorch
        >>> optimizer = torch.optim.SGD(torch.nn.Linear(1, 1).parameters(), lr=0.1)
        >>> cstorch.amp.isfinite(optimizer)
        True
    """
    optimizer = _check_optimizer(optimizer)
    engine = None if optimizer is None else engine_of(optimizer)
    if engine is None:
        return True
    return engine.isfinite()


def setup_optimizer(optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
    """Not available here: the reference's preparation of its own optimizer class for amp.

    The reference's ``GradScaler`` calls it on every ``cerebras.pytorch.optim.Optimizer`` to
    attach its amp state. Plain torch optimizers need no preparation here: a ``GradScaler``
    meets an optimizer when it is passed to any of its methods, or up front with
    ``GradScaler(..., optimizers=[optimizer])``.

    Raises:
        NotImplementedError: always, saying what to use instead.

    Example:
        >>> import torch, torch_facade as cstorch
        >>> optimizer = torch.optim.SGD(torch.nn.Linear(1, 1).parameters(), lr=0.1)
        >>> cstorch.amp.setup_optimizer(optimizer)
        Traceback (most recent call last):
        ...
        NotImplementedError: cstorch.amp.setup_optimizer prepares cerebras.pytorch's own optimizer class for its GradScaler; torch optimizers need no preparation here. Register the optimizer with GradScaler(..., optimizers=[optimizer]), or just pass it to grad_scaler.step(optimizer).
    """
    raise NotImplementedError(
        "cstorch.amp.setup_optimizer prepares cerebras.pytorch's own optimizer class for its "
        "GradScaler; torch optimizers need no preparation here. Register the optimizer with "
        "GradScaler(..., optimizers=[optimizer]), or just pass it to grad_scaler.step(optimizer)."
    )
