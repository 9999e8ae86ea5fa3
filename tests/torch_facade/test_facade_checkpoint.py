"""state_dict()/load_state_dict(): a run stopped and resumed equals the uninterrupted run."""

from __future__ import annotations

import io

import pytest
import torch
from facade_helpers import DLS, INF, TinyNet, assert_tensors_equal, deep_equal, loss_of

import torch_facade as cstorch

STEPS = 10
OVERFLOW_STEPS = {1, 4, 5, 8}  # with steps_per_increase=2 the scale also grows in between
SCALER_KWARGS = {**DLS, "steps_per_increase": 2}

OPTIMIZERS = {
    "adam-fused": lambda params: torch.optim.Adam(params, lr=0.01, fused=True),
    "sgd-momentum": lambda params: torch.optim.SGD(params, lr=0.1, momentum=0.9),
}


def train(model, optimizer, scaler, steps):
    for step in steps:
        optimizer.zero_grad()
        scaler.scale(loss_of(model, step)).backward()
        if step in OVERFLOW_STEPS:
            model.fc1.weight.grad[1, 2] = INF
        scaler.step(optimizer)
        scaler.update()


def save(*objects) -> bytes:
    buffer = io.BytesIO()
    torch.save([o.state_dict() for o in objects], buffer)
    return buffer.getvalue()


def fresh(name):
    model = TinyNet(seed=7)  # different initial weights: everything must come from the checkpoint
    optimizer = OPTIMIZERS[name](model.parameters())
    return model, optimizer, cstorch.amp.GradScaler(**SCALER_KWARGS)


@pytest.mark.parametrize("name", OPTIMIZERS)
@pytest.mark.parametrize("stop", [2, 5])
def test_resumed_run_equals_uninterrupted_run_bit_for_bit(name, stop):
    model = TinyNet()
    optimizer = OPTIMIZERS[name](model.parameters())
    scaler = cstorch.amp.GradScaler(**SCALER_KWARGS)
    train(model, optimizer, scaler, range(STEPS))
    assert int(scaler.get_num_skipped_steps()) == len(OVERFLOW_STEPS)

    first = TinyNet()
    first_opt = OPTIMIZERS[name](first.parameters())
    first_scaler = cstorch.amp.GradScaler(**SCALER_KWARGS)
    train(first, first_opt, first_scaler, range(stop))
    checkpoint = save(first, first_opt, first_scaler)
    del first, first_opt, first_scaler

    resumed, resumed_opt, resumed_scaler = fresh(name)
    model_state, optimizer_state, scaler_state = torch.load(io.BytesIO(checkpoint))
    resumed.load_state_dict(model_state)
    resumed_opt.load_state_dict(optimizer_state)
    resumed_scaler.load_state_dict(scaler_state)
    train(resumed, resumed_opt, resumed_scaler, range(stop, STEPS))

    assert_tensors_equal(model.parameters(), resumed.parameters())
    assert deep_equal(optimizer.state_dict(), resumed_opt.state_dict())
    assert deep_equal(scaler.state_dict(), resumed_scaler.state_dict())
    assert float(scaler.get_non_clamped_scale()) == float(resumed_scaler.get_non_clamped_scale())


def test_resuming_without_the_scaler_state_differs():
    """The scaler state matters in the test above: dropping it changes the run."""
    model = TinyNet()
    optimizer = OPTIMIZERS["sgd-momentum"](model.parameters())
    scaler = cstorch.amp.GradScaler(**SCALER_KWARGS)
    train(model, optimizer, scaler, range(STEPS))
    first, first_opt, first_scaler = fresh("sgd-momentum")
    train(first, first_opt, first_scaler, range(5))
    second = cstorch.amp.GradScaler(**SCALER_KWARGS)
    train(first, first_opt, second, range(5, STEPS))
    assert not deep_equal(scaler.state_dict(), second.state_dict())


def test_dynamic_state_dict_keys_and_types():
    state = cstorch.amp.GradScaler(**SCALER_KWARGS).state_dict()
    assert list(state) == [
        "loss_scale",
        "steps_since_rescale",
        "overflows_since_rescale",
        "num_skipped_steps",
        "overflows_at_min_scale",
    ]
    assert state["loss_scale"].dtype is torch.float32
    assert all(state[k].dtype is torch.int64 for k in list(state)[1:])
    assert float(state["loss_scale"]) == DLS["init_scale"]
    destination = {"other": 1}
    assert cstorch.amp.GradScaler(**DLS).state_dict(destination) is destination
    assert set(destination) == {"other", *state}


def test_static_state_dict_has_only_the_loss_scale():
    scaler = cstorch.amp.GradScaler(loss_scale=32.0)
    assert scaler.state_dict() == {"loss_scale": torch.tensor(32.0)}
    scaler.load_state_dict({"loss_scale": torch.tensor(8.0)})
    assert scaler.get_scale() == 8.0
    loss = torch.tensor(0.5)
    assert torch.equal(scaler.scale(loss), torch.tensor(4.0))


@pytest.mark.parametrize(
    "values",
    [
        {"loss_scale": 64.0, "steps_since_rescale": 3, "overflows_since_rescale": 1},
        {
            "loss_scale": torch.tensor(64.0),
            "steps_since_rescale": torch.tensor(3),
            "overflows_since_rescale": torch.tensor(1, dtype=torch.int32),
        },
    ],
    ids=["numbers", "tensors"],
)
def test_load_state_dict_accepts_numbers_or_tensors_and_keeps_absent_keys(values):
    scaler = cstorch.amp.GradScaler(**SCALER_KWARGS)
    scaler.load_state_dict({"num_skipped_steps": 9})
    scaler.load_state_dict(values)
    state = scaler.state_dict()
    assert float(state["loss_scale"]) == 64.0
    assert int(state["steps_since_rescale"]) == 3
    assert int(state["overflows_since_rescale"]) == 1
    assert int(state["num_skipped_steps"]) == 9  # kept from before
    assert float(scaler.get_scale()) == 64.0
    assert float(scaler.get_non_clamped_scale()) == 64.0
    # The loaded counters drive the next update: a finite step, yet 1 overflow in 4 steps
    # exceeds the tolerance 0, so the scale halves.
    model = TinyNet()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    train(model, optimizer, scaler, [0])
    assert float(scaler.get_scale()) == 32.0
    assert int(scaler.get_num_skipped_steps()) == 9
