"""Several optimizers share one overflow decision per iteration (SPEC sections 3 and 5)."""

from __future__ import annotations

import pytest
import torch
from facade_helpers import (
    DLS,
    INF,
    TinyNet,
    assert_tensors_equal,
    deep_equal,
    loss_of,
    optimizer_snapshot,
    parameters_of,
    poison_on,
)

import torch_facade as cstorch


def two_optimizers(model: torch.nn.Module) -> tuple[torch.optim.Optimizer, torch.optim.Optimizer]:
    """Adam on the first layer, SGD with momentum on the second (and the unused layer)."""
    first = torch.optim.Adam(model.fc1.parameters(), lr=0.01)
    second = torch.optim.SGD(
        [*model.fc2.parameters(), *model.unused.parameters()], lr=0.1, momentum=0.9
    )
    return first, second


def plain_run(steps: list[int]) -> TinyNet:
    """Training without scaling on the given batches (the finite steps of a facade run)."""
    model = TinyNet()
    first, second = two_optimizers(model)
    for step in steps:
        first.zero_grad()
        second.zero_grad()
        loss_of(model, step).backward()
        first.step()
        second.step()
    return model


@pytest.mark.parametrize("poisoned", ["first", "second"])
def test_optimizer_step_with_a_list_takes_one_global_decision(poisoned):
    model = TinyNet()
    first, second = two_optimizers(model)
    scaler = cstorch.amp.GradScaler(**DLS)
    target = model.fc1.weight if poisoned == "first" else model.fc2.bias
    counter = [0]
    overflow_steps = {1, 2}
    poison_on(target, overflow_steps, counter)
    for step in range(5):
        counter[0] = step
        params_before = parameters_of(model)
        states_before = optimizer_snapshot(first), optimizer_snapshot(second)
        cstorch.amp.optimizer_step(loss_of(model, step), [first, second], scaler)
        if step in overflow_steps:
            # An inf in either optimizer's gradients skips both.
            assert_tensors_equal(params_before, model.parameters())
            assert deep_equal(states_before[0], first.state_dict())
            assert deep_equal(states_before[1], second.state_dict())
        assert all(p.grad is None for p in model.parameters())  # zero_grad() ran
    assert int(scaler.get_num_skipped_steps()) == 4  # two iterations, two optimizer steps each
    assert float(scaler.get_scale()) == DLS["init_scale"] / 4
    expected = plain_run([0, 3, 4])
    torch.testing.assert_close(parameters_of(model), parameters_of(expected), rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("register_up_front", [False, True])
def test_manual_loop_unscaling_each_optimizer_first_takes_the_global_decision(register_up_front):
    """``unscale_`` on each optimizer before the first ``step``: no registration needed."""
    model = TinyNet()
    first, second = two_optimizers(model)
    kwargs = {"optimizers": [first, second]} if register_up_front else {}
    scaler = cstorch.amp.GradScaler(**DLS, **kwargs)
    for step in range(4):
        first.zero_grad()
        second.zero_grad()
        scaler.scale(loss_of(model, step)).backward()
        if step in (0, 2):  # the very first iteration overflows in the *second* optimizer
            model.fc2.weight.grad[1, 1] = INF
        scaler.unscale_(first)
        scaler.unscale_(second)
        params_before = parameters_of(model)
        states_before = optimizer_snapshot(first), optimizer_snapshot(second)
        scaler.step(first)
        scaler.step(second)
        scaler.update()
        if step in (0, 2):
            assert_tensors_equal(params_before, model.parameters())
            assert deep_equal(states_before[0], first.state_dict())
            assert deep_equal(states_before[1], second.state_dict())
    assert int(scaler.get_num_skipped_steps()) == 4  # per skipped optimizer step
    torch.testing.assert_close(
        parameters_of(model), parameters_of(plain_run([1, 3])), rtol=1e-6, atol=1e-7
    )


def test_optimizer_registered_up_front_joins_the_first_decision():
    """With ``optimizers=``, stepping one optimizer first still sees the other's inf."""
    model = TinyNet()
    first, second = two_optimizers(model)
    scaler = cstorch.amp.GradScaler(**DLS, optimizers=[first, second])
    scaler.scale(loss_of(model, 0)).backward()
    model.fc2.bias.grad[0] = INF
    params_before = parameters_of(model)
    scaler.step(first)  # the decision is taken here, over both optimizers' gradients
    assert not bool(scaler.get_isfinite())
    scaler.step(second)
    scaler.update()
    assert_tensors_equal(params_before, model.parameters())
    assert first.state_dict()["state"] == {} and second.state_dict()["state"] == {}
    assert int(scaler.get_num_skipped_steps()) == 2


@pytest.mark.parametrize("poisoned", ["first", "second"])
def test_torch_docs_multi_optimizer_loop_works_from_the_first_iteration(poisoned):
    """torch's documented loop, no registration: one global decision from iteration 0 on.

    Two losses, ``unscale_`` of one optimizer, then both steps. The decision at
    ``unscale_(first)`` already covers ``second``'s gradients (the parameters the scaled losses
    reach), so an inf in either skips both, on the very first iteration too.
    """
    model = TinyNet()
    first, second = two_optimizers(model)
    scaler = cstorch.amp.GradScaler(**DLS)
    for step in range(3):
        first.zero_grad()
        second.zero_grad()
        scaler.scale(loss_of(model, step)).backward(retain_graph=True)
        scaler.scale(0.0 * loss_of(model, step)).backward()
        if step in (0, 2):
            target = model.fc1.weight if poisoned == "first" else model.fc2.bias
            target.grad.view(-1)[0] = INF
        params_before = parameters_of(model)
        states_before = optimizer_snapshot(first), optimizer_snapshot(second)
        scaler.unscale_(first)
        assert bool(scaler.get_isfinite()) == (step == 1)  # this iteration's flag already
        scaler.step(first)
        scaler.step(second)
        scaler.update()
        if step in (0, 2):
            assert_tensors_equal(params_before, model.parameters())
            assert deep_equal(states_before[0], first.state_dict())
            assert deep_equal(states_before[1], second.state_dict())
    assert int(scaler.get_num_skipped_steps()) == 4
    torch.testing.assert_close(
        parameters_of(model), parameters_of(plain_run([1])), rtol=1e-6, atol=1e-7
    )


def test_optimizer_no_loss_reached_in_the_first_iteration_raises_and_says_how_to_register():
    """Where no design can know: an optimizer first met after a later iteration's decision."""
    model = TinyNet()
    first, second = two_optimizers(model)
    scaler = cstorch.amp.GradScaler(**DLS)
    scaler.scale(model.fc1(torch.ones(1, 4)).sum()).backward()  # reaches fc1 only
    scaler.step(first)
    scaler.update()
    scaler.scale(loss_of(model, 1)).backward()
    scaler.step(first)  # the decision: ``second`` was never met, and its grads are not read
    with pytest.raises(RuntimeError, match=r"optimizers="):
        scaler.step(second)
    with pytest.raises(RuntimeError, match=r"optimizers="):
        scaler.unscale_(second)


def test_optimizers_known_from_a_previous_iteration_join_the_decision():
    """Known optimizers are remembered: from the second iteration on, any order works."""
    model = TinyNet()
    first, second = two_optimizers(model)
    scaler = cstorch.amp.GradScaler(**DLS)
    for step in range(3):
        first.zero_grad()
        second.zero_grad()
        scaler.scale(loss_of(model, step)).backward()
        if step == 0:
            scaler.unscale_(first)
            scaler.unscale_(second)
        if step == 2:
            model.fc2.weight.grad[0, 0] = INF
        params_before = parameters_of(model)
        scaler.step(first)
        scaler.step(second)
        scaler.update()
    assert_tensors_equal(params_before, model.parameters())
    assert int(scaler.get_num_skipped_steps()) == 2


def test_global_norm_covers_every_optimizer():
    model = TinyNet()
    first, second = two_optimizers(model)
    oracle = TinyNet()
    loss_of(oracle, 0).backward()
    expected = torch.linalg.vector_norm(
        torch.stack(
            [torch.linalg.vector_norm(p.grad) for p in oracle.parameters() if p.grad is not None]
        )
    )
    scaler = cstorch.amp.GradScaler(**DLS, optimizers=[first, second])
    scaler.scale(loss_of(model, 0)).backward()
    scaler.step(first)
    during = scaler.get_global_norm()
    scaler.step(second)
    scaler.update()
    assert isinstance(during, torch.Tensor) and during.dtype is torch.float32
    torch.testing.assert_close(during, expected, rtol=1e-6, atol=0)
    torch.testing.assert_close(scaler.get_global_norm(), expected, rtol=1e-6, atol=0)
    # Only the first optimizer's share would be smaller: the norm is the global one.
    first_only = torch.linalg.vector_norm(
        torch.cat([p.grad.flatten() for p in oracle.fc1.parameters()])
    )
    assert float(expected) > float(first_only) * (1 + 1e-3)


def test_static_scaling_with_two_optimizers_steps_both():
    model = TinyNet()
    first, second = two_optimizers(model)
    scaler = cstorch.amp.GradScaler(loss_scale=4.0)
    for step in range(2):
        cstorch.amp.optimizer_step(loss_of(model, step), (first, second), scaler)
    torch.testing.assert_close(
        parameters_of(model), parameters_of(plain_run([0, 1])), rtol=1e-6, atol=1e-7
    )
