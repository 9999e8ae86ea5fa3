"""Where the project meets the reference's semantics on points that changed (issue #14).

``optimizer_step`` with clipping and DLS skips on any non-finite gradient, whichever step it
comes on (the decision reads the gradients before any clipping could hide an inf); the skip
count grows by one per skipped optimizer step; the state dict keeps the reference's keys plus
``overflows_at_min_scale``.

Oracles: hand-computed traces of the SPEC section 2 update rule, snapshots taken before each
call (skipped steps change nothing, bit for bit), and plain torch with the same clipping on the
applied steps. (The recorded reference traces are replayed by test_facade_grad_scaler.py.)
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from facade_helpers import (
    INF,
    NAN,
    TinyNet,
    assert_tensors_equal,
    deep_equal,
    loss_of,
    optimizer_snapshot,
    parameters_of,
)

import torch_facade as cstorch

INIT_SCALE = 128.0
CONFIG = {"loss_scale": "dynamic", "init_scale": INIT_SCALE, "steps_per_increase": 2}
FAULT_STEPS = {0, 4, 5}
# After each of seven steps with faults at 0, 4 and 5, by SPEC section 2 (tolerance 0,
# steps_per_increase 2: the scale doubles on the third finite update after a rescale):
# (isfinite, loss_scale, steps_since_rescale, overflows_since_rescale, num_skipped_steps)
TRACE = [
    (False, 64.0, 0, 0, 1),  # overflow: halve, counters reset
    (True, 64.0, 1, 0, 1),
    (True, 64.0, 2, 0, 1),
    (True, 128.0, 0, 0, 1),  # 3 > steps_per_increase: double, counters reset
    (False, 64.0, 0, 0, 2),
    (False, 32.0, 0, 0, 3),
    (True, 32.0, 1, 0, 3),
]
FAULTS = {
    "inf": lambda scale: INF,
    "-inf": lambda scale: -INF,
    "nan": lambda scale: NAN,
    # Finite, but its unscaled square (1e40) overflows float32: an overflow (SPEC section 3).
    "1e20*scale": lambda scale: 1e20 * scale,
}
CLIPS = {"value": {"max_gradient_value": 0.01}, "norm": {"max_gradient_norm": 0.1}}


def sgd(model: torch.nn.Module) -> torch.optim.Optimizer:
    return torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)


def fault_hook(
    param: torch.Tensor, scaler: Any, value_of: Any, steps: set[int], counter: list[int]
) -> Any:
    """A gradient hook that writes ``value_of(current scale)`` during backward on ``steps``."""

    def hook(grad: torch.Tensor) -> torch.Tensor:
        if counter[0] not in steps:
            return grad
        grad = grad.clone()
        grad.view(-1)[1] = value_of(float(scaler.get_scale()))
        return grad

    return param.register_hook(hook)


def plain_clipped_step(model: torch.nn.Module, optimizer: torch.optim.Optimizer, step: int, clip):
    """The oracle's step: no scaling, the same clipping as ``optimizer_step``."""
    optimizer.zero_grad()
    loss_of(model, step).backward()
    if "max_gradient_value" in clip:
        torch.nn.utils.clip_grad_value_(model.parameters(), clip["max_gradient_value"])
    else:
        torch.nn.utils.clip_grad_norm_(model.parameters(), clip["max_gradient_norm"])
    optimizer.step()


def observed(scaler: Any) -> tuple[bool, float, int, int, int]:
    state = scaler.state_dict()
    return (
        bool(scaler.get_isfinite()),
        float(scaler.get_scale()),
        int(state["steps_since_rescale"]),
        int(state["overflows_since_rescale"]),
        int(scaler.get_num_skipped_steps()),
    )


@pytest.mark.parametrize("clip", list(CLIPS))
@pytest.mark.parametrize("fault", list(FAULTS))
def test_optimizer_step_with_clipping_skips_faults_from_a_gradient_hook(fault, clip):
    """Faults on the first step and on later ones (one right after a growth): every one is
    skipped and halves the scale, however the clipping would have treated it. Parameters and
    momentum are untouched on skipped steps; applied steps match plain torch's clipped steps.
    """
    reference, model = TinyNet(), TinyNet()
    reference_opt, optimizer = sgd(reference), sgd(model)
    scaler = cstorch.amp.GradScaler(**CONFIG)
    counter = [0]
    fault_hook(model.fc2.weight, scaler, FAULTS[fault], FAULT_STEPS, counter)
    for step, expected in enumerate(TRACE):
        counter[0] = step
        params_before = parameters_of(model)
        state_before = optimizer_snapshot(optimizer)
        cstorch.amp.optimizer_step(loss_of(model, step), optimizer, scaler, **CLIPS[clip])
        assert observed(scaler) == expected, f"step {step}"
        if step in FAULT_STEPS:
            assert_tensors_equal(params_before, model.parameters())
            assert deep_equal(state_before, optimizer.state_dict())  # momentum included
        else:
            plain_clipped_step(reference, reference_opt, step, CLIPS[clip])
            assert optimizer.state[model.fc2.weight]["momentum_buffer"] is not None
        assert all(p.grad is None for p in model.parameters())  # zero_grad() ran
    torch.testing.assert_close(parameters_of(model), parameters_of(reference), rtol=1e-6, atol=1e-7)


def two_optimizers(model: TinyNet) -> tuple[torch.optim.Optimizer, torch.optim.Optimizer]:
    return (
        torch.optim.SGD(model.fc1.parameters(), lr=0.05, momentum=0.9),
        torch.optim.SGD([*model.fc2.parameters(), *model.unused.parameters()], lr=0.05),
    )


def manual_iteration(scaler: Any, model: TinyNet, optimizers, step: int, fault: bool) -> None:
    """Both optimizers unscaled, then both stepped, then one update (the reference's loop)."""
    for optimizer in optimizers:
        optimizer.zero_grad()
    scaler.scale(loss_of(model, step)).backward()
    if fault:
        model.fc1.bias.grad[0] = NAN
    for optimizer in optimizers:
        scaler.unscale_(optimizer)
    for optimizer in optimizers:
        scaler.step(optimizer)
    scaler.update()


def optimizer_step_iteration(scaler: Any, model: TinyNet, optimizers, step: int, fault: bool):
    counter = [0]
    handle = fault_hook(model.fc1.bias, scaler, FAULTS["nan"], {0} if fault else set(), counter)
    cstorch.amp.optimizer_step(loss_of(model, step), list(optimizers), scaler)
    handle.remove()


@pytest.mark.parametrize(
    "loop", [manual_iteration, optimizer_step_iteration], ids=["manual", "optimizer_step"]
)
def test_two_optimizers_count_two_skipped_steps_per_skipped_iteration(loop):
    """The reference counts every skipped optimizer step: +2 per skipped iteration here, while
    the scale halves once per iteration (the same TRACE, with the skip count doubled).
    """
    model = TinyNet()
    optimizers = two_optimizers(model)
    scaler = cstorch.amp.GradScaler(**CONFIG)
    for step, (isfinite, scale, steps, overflows, skipped) in enumerate(TRACE):
        loop(scaler, model, optimizers, step, step in FAULT_STEPS)
        assert observed(scaler) == (isfinite, scale, steps, overflows, 2 * skipped), f"step {step}"


def test_a_skipped_iteration_that_steps_one_of_two_optimizers_counts_one():
    """Only the optimizer steps actually skipped count: two known optimizers, one stepped."""
    model = TinyNet()
    first, second = two_optimizers(model)
    scaler = cstorch.amp.GradScaler(**CONFIG, optimizers=[first, second])
    manual_iteration(scaler, model, (first, second), 0, fault=True)
    assert int(scaler.get_num_skipped_steps()) == 2
    for optimizer in (first, second):
        optimizer.zero_grad()
    scaler.scale(loss_of(model, 1)).backward()
    model.fc2.bias.grad[0] = INF  # in the optimizer that does not step
    params_before = parameters_of(model)
    scaler.step(first)
    scaler.update()
    assert_tensors_equal(params_before, model.parameters())
    assert int(scaler.get_num_skipped_steps()) == 3
    assert float(scaler.get_scale()) == INIT_SCALE / 4


# ------------------------------------------------------------------------- state dict

REFERENCE_KEYS = [
    "loss_scale",
    "steps_since_rescale",
    "overflows_since_rescale",
    "num_skipped_steps",
]


def test_state_dict_is_the_reference_keys_plus_overflows_at_min_scale():
    """A hand-computed stall trace: at ``min_loss_scale`` consecutive overflows are counted,
    and a finite step resets the count. A checkpoint with only the reference's keys (written
    before the new key existed) loads, and keeps the new counter as it was.
    """
    model = TinyNet()
    optimizer = sgd(model)
    scaler = cstorch.amp.GradScaler(loss_scale="dynamic", init_scale=64.0, min_loss_scale=32.0)
    state = scaler.state_dict()
    assert list(state) == [*REFERENCE_KEYS, "overflows_at_min_scale"]
    assert cstorch.amp.GradScaler(loss_scale=8.0).state_dict().keys() == {"loss_scale"}
    counter = [0]
    faults = {0, 1, 2, 4}
    fault_hook(model.fc1.weight, scaler, FAULTS["inf"], faults, counter)
    counts = []
    for step in range(6):
        counter[0] = step
        cstorch.amp.optimizer_step(loss_of(model, step), optimizer, scaler)
        counts.append(int(scaler.state_dict()["overflows_at_min_scale"]))
    # Step 0 overflows at 64 (not yet the minimum), 1 and 2 at 32; 3 is finite; 4 at 32 again.
    assert counts == [0, 1, 2, 0, 1, 0]
    assert float(scaler.get_scale()) == 32.0

    old_checkpoint = {key: scaler.state_dict()[key] for key in REFERENCE_KEYS}
    other = cstorch.amp.GradScaler(loss_scale="dynamic", init_scale=64.0, min_loss_scale=32.0)
    other.load_state_dict({"overflows_at_min_scale": 5})
    other.load_state_dict(old_checkpoint)
    loaded = other.state_dict()
    assert deep_equal({k: loaded[k] for k in REFERENCE_KEYS}, old_checkpoint)
    assert int(loaded["overflows_at_min_scale"]) == 5
