"""Host cost per gradient tensor: the CPU's stand-in for a launch-bound GPU loop.

A model of ``n`` one-element parameters whose loss is their sum (``torch.stack(params).sum()``:
backward hands every parameter a fresh, independent, 64-byte-aligned ``1.0``), trained with the
documented loop of :mod:`workbench.whole_loop` (``zero_grad()`` with torch's default, forward,
``scale(loss).backward()``, ``step``, ``update``). There is nothing to compute, so a scaler's
overhead over the bare loop is its per-tensor bookkeeping, crossing and dispatch: the part of its
cost that on a GPU would be host time between kernel launches. ``n`` = 148 is the tensor count of
the M model, 1,000 that of a model with many small tensors.

Variants (interleaved, one process): ``bare`` (no scaler), ``torch``
(``torch.amp.GradScaler("cpu")``) and ``facade`` (``cstorch.amp.GradScaler(loss_scale="dynamic")``),
for SGD(foreach) and AdamW(fused), the facade's two paths (gradients multiplied in place, and the
scale handed to a fused kernel). :mod:`benchmarks.host_profile` breaks the facade's time down.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from workbench import whole_loop
from workbench.timing import CompileCounter, Plan

TENSORS = (148, 1000)
"""Gradient tensor counts measured by default."""

OPTIMIZERS = ("SGD foreach", "AdamW fused")
"""Keys of :data:`benchmarks.whole_loop.OPTIMIZERS` measured."""

VARIANTS = ("bare", "torch", "facade")
"""The whole-iteration variants compared (:data:`workbench.whole_loop.VARIANTS`)."""


class ScalarSum(nn.Module):
    """``n`` one-element parameters; the forward pass returns their sum.

    Args:
        tensors: the number of parameters.
        seed: seeds their values (standard normal).

    Example:
        >>> from benchmarks.host_bench import ScalarSum
        >>> model = ScalarSum(3)
        >>> model(None).backward()
        >>> [p.grad.item() for p in model.parameters()]
        [1.0, 1.0, 1.0]
    """

    def __init__(self, tensors: int, seed: int = 0) -> None:
        super().__init__()
        if tensors < 1:
            raise ValueError(f"tensors must be positive; got {tensors}")
        generator = torch.Generator().manual_seed(seed)
        self.values = nn.ParameterList(
            nn.Parameter(torch.randn(1, generator=generator)) for _ in range(tensors)
        )

    def forward(self, tokens: torch.Tensor | None = None) -> torch.Tensor:
        """The sum of the parameters (``tokens`` is ignored)."""
        return torch.stack(list(self.values)).sum()


def _scalar_loss(model: nn.Module, tokens: torch.Tensor) -> torch.Tensor:
    return model(tokens)


def make_workload(tensors: int, seed: int = 0) -> whole_loop.Workload:
    """A :class:`~workbench.whole_loop.Workload` of ``tensors`` one-element parameters."""
    return whole_loop.Workload(
        spec=None, model=ScalarSum(tensors, seed), tokens=torch.zeros(0), loss_fn=_scalar_loss
    )


def label(tensors: int) -> str:
    """The row and case name of a tensor count: ``"148 x 1"``."""
    return f"{tensors} x 1"


def run_group(
    tensors: int,
    optimizer: str,
    plan: Plan,
    counter: CompileCounter,
    on_round: Callable[[], object] = lambda: None,
    seed: int = 0,
) -> whole_loop.WholeGroup:
    """Measures :data:`VARIANTS` on ``tensors`` one-element gradients, interleaved.

    Args:
        tensors: the number of gradient tensors.
        optimizer: one of :data:`OPTIMIZERS`.
        plan: rounds, iterations per round and warm-up.
        counter: a listening compile counter.
        on_round: progress callback, once per round.
        seed: seeds the parameter values.
    """
    workload = make_workload(tensors, seed)
    return whole_loop.run_group(
        workload, optimizer, True, plan, counter, on_round, variants=VARIANTS
    )
