"""``torch.amp.GradScaler`` checkpoints load into the facade's scaler, keeping their scale.

ModelZoo on GPUs saves ``torch.amp.GradScaler.state_dict()`` under ``"grad_scaler"``. The
oracle is a real ``torch.amp.GradScaler("cpu")`` that has taken steps (one of them an
overflow, so its scale moved and its growth tracker is not zero): its ``get_scale()`` is what
the facade must continue from, and the continuation follows SPEC section 2 from there
(hand-computed).
"""

from __future__ import annotations

import io
import warnings

import pytest
import torch
from facade_helpers import INF, TinyNet, loss_of, one_step

import torch_facade as cstorch
from torch_facade.amp._torch_checkpoint import TORCH_KEYS, to_facade_format


def trained_torch_scaler(**kwargs) -> torch.amp.GradScaler:
    """A CPU ``torch.amp.GradScaler`` after 5 steps: an overflow, then 4 finite ones."""
    model = TinyNet()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    scaler = torch.amp.GradScaler("cpu", **kwargs)
    for step in range(5):
        optimizer.zero_grad()
        scaler.scale(loss_of(model, step)).backward()
        if step == 0:
            model.fc1.weight.grad[0, 0] = INF
        scaler.step(optimizer)
        scaler.update()
    return scaler


@pytest.fixture(scope="module")
def torch_state() -> dict:
    scaler = trained_torch_scaler(init_scale=2.0**12, growth_interval=100)
    state = scaler.state_dict()
    assert state["scale"] == 2.0**11  # halved once by the overflow (torch's own rule)
    assert state["_growth_tracker"] == 4  # nonzero: four finite steps since the backoff
    assert sorted(state) == sorted(TORCH_KEYS)
    return state


def test_the_scale_is_taken_over_and_a_warning_names_the_rest(torch_state):
    scaler = cstorch.amp.GradScaler(loss_scale="dynamic", steps_per_increase=3)
    with pytest.warns(UserWarning, match="torch.amp.GradScaler checkpoint") as caught:
        scaler.load_state_dict(torch_state)
    message = str(caught[0].message)
    assert "scale 2048.0 becomes loss_scale" in message
    assert "_growth_tracker=4" in message
    assert "growth_interval=100 (this scaler keeps steps_per_increase=3" in message
    assert "growth_factor" not in message and "backoff_factor" not in message  # torch's 2 and 1/2
    assert caught[0].filename == __file__
    assert torch.equal(scaler.get_scale(), torch.tensor(2.0**11))
    state = scaler.state_dict()
    assert float(state["loss_scale"]) == 2.0**11
    for counter in ("steps_since_rescale", "overflows_since_rescale", "num_skipped_steps"):
        assert int(state[counter]) == 0


def test_training_continues_from_the_torch_scale(torch_state):
    model = TinyNet()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    scaler = cstorch.amp.GradScaler(loss_scale="dynamic", steps_per_increase=2)
    with pytest.warns(UserWarning):
        scaler.load_state_dict(torch_state)
    scales = []
    for step in range(5):
        one_step(scaler, model, optimizer, step, poison=step == 3)
        scales.append(float(scaler.get_scale()))
    # SPEC section 2 from 2**11: doubles on the 3rd finite update, halves on the overflow.
    assert scales == [2.0**11, 2.0**11, 2.0**12, 2.0**11, 2.0**11]


def test_a_modelzoo_gpu_checkpoint_file_loads(torch_state):
    buffer = io.BytesIO()
    torch.save({"model": TinyNet().state_dict(), "grad_scaler": torch_state}, buffer)
    buffer.seek(0)
    checkpoint = torch.load(buffer, weights_only=True)
    scaler = cstorch.amp.GradScaler(loss_scale="dynamic")
    with pytest.warns(UserWarning, match="_growth_tracker"):
        scaler.load_state_dict(checkpoint["grad_scaler"])
    assert float(scaler.get_scale()) == torch_state["scale"]


def test_non_default_growth_factors_are_named():
    state = trained_torch_scaler(
        init_scale=2.0**8, growth_factor=4.0, backoff_factor=0.25
    ).state_dict()
    with pytest.warns(UserWarning) as caught:
        converted = to_facade_format(state, cstorch.amp.GradScaler(loss_scale="dynamic").config)
    message = str(caught[0].message)
    assert "growth_factor=4.0 (dynamic loss scaling here always multiplies by 2.0)" in message
    assert "backoff_factor=0.25 (dynamic loss scaling here always multiplies by 0.5)" in message
    assert converted == {"loss_scale": 2.0**6}  # torch's backoff: 2**8 * 0.25


def test_a_static_scaler_takes_the_scale(torch_state):
    scaler = cstorch.amp.GradScaler(loss_scale=8.0)
    with pytest.warns(UserWarning, match="a static loss scale never changes"):
        scaler.load_state_dict(torch_state)
    assert scaler.get_scale() == 2.0**11


def test_keys_of_neither_format_stay_an_error(torch_state):
    scaler = cstorch.amp.GradScaler(loss_scale="dynamic")
    before = scaler.state_dict()
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # nothing is announced as loaded
        with pytest.raises(ValueError, match=r"keys \['growth_rate'\] that neither"):
            scaler.load_state_dict({**torch_state, "growth_rate": 2.0})
        with pytest.raises(ValueError, match=r"mixes torch.amp.GradScaler keys \['scale'\]"):
            scaler.load_state_dict({"scale": 4.0, "loss_scale": 4.0})
        with pytest.raises(ValueError, match="has no 'scale'"):
            scaler.load_state_dict({"_growth_tracker": 3})
        with pytest.raises(ValueError, match="scale"):
            scaler.load_state_dict({"scale": 0.0})
        with pytest.raises(ValueError, match=r"keys \['growth'\] that a dynamic loss scaler"):
            scaler.load_state_dict({"growth": 2.0})  # amp_core's own error, as before
    assert all(torch.equal(before[k], v) for k, v in scaler.state_dict().items())


def test_own_and_empty_checkpoints_load_without_a_warning():
    scaler = cstorch.amp.GradScaler(loss_scale="dynamic")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        scaler.load_state_dict({"loss_scale": 64.0, "steps_since_rescale": 2})
        scaler.load_state_dict(torch.amp.GradScaler("cpu", enabled=False).state_dict())  # {}
    assert float(scaler.get_scale()) == 64.0
