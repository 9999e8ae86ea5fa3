"""The LR-scheduler recipe: advance the scheduler only on iterations whose step was applied.

As with torch's scaler, an overflow skips ``optimizer.step()``; a scheduler stepped anyway
drifts one step ahead per skip, and a skip on the very first iteration makes torch warn
"Detected call of `lr_scheduler.step()` before `optimizer.step()`". The recipe reads the skip
signal after ``update()``, without patching or wrapping ``optimizer.step``::

    grad_scaler.step(optimizer)
    grad_scaler.update()
    if grad_scaler.get_isfinite():  # 0-d bool tensor: was this iteration's step applied?
        scheduler.step()

The oracle is the fault schedule itself: the iterations given an inf gradient are skipped, every
other one is applied.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Iterable

import pytest
import torch
from facade_helpers import DLS, INF, TinyNet, loss_of

import torch_facade as cstorch

ITERATIONS = 6
LR = 0.1
GAMMA = 0.5

OptimizerFactory = Callable[[Iterable[torch.nn.Parameter]], torch.optim.Optimizer]
OPTIMIZERS: dict[str, OptimizerFactory] = {
    "sgd-momentum": lambda params: torch.optim.SGD(params, lr=LR, momentum=0.9),
    # Fused: once its state exists, the facade skips inside the kernel (optimizer.step is called).
    "adamw-fused": lambda params: torch.optim.AdamW(params, lr=LR, fused=True),
}


def train(
    make_optimizer: OptimizerFactory, faults: set[int], *, recipe: bool = True
) -> tuple[torch.optim.lr_scheduler.LRScheduler, list[bool], list[bool]]:
    """Runs ``ITERATIONS`` facade iterations with an inf gradient on the ``faults`` iterations.

    Returns the scheduler, whether each iteration changed the parameters, and the skip signal
    the recipe read at each iteration. ``recipe=False`` steps the scheduler every iteration.
    """
    model = TinyNet()
    optimizer = make_optimizer(model.parameters())
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=GAMMA)
    grad_scaler = cstorch.amp.GradScaler(**DLS)
    changed: list[bool] = []
    signals: list[bool] = []
    for iteration in range(ITERATIONS):
        before = [p.detach().clone() for p in model.parameters()]
        optimizer.zero_grad()
        grad_scaler.scale(loss_of(model, iteration)).backward()
        if iteration in faults:
            model.fc1.weight.grad[0, 0] = INF
        grad_scaler.step(optimizer)
        grad_scaler.update()
        applied = bool(grad_scaler.get_isfinite())
        if applied or not recipe:
            scheduler.step()
        signals.append(applied)
        after = list(model.parameters())
        changed.append(any(not torch.equal(b, a) for b, a in zip(before, after, strict=True)))
    assert int(grad_scaler.get_num_skipped_steps()) == len(faults)
    return scheduler, changed, signals


@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
@pytest.mark.parametrize("faults", [{0}, {0, 3}, {2}, set()], ids=str)
def test_scheduler_advances_only_on_applied_steps(name: str, faults: set[int]):
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # "lr_scheduler.step() before optimizer.step()" would fail
        scheduler, changed, signals = train(OPTIMIZERS[name], faults)

    expected = [i not in faults for i in range(ITERATIONS)]
    assert signals == expected
    assert changed == expected  # the signal is the truth about the parameters
    applied = ITERATIONS - len(faults)
    assert scheduler.last_epoch == applied
    assert scheduler.get_last_lr() == [pytest.approx(LR * GAMMA**applied)]


def test_without_the_recipe_a_first_iteration_skip_warns_and_the_schedule_runs_ahead():
    with pytest.warns(UserWarning, match=r"`lr_scheduler.step\(\)` before `optimizer.step\(\)`"):
        scheduler, _, _ = train(OPTIMIZERS["sgd-momentum"], {0}, recipe=False)
    assert scheduler.last_epoch == ITERATIONS  # one ahead of the ITERATIONS - 1 applied steps
