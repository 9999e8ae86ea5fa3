"""Tensors that cross between the scaler and the user cannot corrupt the scaler, and back.

Covers returned tensors modified in place, ``step()`` under ``torch.inference_mode()``,
``backward(create_graph=True)`` gradients (also across ``module.to(dtype)``), and a parameter
that first gets a gradient once its optimizer's state exists.
"""

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
    one_step,
    optimizer_snapshot,
    parameters_of,
    plain_step,
)

import torch_facade as cstorch

pytestmark = pytest.mark.filterwarnings("ignore:GradScaler is unscaling gradients")


def _overflowing_backward(model: TinyNet, scaler: cstorch.amp.GradScaler, step: int) -> None:
    scaler.scale(loss_of(model, step)).backward()
    model.fc1.weight.grad[0, 0] = INF


def test_changing_the_returned_isfinite_does_not_change_the_decision():
    model = TinyNet()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)  # host-decided skip
    scaler = cstorch.amp.GradScaler(**DLS)
    before = parameters_of(model)
    _overflowing_backward(model, scaler, 0)
    flag = scaler.clip_gradients_and_return_isfinite(optimizer)
    flag.fill_(True)
    scaler.get_isfinite().fill_(True)
    scaler.get_global_norm().fill_(1.0)
    assert not bool(scaler.get_isfinite())
    assert scaler.step(optimizer) is None
    scaler.update()
    assert_tensors_equal(before, parameters_of(model))
    assert optimizer.state_dict()["state"] == {}
    assert int(scaler.get_num_skipped_steps()) == 1
    # Between iterations the accessors read the state: still copies.
    scaler.get_isfinite().fill_(True)
    scaler.get_global_norm().fill_(5.0)
    assert not bool(scaler.get_isfinite())
    assert float(scaler.get_global_norm()) == INF


def test_changing_the_returned_scale_does_not_change_the_scaler():
    scaler = cstorch.amp.GradScaler(**DLS)
    scaler.get_scale().fill_(3.0)
    scaler.get_non_clamped_scale().fill_(3.0)
    assert float(scaler.get_scale()) == float(scaler.get_non_clamped_scale()) == DLS["init_scale"]


@pytest.mark.parametrize("fused", [False, True])
def test_step_under_inference_mode_then_train_on(fused):
    model, reference = TinyNet(), TinyNet()
    optimizer = torch.optim.Adam(model.parameters(), lr=0.01, fused=fused)
    reference_optimizer = torch.optim.Adam(reference.parameters(), lr=0.01, fused=fused)
    scaler = cstorch.amp.GradScaler(**DLS)
    for step in range(4):
        optimizer.zero_grad()
        scaler.scale(loss_of(model, step)).backward()
        with torch.inference_mode():
            scaler.step(optimizer)
            scaler.update()
        plain_step(reference, reference_optimizer, step)
    assert_tensors_equal(parameters_of(reference), parameters_of(model))
    assert not scaler.get_scale().is_inference()


@pytest.mark.filterwarnings("ignore:Using backward\\(\\) with create_graph=True")
def test_create_graph_gradients_step_like_plain_torch_and_survive_a_dtype_change():
    model, reference = TinyNet(), TinyNet()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    reference_optimizer = torch.optim.SGD(reference.parameters(), lr=0.1)
    scaler = cstorch.amp.GradScaler(**DLS)
    for step in range(4):
        if step == 2:  # grad.data = grad.double() inside: new gradient dtypes, one new compile
            model.double()
            reference.double()
        optimizer.zero_grad(set_to_none=False)
        scaler.scale(loss_of(model, step)).backward(create_graph=True)
        scaler.step(optimizer)
        scaler.update()
        reference_optimizer.zero_grad(set_to_none=False)
        loss_of(reference, step).backward(create_graph=True)
        reference_optimizer.step()
        assert_tensors_equal(parameters_of(reference), parameters_of(model))
        assert all(p.grad.requires_grad for p in model.parameters() if p.grad is not None)


def test_a_parameter_whose_first_gradient_overflows_gets_no_state_from_a_fused_step():
    model = TinyNet()
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.01, fused=True)
    scaler = cstorch.amp.GradScaler(**DLS)
    for step in range(2):  # fused state for fc1 and fc2; `unused` has no gradient
        one_step(scaler, model, optimizer, step)
    optimizer.zero_grad()
    scaler.scale(loss_of(model, 2) + model.unused(torch.ones(1, 2)).sum()).backward()
    model.fc2.bias.grad[0] = INF
    before, snapshot = parameters_of(model), optimizer_snapshot(optimizer)
    assert scaler.step(optimizer) is None
    scaler.update()
    assert_tensors_equal(before, parameters_of(model))
    assert deep_equal(snapshot, optimizer.state_dict())
    assert model.unused.weight not in optimizer.state
