"""GradScaler semantics: scale, static scaling, defaults, accessors, and the reference traces."""

from __future__ import annotations

import json
import pathlib
import warnings

import pytest
import torch
from facade_helpers import (
    DLS,
    INF,
    TinyNet,
    assert_tensors_equal,
    loss_of,
    one_step,
    parameters_of,
)

import torch_facade as cstorch

TRACES_PATH = pathlib.Path(__file__).parent.parent / "data" / "dls_reference_traces.json"


def sgd(model: torch.nn.Module) -> torch.optim.Optimizer:
    return torch.optim.SGD(model.parameters(), lr=0.1)


# ----------------------------------------------------------------------------- scale()


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize(("kwargs", "factor"), [(DLS, 2.0**8), ({"loss_scale": 8.0}, 8.0)])
def test_scale_returns_float32_loss_times_scale(dtype, kwargs, factor):
    loss = torch.tensor(0.3, dtype=dtype, requires_grad=True)
    scaled = cstorch.amp.GradScaler(**kwargs).scale(loss)
    assert scaled.dtype is torch.float32
    assert torch.equal(scaled, loss.detach().float() * factor)
    scaled.backward()
    assert loss.grad is not None and float(loss.grad) == factor


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_static_scale_of_one_returns_the_float_loss(dtype):
    loss = torch.tensor([0.3], dtype=dtype)
    scaled = cstorch.amp.GradScaler().scale(loss)
    assert scaled.dtype is torch.float32
    assert torch.equal(scaled, loss.float())
    assert cstorch.amp.GradScaler(loss_scale=1.0).scale(loss).dtype is torch.float32


# --------------------------------------------------------------------- static scaling


@pytest.mark.parametrize("loss_scale", [None, 1.0, 4.0])
def test_static_scaling_never_skips_even_with_inf_gradients(loss_scale):
    model = TinyNet()
    optimizer = sgd(model)
    scaler = cstorch.amp.GradScaler(loss_scale=loss_scale)
    for step in range(3):
        one_step(scaler, model, optimizer, step, poison=step == 1)
        assert bool(scaler.get_isfinite())
    assert torch.isinf(model.fc1.weight[0, 0])  # the inf step was applied
    assert int(scaler.get_num_skipped_steps()) == 0
    expected = 1.0 if loss_scale is None else loss_scale
    assert scaler.get_scale() == expected and type(scaler.get_scale()) is float
    assert scaler.get_non_clamped_scale() == expected
    assert scaler.state_dict() == {"loss_scale": torch.tensor(expected)}


# ------------------------------------------------------------------------ accessors


def test_dynamic_accessors_are_tensors_and_copies():
    scaler = cstorch.amp.GradScaler(**DLS)
    scale = scaler.get_scale()
    assert isinstance(scale, torch.Tensor) and scale.dtype is torch.float32 and scale.shape == ()
    assert float(scale) == DLS["init_scale"]
    scale.fill_(3.0)  # the caller's copy; the scaler is untouched
    assert float(scaler.get_scale()) == DLS["init_scale"]
    skipped = scaler.get_num_skipped_steps()
    assert skipped.dtype is torch.int64 and int(skipped) == 0
    assert scaler.get_isfinite().dtype is torch.bool and bool(scaler.get_isfinite())
    assert scaler.get_global_norm().dtype is torch.float32


def test_overflow_halves_the_scale_and_counts_a_skip():
    model = TinyNet()
    optimizer = sgd(model)
    scaler = cstorch.amp.GradScaler(**DLS)
    one_step(scaler, model, optimizer, 0, poison=True)
    assert float(scaler.get_scale()) == DLS["init_scale"] / 2
    assert float(scaler.get_non_clamped_scale()) == DLS["init_scale"] / 2
    assert int(scaler.get_num_skipped_steps()) == 1
    assert not bool(scaler.get_isfinite())
    assert not torch.isfinite(scaler.get_global_norm())
    one_step(scaler, model, optimizer, 1)
    assert bool(scaler.get_isfinite()) and torch.isfinite(scaler.get_global_norm())
    assert int(scaler.get_num_skipped_steps()) == 1


def test_skip_signal_is_available_between_step_and_update():
    model = TinyNet()
    optimizer = sgd(model)
    scaler = cstorch.amp.GradScaler(**DLS)
    scaler.scale(loss_of(model, 0)).backward()
    model.fc2.bias.grad[1] = -INF
    scaler.step(optimizer)
    isfinite = scaler.get_isfinite()
    assert isinstance(isfinite, torch.Tensor) and not bool(isfinite)
    scaler.update()
    assert not bool(scaler.get_isfinite())


def test_global_norm_is_the_norm_of_the_unscaled_gradients():
    oracle = TinyNet()
    loss_of(oracle, 0).backward()
    expected = torch.linalg.vector_norm(
        torch.cat([p.grad.flatten() for p in oracle.parameters() if p.grad is not None])
    )
    model = TinyNet()
    optimizer = sgd(model)
    scaler = cstorch.amp.GradScaler(**DLS)
    one_step(scaler, model, optimizer)
    torch.testing.assert_close(scaler.get_global_norm(), expected, rtol=1e-6, atol=0)


def test_huge_finite_gradient_counts_as_overflow():
    """A finite unscaled gradient of 2e19 overflows the float32 square (SPEC section 3)."""
    model = TinyNet()
    optimizer = sgd(model)
    scaler = cstorch.amp.GradScaler(**DLS)
    scaler.scale(loss_of(model, 0)).backward()
    model.fc1.weight.grad[0, 0] = 2e19 * DLS["init_scale"]
    assert torch.isfinite(model.fc1.weight.grad).all()
    params = parameters_of(model)
    scaler.step(optimizer)
    scaler.update()
    assert_tensors_equal(params, model.parameters())
    assert int(scaler.get_num_skipped_steps()) == 1


def test_growth_after_steps_per_increase_plus_one_updates_and_the_min_clamp():
    model = TinyNet()
    optimizer = sgd(model)
    scaler = cstorch.amp.GradScaler(**DLS, steps_per_increase=2, min_loss_scale=2.0**7)
    scales, non_clamped = [], []
    for step, poison in enumerate([False, False, False, True, True, False]):
        one_step(scaler, model, optimizer, step, poison)
        scales.append(float(scaler.get_scale()))
        non_clamped.append(float(scaler.get_non_clamped_scale()))
    # Grows on the 3rd update; halves on each overflow, never below the minimum.
    assert scales == [2.0**8, 2.0**8, 2.0**9, 2.0**8, 2.0**7, 2.0**7]
    assert non_clamped == [2.0**8, 2.0**8, 2.0**9, 2.0**8, 2.0**7, 2.0**7]
    one_step(scaler, model, optimizer, 6, poison=True)
    assert float(scaler.get_scale()) == 2.0**7
    assert float(scaler.get_non_clamped_scale()) == 2.0**6


def test_clip_gradients_and_return_isfinite_and_update_scale():
    model = TinyNet()
    optimizer = sgd(model)
    scaler = cstorch.amp.GradScaler(**DLS)
    scaler.scale(loss_of(model, 0)).backward()
    scaled = [p.grad.clone() for p in model.parameters() if p.grad is not None]
    isfinite = scaler.clip_gradients_and_return_isfinite([optimizer])
    assert isinstance(isfinite, torch.Tensor) and bool(isfinite)
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    torch.testing.assert_close(grads, [g / DLS["init_scale"] for g in scaled], rtol=0, atol=0)
    scaler.step(optimizer)
    scaler.update_scale(optimizer)
    scaler.update_scale(optimizer)  # once per iteration
    assert scaler.state_dict()["steps_since_rescale"] == 1
    scaler.update()
    assert scaler.state_dict()["steps_since_rescale"] == 1


# ----------------------------------------------------------------- half dtype defaults


@pytest.mark.parametrize(
    ("half_dtype", "default"),
    [("float16", 2.0**15), ("bfloat16", 2.0**15), ("cbfloat16", 2.0**31)],
)
def test_defaults_follow_the_half_dtype_at_construction(half_dtype, default):
    cstorch.amp.set_half_dtype(half_dtype)
    scaler = cstorch.amp.GradScaler(loss_scale="dynamic")
    cstorch.amp.set_half_dtype("bfloat16" if half_dtype == "cbfloat16" else "cbfloat16")
    later = cstorch.amp.GradScaler(loss_scale="dynamic")
    assert float(scaler.get_scale()) == default  # unchanged by the later switch
    assert float(later.get_scale()) == (2.0**15 if half_dtype == "cbfloat16" else 2.0**31)
    # max_loss_scale follows the same rule: a larger init_scale is clamped to it.
    cstorch.amp.set_half_dtype(half_dtype)
    clamped = cstorch.amp.GradScaler(loss_scale="dynamic", init_scale=2.0**40)
    assert float(clamped.get_scale()) == default


def test_default_min_loss_scale_and_steps_per_increase():
    model = TinyNet()
    optimizer = sgd(model)
    scaler = cstorch.amp.GradScaler(loss_scale="dynamic")
    assert scaler.config.steps_per_increase == 2000
    scaler.load_state_dict({"loss_scale": 2.0**-14})
    one_step(scaler, model, optimizer, poison=True)
    assert float(scaler.get_scale()) == 2.0**-14
    assert float(scaler.get_non_clamped_scale()) == 2.0**-15


def test_non_float32_gradients_warn_once():
    model = TinyNet(torch.bfloat16)
    optimizer = sgd(model)
    scaler = cstorch.amp.GradScaler(**DLS)
    with pytest.warns(UserWarning, match="float32"):
        one_step(scaler, model, optimizer)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        scaler.scale(loss_of(model, 1)).backward()
        scaler.unscale_(optimizer)  # an explicit unscale_ of the same optimizer, still silent
        scaler.step(optimizer)
        scaler.update()


# ------------------------------------------------------------------ reference traces


def load_cases() -> list[dict]:
    return json.loads(TRACES_PATH.read_text())["cases"]


# Every half dtype, tolerances, clamping at both bounds, long overflow runs.
TRACE_CASES = (1, 6, 9, 15, 22, 36, 44, 46, 60, 75)


def test_trace_subset_is_not_trivial():
    cases = [load_cases()[i] for i in TRACE_CASES]
    assert {c["half_dtype"] for c in cases} == {"float16", "bfloat16", "cbfloat16"}
    steps = [s for c in cases for s in c["steps"]]
    assert sum(not s["isfinite"] for s in steps) > 100
    assert any(s["non_clamped_loss_scale"] < s["loss_scale"] for s in steps)
    assert any(c["config"].get("overflow_tolerance", 0) > 0 for c in cases)


@pytest.mark.parametrize("index", TRACE_CASES)
@pytest.mark.filterwarnings("ignore:dynamic loss scaling has stalled")  # traces sit at the minimum
def test_facade_reproduces_reference_trace(index):
    """The recorded loop: scale, backward, inf on overflow steps, unscale_, step, update."""
    case = load_cases()[index]
    cstorch.amp.set_half_dtype(case["half_dtype"])
    model = TinyNet()
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    scaler = cstorch.amp.GradScaler(**case["config"])
    for number, expected in enumerate(case["steps"]):
        optimizer.zero_grad()
        scaler.scale(loss_of(model, number)).backward()
        if not expected["isfinite"]:
            model.fc2.weight.grad[0, 0] = INF
        scaler.unscale_(optimizer)
        scaler.step(optimizer)
        scaler.update()
        state = scaler.state_dict()
        observed = {
            "isfinite": bool(scaler.get_isfinite()),
            "loss_scale": float(scaler.get_scale()),
            "non_clamped_loss_scale": float(scaler.get_non_clamped_scale()),
            "steps_since_rescale": int(state["steps_since_rescale"]),
            "overflows_since_rescale": int(state["overflows_since_rescale"]),
            "num_skipped_steps": int(scaler.get_num_skipped_steps()),
        }
        assert observed == expected, f"step {number}"
        assert float(state["loss_scale"]) == expected["loss_scale"]


# ------------------------------------------------------- against torch.amp.GradScaler


@pytest.mark.parametrize("optimizer_kwargs", [{"foreach": True}, {"fused": True}])
def test_matches_torch_grad_scaler_where_the_rules_coincide(optimizer_kwargs):
    """With tolerance 0 and no max clamp, DLS is torch's rule with growth_interval = spi + 1."""
    torch_model, model = TinyNet(), TinyNet()
    torch_opt = torch.optim.Adam(torch_model.parameters(), lr=0.01, **optimizer_kwargs)
    optimizer = torch.optim.Adam(model.parameters(), lr=0.01, **optimizer_kwargs)
    torch_scaler = torch.amp.GradScaler(
        "cpu", init_scale=2.0**8, growth_factor=2.0, backoff_factor=0.5, growth_interval=3
    )
    scaler = cstorch.amp.GradScaler(**DLS, steps_per_increase=2, max_loss_scale=2.0**20)
    overflow_steps = {4, 8, 9}
    scales = []
    for step in range(12):
        for s, m, o in ((torch_scaler, torch_model, torch_opt), (scaler, model, optimizer)):
            o.zero_grad()
            s.scale(loss_of(m, step)).backward()
            if step in overflow_steps:
                m.fc2.weight.grad[1, 0] = INF
            s.step(o)
            s.update()
        scales.append(float(scaler.get_scale()))
        assert float(scaler.get_scale()) == torch_scaler.get_scale(), f"step {step}"
    assert max(scales) > DLS["init_scale"] and min(scales) < DLS["init_scale"]
    torch.testing.assert_close(
        parameters_of(model), parameters_of(torch_model), rtol=1e-6, atol=1e-7
    )
    assert int(scaler.get_num_skipped_steps()) == len(overflow_steps)
