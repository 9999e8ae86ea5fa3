"""The per-decision bookkeeping the facade remembers between iterations (issue #10 speed work).

Which parameters take part, whether a fused optimizer has state for every gradient, and which
device the scaler state is on are remembered between iterations. These tests change what each
depends on after it was remembered (``add_param_group``, ``load_state_dict``, a replaced
``params`` list, a new state on another device) and check the behaviour, not the cache: an inf
in a newly added parameter still skips the step, and a skipped step never creates optimizer
state for a parameter that had none (oracle: snapshots taken before the step).
"""

from __future__ import annotations

import copy

import pytest
import torch
from facade_helpers import DLS, INF, TinyNet, deep_equal, loss_of, one_step, optimizer_snapshot

import torch_facade as cstorch

pytestmark = pytest.mark.filterwarnings("ignore:GradScaler is unscaling gradients")


def _fused_adam(model: TinyNet) -> torch.optim.Adam:
    """Fused Adam over the parameters the loss reaches (all of them get state at the first step,
    which is when the facade can remember that they have)."""
    params = [*model.fc1.parameters(), *model.fc2.parameters()]
    return torch.optim.Adam(params, lr=0.01, fused=True)


def _train(
    scaler: cstorch.amp.GradScaler, model: TinyNet, optimizer: torch.optim.Optimizer
) -> None:
    for step in range(3):
        one_step(scaler, model, optimizer, step)
    assert int(scaler.get_num_skipped_steps()) == 0


def _extra_loss(model: TinyNet, extra: torch.nn.Parameter, step: int) -> torch.Tensor:
    return loss_of(model, step) + extra.square().sum()


def test_added_param_group_takes_part_in_the_decision() -> None:
    model = TinyNet()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = cstorch.amp.GradScaler(**DLS)
    _train(scaler, model, optimizer)
    extra = torch.nn.Parameter(torch.ones(3))
    optimizer.add_param_group({"params": [extra]})
    before = [p.detach().clone() for p in [*model.parameters(), extra]]

    optimizer.zero_grad()
    scaler.scale(_extra_loss(model, extra, 3)).backward()
    extra.grad[1] = INF  # only the new group overflows
    scaler.step(optimizer)
    scaler.update()

    assert not bool(scaler.get_isfinite())
    assert int(scaler.get_num_skipped_steps()) == 1
    for old, new in zip(before, [*model.parameters(), extra], strict=True):
        assert torch.equal(old, new)


def test_replaced_params_list_takes_part_in_the_decision() -> None:
    model = TinyNet()
    optimizer = torch.optim.SGD([model.fc1.weight], lr=0.1)
    scaler = cstorch.amp.GradScaler(**DLS)
    _train(scaler, model, optimizer)
    # Same group, a new list of another length: the decision must read fc2.bias too.
    optimizer.param_groups[0]["params"] = [model.fc1.weight, model.fc2.bias]
    optimizer.zero_grad()
    scaler.scale(loss_of(model, 3)).backward()
    model.fc2.bias.grad[0] = INF
    weight = model.fc1.weight.detach().clone()
    scaler.step(optimizer)
    scaler.update()
    assert not bool(scaler.get_isfinite())
    assert torch.equal(weight, model.fc1.weight)


def test_fused_skip_after_add_param_group_creates_no_state() -> None:
    model = TinyNet()
    optimizer = _fused_adam(model)
    scaler = cstorch.amp.GradScaler(**DLS)
    _train(scaler, model, optimizer)  # every parameter now has state
    assert all(optimizer.state[p] for p in model.fc1.parameters())
    extra = torch.nn.Parameter(torch.ones(3))
    optimizer.add_param_group({"params": [extra]})

    optimizer.zero_grad()
    scaler.scale(_extra_loss(model, extra, 3)).backward()
    model.fc1.weight.grad[0, 0] = INF
    snapshot = optimizer_snapshot(optimizer)
    scaler.step(optimizer)
    scaler.update()

    assert int(scaler.get_num_skipped_steps()) == 1
    assert extra not in optimizer.state or not optimizer.state[extra]
    assert deep_equal(snapshot, optimizer_snapshot(optimizer))


def test_fused_skip_after_load_state_dict_creates_no_state() -> None:
    model = TinyNet()
    optimizer = _fused_adam(model)
    scaler = cstorch.amp.GradScaler(**DLS)
    _train(scaler, model, optimizer)
    # A checkpoint in which fc2.bias has no state yet (it was frozen when it was saved).
    other = TinyNet(seed=1)
    donor = _fused_adam(other)
    other.fc2.bias.requires_grad_(False)
    for step in range(2):
        donor.zero_grad()
        loss_of(other, step).backward()
        donor.step()
    optimizer.load_state_dict(donor.state_dict())
    assert not optimizer.state.get(model.fc2.bias)

    optimizer.zero_grad()
    scaler.scale(loss_of(model, 3)).backward()
    model.fc1.bias.grad[0] = INF
    snapshot = optimizer_snapshot(optimizer)
    scaler.step(optimizer)
    scaler.update()

    assert int(scaler.get_num_skipped_steps()) == 1
    assert not optimizer.state.get(model.fc2.bias)
    assert deep_equal(snapshot, optimizer_snapshot(optimizer))


def test_loaded_state_is_used_from_the_next_decision() -> None:
    model = TinyNet()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = cstorch.amp.GradScaler(**DLS)
    _train(scaler, model, optimizer)
    checkpoint = {
        "loss_scale": torch.tensor(2.0**4),
        "steps_since_rescale": torch.tensor(0),
        "overflows_since_rescale": torch.tensor(0),
        "num_skipped_steps": torch.tensor(5),
    }
    scaler.load_state_dict(checkpoint)
    one_step(scaler, model, optimizer, 3, poison=True)
    state = scaler.state_dict()
    assert float(state["loss_scale"]) == 2.0**3  # halved from the loaded scale
    assert int(state["num_skipped_steps"]) == 6


def test_fused_skip_after_a_replaced_params_list_creates_no_state() -> None:
    model = TinyNet()
    optimizer = _fused_adam(model)
    scaler = cstorch.amp.GradScaler(**DLS)
    _train(scaler, model, optimizer)
    # As many parameters and state entries as before, but fc1.bias (which keeps its state
    # entry) swapped for a parameter that has no state.
    extra = torch.nn.Parameter(torch.ones(3))
    group = optimizer.param_groups[0]
    group["params"] = [extra if p is model.fc1.bias else p for p in group["params"]]

    optimizer.zero_grad()
    scaler.scale(_extra_loss(model, extra, 3)).backward()
    model.fc1.weight.grad[0, 0] = INF
    snapshot = {id(k): copy.deepcopy(v) for k, v in optimizer.state.items()}
    params = [p.detach().clone() for p in group["params"]]
    scaler.step(optimizer)
    scaler.update()

    assert int(scaler.get_num_skipped_steps()) == 1
    assert not optimizer.state.get(extra)
    assert deep_equal(snapshot, {id(k): v for k, v in optimizer.state.items()})
    for before, param in zip(params, group["params"], strict=True):
        assert torch.equal(before, param)
