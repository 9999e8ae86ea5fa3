"""The per-optimizer stage machine (SPEC section 5) and the errors of the whole API.

Every wrong call gets a clear exception of the documented class that names the argument,
raised before anything happens (``optimizer_step`` validates before any backward).
"""

from __future__ import annotations

import math
import re

import pytest
import torch
from facade_helpers import DLS, TinyNet, loss_of, parameters_of

import torch_facade as cstorch


def scaled_backward(scaler, model, step=0):
    scaler.scale(loss_of(model, step)).backward()


@pytest.fixture
def setup():
    model = TinyNet()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    return model, optimizer


# ------------------------------------------------------------------------------ stages


@pytest.mark.parametrize("scaler_kwargs", [DLS, {"loss_scale": 2.0**8}], ids=["dynamic", "static"])
def test_unscale_twice_divides_the_gradients_once(setup, scaler_kwargs):
    model, optimizer = setup
    scaler = cstorch.amp.GradScaler(**scaler_kwargs)
    scaled_backward(scaler, model)
    expected = [p.grad / 2.0**8 for p in model.parameters() if p.grad is not None]
    scaler.unscale_(optimizer)
    scaler.unscale_(optimizer)
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    torch.testing.assert_close(grads, expected, rtol=0, atol=0)
    params_before = parameters_of(model)
    scaler.step(optimizer)  # does not unscale a third time
    torch.testing.assert_close(grads, expected, rtol=0, atol=0)
    for before, after, grad in zip(
        params_before, model.parameters(), [*grads, None, None], strict=True
    ):
        if grad is not None:
            torch.testing.assert_close(after, before - 0.1 * grad, rtol=0, atol=1e-7)


@pytest.mark.parametrize("scaler_kwargs", [DLS, {}], ids=["dynamic", "static-1"])
def test_unscale_after_step_raises(setup, scaler_kwargs):
    model, optimizer = setup
    scaler = cstorch.amp.GradScaler(**scaler_kwargs)
    scaled_backward(scaler, model)
    scaler.step(optimizer)
    with pytest.raises(RuntimeError, match=re.escape("unscale_() is being called after step().")):
        scaler.unscale_(optimizer)


@pytest.mark.parametrize("scaler_kwargs", [DLS, {}], ids=["dynamic", "static-1"])
def test_step_twice_raises_and_does_not_step_again(setup, scaler_kwargs):
    model, optimizer = setup
    scaler = cstorch.amp.GradScaler(**scaler_kwargs)
    scaled_backward(scaler, model)
    scaler.step(optimizer)
    params = parameters_of(model)
    with pytest.raises(RuntimeError, match=r"step\(\)"):
        scaler.step(optimizer)
    assert all(torch.equal(a, b) for a, b in zip(params, model.parameters(), strict=True))


@pytest.mark.parametrize("new_scale", [2.0, 1, torch.tensor(4.0), True])
def test_update_with_new_scale_raises(setup, new_scale):
    model, optimizer = setup
    scaler = cstorch.amp.GradScaler(**DLS)
    scaled_backward(scaler, model)
    scaler.step(optimizer)
    with pytest.raises(ValueError, match="new_scale"):
        scaler.update(new_scale)
    with pytest.raises(ValueError, match="new_scale"):
        scaler.update(new_scale=new_scale)


@pytest.mark.parametrize("new_scale", [None, 0, 0.0])
def test_update_with_falsy_new_scale_updates(setup, new_scale):
    model, optimizer = setup
    scaler = cstorch.amp.GradScaler(**DLS)
    scaled_backward(scaler, model)
    scaler.step(optimizer)
    scaler.update(new_scale)
    assert scaler.state_dict()["steps_since_rescale"] == 1


def test_stages_reset_after_update(setup):
    model, optimizer = setup
    scaler = cstorch.amp.GradScaler(**DLS)
    for step in range(3):
        optimizer.zero_grad()
        scaled_backward(scaler, model, step)
        scaler.unscale_(optimizer)
        scaler.step(optimizer)
        scaler.update()
    assert scaler.state_dict()["steps_since_rescale"] == 3


def test_step_returns_what_optimizer_step_returns(setup):
    model, optimizer = setup
    scaler = cstorch.amp.GradScaler(**DLS)
    scaled_backward(scaler, model)
    sentinel = object()
    original = optimizer.step
    optimizer.step = lambda *args, **kwargs: (original(*args, **kwargs), sentinel)[1]
    assert scaler.step(optimizer) is sentinel


def test_load_state_dict_between_step_and_update_raises(setup):
    model, optimizer = setup
    scaler = cstorch.amp.GradScaler(**DLS)
    scaled_backward(scaler, model)
    scaler.step(optimizer)
    with pytest.raises(RuntimeError, match="load_state_dict"):
        scaler.load_state_dict({"loss_scale": 2.0})


# ------------------------------------------------------------ optimizer_step validation


def fresh():
    model = TinyNet()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = cstorch.amp.GradScaler(**DLS)
    return model, optimizer, scaler


BAD_OPTIMIZER_STEP_CALLS = {
    "loss-not-tensor": (lambda m, o, s: (1.5, o, s, {}), TypeError, "loss"),
    "loss-numpy": (lambda m, o, s: (loss_of(m, 0).detach().numpy(), o, s, {}), TypeError, "loss"),
    "loss-no-grad": (lambda m, o, s: (loss_of(m, 0).detach(), o, s, {}), ValueError, "loss"),
    "loss-not-scalar": (lambda m, o, s: (m(torch.ones(2, 4)), o, s, {}), ValueError, "loss"),
    "optimizer-module": (lambda m, o, s: (loss_of(m, 0), m, s, {}), TypeError, "optimizer"),
    "optimizer-none": (lambda m, o, s: (loss_of(m, 0), None, s, {}), TypeError, "optimizer"),
    "optimizer-empty-list": (lambda m, o, s: (loss_of(m, 0), [], s, {}), TypeError, "optimizer"),
    "optimizer-list-item": (
        lambda m, o, s: (loss_of(m, 0), [o, "x"], s, {}),
        TypeError,
        "optimizer",
    ),
    "scaler-torch": (
        lambda m, o, s: (loss_of(m, 0), o, torch.amp.GradScaler("cpu"), {}),
        TypeError,
        "grad_scaler",
    ),
    "scaler-none": (lambda m, o, s: (loss_of(m, 0), o, None, {}), TypeError, "grad_scaler"),
    "negative-norm": (
        lambda m, o, s: (loss_of(m, 0), o, s, {"max_gradient_norm": -1.0}),
        ValueError,
        "max_gradient_norm",
    ),
    "negative-value": (
        lambda m, o, s: (loss_of(m, 0), o, s, {"max_gradient_value": -0.5}),
        ValueError,
        "max_gradient_value",
    ),
    "nan-norm": (
        lambda m, o, s: (loss_of(m, 0), o, s, {"max_gradient_norm": math.nan}),
        ValueError,
        "max_gradient_norm",
    ),
    "string-norm": (
        lambda m, o, s: (loss_of(m, 0), o, s, {"max_gradient_norm": "1"}),
        TypeError,
        "max_gradient_norm",
    ),
    "both-clips": (
        lambda m, o, s: (
            loss_of(m, 0),
            o,
            s,
            {"max_gradient_norm": 1.0, "max_gradient_value": 1.0},
        ),
        ValueError,
        "max_gradient_norm.*max_gradient_value",
    ),
}


@pytest.mark.parametrize("case", BAD_OPTIMIZER_STEP_CALLS.values(), ids=BAD_OPTIMIZER_STEP_CALLS)
def test_optimizer_step_validates_before_any_backward(case):
    make_args, error, pattern = case
    model, optimizer, scaler = fresh()
    loss, opt, grad_scaler, kwargs = make_args(model, optimizer, scaler)
    params = parameters_of(model)
    with pytest.raises(error, match=pattern):
        cstorch.amp.optimizer_step(loss, opt, grad_scaler, **kwargs)
    assert all(p.grad is None for p in model.parameters())  # no backward happened
    assert all(torch.equal(a, b) for a, b in zip(params, model.parameters(), strict=True))
    assert scaler.state_dict()["steps_since_rescale"] == 0


def test_optimizer_step_does_the_documented_sequence():
    model, optimizer, scaler = fresh()
    reference = TinyNet()
    reference_opt = torch.optim.SGD(reference.parameters(), lr=0.1)
    loss_of(reference, 0).backward()
    reference_opt.step()
    cstorch.amp.optimizer_step(loss_of(model, 0), optimizer, scaler)
    torch.testing.assert_close(parameters_of(model), parameters_of(reference), rtol=0, atol=0)
    assert all(p.grad is None for p in model.parameters())  # zero_grad() ran
    assert scaler.state_dict()["steps_since_rescale"] == 1  # update() ran once


# -------------------------------------------------------------- wrong values everywhere


BAD_CONSTRUCTOR_ARGUMENTS = [
    ({"loss_scale": "dynamik"}, ValueError, "loss_scale"),
    ({"loss_scale": "static"}, ValueError, "loss_scale"),
    ({"loss_scale": 0.0}, ValueError, "loss_scale"),
    ({"loss_scale": -2.0}, ValueError, "loss_scale"),
    ({"loss_scale": math.inf}, ValueError, "loss_scale"),
    ({"loss_scale": math.nan}, ValueError, "loss_scale"),
    ({"loss_scale": [1.0]}, TypeError, "loss_scale"),
    ({"loss_scale": "dynamic", "init_scale": 0.0}, ValueError, "init_scale"),
    ({"loss_scale": "dynamic", "init_scale": -1.0}, ValueError, "init_scale"),
    ({"loss_scale": "dynamic", "init_scale": math.inf}, ValueError, "init_scale"),
    ({"loss_scale": "dynamic", "init_scale": "big"}, TypeError, "init_scale"),
    ({"loss_scale": "dynamic", "min_loss_scale": 2.0**-15}, ValueError, "min_loss_scale"),
    ({"loss_scale": "dynamic", "min_loss_scale": 0.0}, ValueError, "min_loss_scale"),
    ({"loss_scale": "dynamic", "max_loss_scale": 0.0}, ValueError, "max_loss_scale"),
    ({"loss_scale": "dynamic", "max_loss_scale": math.inf}, ValueError, "max_loss_scale"),
    (
        {"loss_scale": "dynamic", "min_loss_scale": 8.0, "max_loss_scale": 4.0},
        ValueError,
        "min_loss_scale.*max_loss_scale",
    ),
    ({"loss_scale": "dynamic", "overflow_tolerance": -0.1}, ValueError, "overflow_tolerance"),
    ({"loss_scale": "dynamic", "overflow_tolerance": math.nan}, ValueError, "overflow_tolerance"),
    ({"loss_scale": "dynamic", "steps_per_increase": 0}, ValueError, "steps_per_increase"),
    ({"loss_scale": "dynamic", "steps_per_increase": -3}, ValueError, "steps_per_increase"),
    ({"loss_scale": "dynamic", "steps_per_increase": 2.5}, ValueError, "steps_per_increase"),
    ({"loss_scale": "dynamic", "steps_per_increase": "10"}, TypeError, "steps_per_increase"),
    ({"loss_scale": "dynamic", "max_gradient_norm": -1.0}, ValueError, "max_gradient_norm"),
    ({"loss_scale": "dynamic", "max_gradient_norm": 0.0}, ValueError, "max_gradient_norm"),
    ({"optimizers": [1]}, TypeError, "optimizers"),
    ({"optimizers": "adam"}, TypeError, "optimizers"),
]


@pytest.mark.parametrize(("kwargs", "error", "pattern"), BAD_CONSTRUCTOR_ARGUMENTS)
def test_constructor_rejects_bad_values_naming_the_argument(kwargs, error, pattern):
    with pytest.raises(error, match=pattern):
        cstorch.amp.GradScaler(**kwargs)


def test_constructor_error_message_shows_the_value():
    with pytest.raises(ValueError, match=r"-3"):
        cstorch.amp.GradScaler(loss_scale="dynamic", steps_per_increase=-3)
    with pytest.raises(ValueError, match=r"dynamik"):
        cstorch.amp.GradScaler(loss_scale="dynamik")


def test_static_scaling_ignores_dynamic_only_arguments():
    scaler = cstorch.amp.GradScaler(loss_scale=4.0, init_scale=8.0, max_gradient_norm=1.0)
    assert scaler.get_scale() == 4.0
    assert scaler.state_dict().keys() == {"loss_scale"}


@pytest.mark.parametrize("value", ["fp16", "float32", "", torch.float32, torch.float64, None, 16])
def test_set_half_dtype_rejects_bad_values_listing_the_accepted_ones(value):
    before = cstorch.amp.get_half_dtype_str(), cstorch.amp.mixed_precision()
    with pytest.raises(ValueError) as info:
        cstorch.amp.set_half_dtype(value)
    for accepted in ("float16", "bfloat16", "cbfloat16"):
        assert repr(accepted) in str(info.value)
    assert (cstorch.amp.get_half_dtype_str(), cstorch.amp.mixed_precision()) == before


@pytest.mark.parametrize("loss", [1.0, None, [torch.tensor(1.0)]])
def test_scale_of_a_non_tensor_raises(loss):
    scaler = cstorch.amp.GradScaler(**DLS)
    with pytest.raises(TypeError, match="loss"):
        scaler.scale(loss)


@pytest.mark.parametrize("method", ["unscale_", "step", "step_if_finite"])
@pytest.mark.parametrize("optimizer", [None, "sgd", torch.nn.Linear(1, 1)])
def test_methods_reject_non_optimizers(method, optimizer):
    scaler = cstorch.amp.GradScaler(**DLS)
    with pytest.raises(TypeError, match="optimizer"):
        getattr(scaler, method)(optimizer)


BAD_STATE_DICTS = [
    # {"scale": 2.0} alone is a (partial) torch.amp.GradScaler checkpoint now (issue 20);
    # mixing its keys with this scaler's stays an error.
    ({"scale": 2.0, "loss_scale": 2.0}, ValueError, "mixes torch.amp.GradScaler keys"),
    ({"loss_scale": 2.0, "growth_tracker": 0}, ValueError, "growth_tracker"),
    ({"loss_scale": 0.0}, ValueError, "loss_scale"),
    ({"loss_scale": -4.0}, ValueError, "loss_scale"),
    ({"loss_scale": math.inf}, ValueError, "loss_scale"),
    ({"loss_scale": "big"}, TypeError, "loss_scale"),
    ({"loss_scale": None}, TypeError, "loss_scale"),
    ({"steps_since_rescale": -1}, ValueError, "steps_since_rescale"),
    ({"overflows_since_rescale": 1.5}, ValueError, "overflows_since_rescale"),
    ({"num_skipped_steps": torch.tensor(2.5)}, ValueError, "num_skipped_steps"),
    ({"num_skipped_steps": 2**40}, ValueError, "num_skipped_steps"),
]


@pytest.mark.parametrize(("state_dict", "error", "pattern"), BAD_STATE_DICTS)
def test_load_state_dict_rejects_bad_keys_and_values_and_keeps_the_state(
    state_dict, error, pattern
):
    scaler = cstorch.amp.GradScaler(**DLS)
    before = scaler.state_dict()
    with pytest.raises(error, match=pattern):
        scaler.load_state_dict(state_dict)
    assert scaler.state_dict() == before


@pytest.mark.parametrize("state_dict", [[("loss_scale", 1.0)], None, 4.0])
def test_load_state_dict_rejects_non_mappings(state_dict):
    with pytest.raises(TypeError, match="mapping"):
        cstorch.amp.GradScaler(**DLS).load_state_dict(state_dict)


def test_static_load_state_dict_rejects_dynamic_keys():
    with pytest.raises(ValueError, match="num_skipped_steps"):
        cstorch.amp.GradScaler(loss_scale=2.0).load_state_dict({"num_skipped_steps": 0})


def test_parameter_in_two_optimizers_is_rejected():
    model = TinyNet()
    first = torch.optim.SGD(model.parameters(), lr=0.1)
    second = torch.optim.SGD(model.fc1.parameters(), lr=0.1)
    scaler = cstorch.amp.GradScaler(**DLS, optimizers=[first, second])
    scaled_backward(scaler, model)
    with pytest.raises(ValueError, match="twice"):
        scaler.step(first)


def test_half_dtype_helpers_reject_wrong_types():
    with pytest.raises(TypeError, match="enable must be a bool"):
        cstorch.amp.enable_mixed_precision("yes")
    with pytest.raises(TypeError, match="tensor"):
        cstorch.amp.is_cbfloat16_tensor(1.0)
    with pytest.raises(ValueError, match="cbfloat16"):
        with cstorch.amp.autocast("half"):
            pass


def test_update_without_a_step_since_the_last_update_raises() -> None:
    model = torch.nn.Linear(2, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = cstorch.amp.GradScaler(loss_scale="dynamic")
    with pytest.raises(RuntimeError, match="without a step"):
        scaler.update()
    scaler.scale(model(torch.ones(1, 2)).sum()).backward()
    scaler.step(optimizer)
    scaler.update()
    steps = int(scaler.state_dict()["steps_since_rescale"])
    with pytest.raises(RuntimeError, match="without a step"):
        scaler.update()
    assert int(scaler.state_dict()["steps_since_rescale"]) == steps


def test_backward_after_the_decision_raises_instead_of_stepping_unchecked_gradients() -> None:
    """GAN-style alternation: G's gradients arrive after the decision taken at step(D)."""
    disc, gen = torch.nn.Linear(2, 1), torch.nn.Linear(2, 1)
    opt_d = torch.optim.SGD(disc.parameters(), lr=0.1)
    opt_g = torch.optim.SGD(gen.parameters(), lr=0.1)
    scaler = cstorch.amp.GradScaler(loss_scale="dynamic", optimizers=[opt_d, opt_g])
    before = gen.weight.detach().clone()
    opt_d.zero_grad()
    scaler.scale(disc(torch.ones(1, 2)).sum()).backward()
    scaler.step(opt_d)
    opt_g.zero_grad()
    with pytest.raises(RuntimeError, match="after this iteration's overflow decision"):
        scaler.scale(gen(torch.full((1, 2), float("inf"))).sum())
    assert torch.equal(gen.weight, before)


def test_load_state_dict_between_scale_and_step_raises() -> None:
    model = torch.nn.Linear(2, 1)
    scaler = cstorch.amp.GradScaler(loss_scale="dynamic")
    scaler.scale(model(torch.ones(1, 2)).sum()).backward()
    with pytest.raises(RuntimeError, match="between iterations"):
        scaler.load_state_dict({"loss_scale": 2.0})


def test_update_rejects_only_a_truthy_new_scale() -> None:
    model = torch.nn.Linear(2, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = cstorch.amp.GradScaler(loss_scale="dynamic")
    for new_scale in (None, 0, 0.0, torch.tensor(0.0)):
        scaler.scale(model(torch.ones(1, 2)).sum()).backward()
        scaler.step(optimizer)
        scaler.update(new_scale=new_scale)
    scaler.scale(model(torch.ones(1, 2)).sum()).backward()
    scaler.step(optimizer)
    for new_scale in (2.0, torch.tensor(4.0), torch.ones(2)):
        with pytest.raises(ValueError, match="new_scale"):
            scaler.update(new_scale=new_scale)


def test_optimizer_step_rejects_the_same_optimizer_twice_before_backward() -> None:
    model = torch.nn.Linear(2, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = cstorch.amp.GradScaler(loss_scale="dynamic")
    loss = model(torch.ones(1, 2)).sum()
    with pytest.raises(ValueError, match="more than once"):
        cstorch.amp.optimizer_step(loss, [optimizer, optimizer], scaler)
    assert all(p.grad is None for p in model.parameters())
