"""Section 1: the torch facade against ``torch.amp.GradScaler("cpu")`` and a bare optimizer step."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import torch

import torch_facade as cstorch
from workbench.sizes import GradientSet
from workbench.timing import CompileCounter, FirstStep, Plan, Timing, Variant, measure_group
from workbench.whole_loop import LOSS_SCALE, NEVER, OPTIMIZERS, VARIANTS

BIG_NORM = 1e6
"""The clipping threshold: far above the gradients' norm, so clipping computes but never bites."""

WARMUP_STEPS = 2
"""Untimed steps after the first: fused AdamW takes the facade's fused path once its state exists
(from the second step on)."""


@dataclasses.dataclass
class TorchGroup:
    """The measurements of one size and optimizer.

    Attributes:
        optimizer: key of :data:`OPTIMIZERS`.
        first: first step of every variant.
        timings: timed rounds of every variant.
    """

    optimizer: str
    first: dict[str, FirstStep]
    timings: dict[str, Timing]


def _refill(params: list[torch.nn.Parameter], saved: list[torch.Tensor]) -> Callable[[], None]:
    def refill() -> None:
        # In place into the persistent ``.grad`` tensors (never replaced by either scaler).
        torch._foreach_copy_([p.grad for p in params], saved)

    return refill


def make_variant(name: str, optimizer: str, grads: GradientSet) -> Variant:
    """Builds one variant on fresh parameters (gradients filled from ``grads``).

    Timed calls: ``bare``: ``opt.step()``; ``torch``: ``scaler.scale(loss); scaler.step(opt);
    scaler.update()`` (``loss`` a constant scalar: both scalers require a ``scale`` call per
    iteration, and the gradients come from the refill); ``torch+clip``: ``scaler.unscale_(opt);
    clip_grad_norm_(params, BIG_NORM)`` before ``step``; ``facade`` and ``facade+clip``: the
    calls of ``torch`` with
    ``cstorch.amp.GradScaler(loss_scale="dynamic", ...)``, the latter with
    ``max_gradient_norm=BIG_NORM`` (DLS + GCC: clipping folded into the overflow check).

    Args:
        name: one of :data:`VARIANTS`.
        optimizer: one of :data:`OPTIMIZERS`.
        grads: the size's parameters and gradients.

    Raises:
        ValueError: unknown variant name.
    """
    params = grads.new_parameters()
    opt = OPTIMIZERS[optimizer](params)
    refill = _refill(params, grads.grads)
    if name == "bare":
        return Variant(name, opt.step, refill)
    loss = torch.ones(())
    if name in ("torch", "torch+clip"):
        scaler = torch.amp.GradScaler("cpu", init_scale=LOSS_SCALE, growth_interval=NEVER)
        if name == "torch":

            def torch_step() -> None:
                scaler.scale(loss)
                scaler.step(opt)
                scaler.update()

            return Variant(name, torch_step, refill)

        def torch_clip_step() -> None:
            scaler.scale(loss)
            scaler.unscale_(opt)
            torch.nn.utils.clip_grad_norm_(params, BIG_NORM)
            scaler.step(opt)
            scaler.update()

        return Variant(name, torch_clip_step, refill)
    if name in ("facade", "facade+clip"):
        facade = cstorch.amp.GradScaler(
            loss_scale="dynamic",
            init_scale=LOSS_SCALE,
            max_loss_scale=LOSS_SCALE,
            steps_per_increase=NEVER,
            max_gradient_norm=BIG_NORM if name == "facade+clip" else None,
        )

        def facade_step() -> None:
            facade.scale(loss)
            facade.step(opt)
            facade.update()

        return Variant(name, facade_step, refill)
    raise ValueError(f"unknown variant {name!r}")


def run_group(
    grads: GradientSet,
    optimizer: str,
    plan: Plan,
    counter: CompileCounter,
    on_round: Callable[[], object] = lambda: None,
) -> TorchGroup:
    """Measures the five variants of one optimizer, interleaved.

    Args:
        grads: the size's parameters and gradients.
        optimizer: one of :data:`OPTIMIZERS`.
        plan: rounds, steps per round and warm-up.
        counter: a listening compile counter.
        on_round: progress callback, once per round.
    """

    def make(name: str) -> Variant:
        return make_variant(name, optimizer, grads)

    return TorchGroup(optimizer, *measure_group(VARIANTS, make, plan, counter, on_round))
