"""``GradScaler(hysteresis=..., consecutive_hysteresis=...)`` and the DeepSpeed/Megatron importers.

Oracles: DeepSpeed's ``DynamicLossScaler`` and Megatron's ``DynamicGradScaler`` fed the overflow
flags of a torch training loop with planted inf gradients (tests/framework_oracles.py); a plain
torch run without loss scaling for the parameters (every scale is a power of two, so scaling
and unscaling are exact, and a skipped step must leave parameters and Adam's state untouched);
the uninterrupted run for a resumed one.
"""

from __future__ import annotations

import io
import pickle

import pytest
import torch
from facade_helpers import INF, NAN, TinyNet, assert_tensors_equal, deep_equal, loss_of
from framework_oracles import deepspeed_trace, megatron_trace

import torch_facade as cstorch

STEPS = 40
# Bursts: absorbed strikes, halvings, finite runs long enough (window 3) to grow again.
OVERFLOW_STEPS = {0, 1, 2, 3, 10, 12, 13, 22, 23, 24, 33}

FP16 = {
    "enabled": True,
    "loss_scale": 0,
    "initial_scale_power": 8,
    "loss_scale_window": 3,
    "hysteresis": 2,
    "min_loss_scale": 1,
}


def train(model, optimizer, scaler, steps, *, overflow_steps=OVERFLOW_STEPS, value=INF):
    """Trains; returns the scale after every update and the parameters after every step."""
    scales, params = [], []
    for step in steps:
        optimizer.zero_grad()
        scaler.scale(loss_of(model, step)).backward()
        if step in overflow_steps:
            model.fc1.weight.grad[0, 1] = value
        scaler.step(optimizer)
        scaler.update()
        scales.append(float(scaler.get_scale()))
        params.append([p.detach().clone() for p in model.parameters()])
    return scales, params


def plain_torch_run(steps, overflow_steps):
    """The oracle for the parameters: Adam without any scaling, not stepped on overflows."""
    model = TinyNet()
    optimizer = torch.optim.Adam(model.parameters(), lr=0.01)
    params = []
    for step in steps:
        optimizer.zero_grad()
        loss_of(model, step).backward()
        if step not in overflow_steps:
            optimizer.step()
        params.append([p.detach().clone() for p in model.parameters()])
    return params


@pytest.mark.parametrize("consecutive", [False, True])
def test_from_deepspeed_config_follows_deepspeeds_scaler_in_a_torch_loop(consecutive):
    fp16 = {**FP16, "consecutive_hysteresis": consecutive}
    scaler = cstorch.amp.GradScaler.from_deepspeed_config({"fp16": fp16, "gradient_clipping": 0.0})
    model = TinyNet()
    optimizer = torch.optim.Adam(model.parameters(), lr=0.01)
    scales, params = train(model, optimizer, scaler, range(STEPS))
    flags = [step in OVERFLOW_STEPS for step in range(STEPS)]
    expected, raised_at = deepspeed_trace(
        flags,
        init_scale=2.0**8,
        scale_window=3,
        min_scale=1,
        hysteresis=2,
        consecutive_hysteresis=consecutive,
    )
    assert raised_at is None
    assert scales == [scale for scale, _ in expected]
    assert len(set(scales)) >= 4  # halved and grown
    assert int(scaler.get_num_skipped_steps()) == len(OVERFLOW_STEPS)
    for ours, oracle in zip(params, plain_torch_run(range(STEPS), OVERFLOW_STEPS), strict=True):
        assert_tensors_equal(ours, oracle)
    assert int(scaler.state_dict()["absorbed_overflows"]) == 2 - expected[-1][1]


def test_from_megatron_args_follows_megatrons_scaler_in_a_torch_loop():
    flags = [
        "--fp16",
        "--initial-loss-scale",
        "256",
        "--loss-scale-window",
        "3",
        "--clip-grad",
        "0",
    ]
    scaler = cstorch.amp.GradScaler.from_megatron_args(flags)
    model = TinyNet()
    optimizer = torch.optim.Adam(model.parameters(), lr=0.01)
    scales, params = train(model, optimizer, scaler, range(STEPS), value=NAN)
    expected = megatron_trace(
        [step in OVERFLOW_STEPS for step in range(STEPS)],
        initial_scale=256.0,
        min_scale=1.0,
        growth_interval=3,
        hysteresis=2,
    )
    assert scales == [scale for scale, _ in expected]
    for ours, oracle in zip(params, plain_torch_run(range(STEPS), OVERFLOW_STEPS), strict=True):
        assert_tensors_equal(ours, oracle)


def test_from_deepspeed_config_raises_where_deepspeed_raises():
    """DeepSpeed stops the run ("Current loss scale already at minimum") when an overflow
    finds the scale at min_loss_scale with no strike left: update() raises at that step."""
    fp16 = {**FP16, "initial_scale_power": 2, "min_loss_scale": 1}
    scaler = cstorch.amp.GradScaler.from_deepspeed_config({"fp16": fp16, "gradient_clipping": 0})
    flags = [True] * 8
    _, raised_at = deepspeed_trace(
        flags, init_scale=4.0, scale_window=3, min_scale=1, hysteresis=2,
        consecutive_hysteresis=False,
    )  # fmt: skip
    assert raised_at == 3  # strike, 4 -> 2, 2 -> 1, then the raise
    model = TinyNet()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(cstorch.amp.LossScaleStalledError):
        train(model, optimizer, scaler, range(8), overflow_steps=set(range(8)))
    assert int(scaler.get_num_skipped_steps()) == raised_at + 1


def test_hysteresis_in_the_constructor_and_its_checkpoint():
    scaler = cstorch.amp.GradScaler(
        "dynamic", init_scale=64.0, steps_per_increase=100, hysteresis=3
    )
    model = TinyNet()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    scales, _ = train(model, optimizer, scaler, range(4), overflow_steps={0, 1, 2})
    assert scales == [64.0, 64.0, 32.0, 32.0]
    saved = scaler.state_dict()
    assert (
        int(saved["absorbed_overflows"]) == 2 and saved["absorbed_overflows"].dtype == torch.int64
    )
    assert "absorbed_overflows" not in cstorch.amp.GradScaler("dynamic").state_dict()
    other = cstorch.amp.GradScaler("dynamic", init_scale=64.0, steps_per_increase=100, hysteresis=3)
    other.load_state_dict({k: v for k, v in saved.items() if k != "absorbed_overflows"})
    assert int(other.state_dict()["absorbed_overflows"]) == 0  # an old checkpoint: all strikes
    other.load_state_dict(saved)
    assert deep_equal(other.state_dict(), saved)
    unpickled = pickle.loads(pickle.dumps(scaler))
    assert deep_equal(unpickled.state_dict(), saved)


@pytest.mark.parametrize("stop", [3, 12, 26])
def test_a_resumed_deepspeed_style_run_equals_the_uninterrupted_one(stop):
    def fresh(seed=0):
        model = TinyNet(seed=seed)
        optimizer = torch.optim.Adam(model.parameters(), lr=0.01)
        scaler = cstorch.amp.GradScaler.from_deepspeed_config(
            {"fp16": FP16, "gradient_clipping": 1.0}
        )
        return model, optimizer, scaler

    model, optimizer, scaler = fresh()
    uninterrupted, _ = train(model, optimizer, scaler, range(STEPS))
    first = fresh()
    before, _ = train(*first, range(stop))
    buffer = io.BytesIO()
    torch.save([o.state_dict() for o in first], buffer)
    buffer.seek(0)
    resumed = fresh(seed=5)
    for obj, state in zip(resumed, torch.load(buffer), strict=True):
        obj.load_state_dict(state)
    after, _ = train(*resumed, range(stop, STEPS))
    assert before + after == uninterrupted
    assert deep_equal(resumed[2].state_dict(), scaler.state_dict())
    assert_tensors_equal(list(resumed[0].parameters()), list(model.parameters()))


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"hysteresis": 0}, ValueError, "hysteresis must be an integer from 1"),
        ({"hysteresis": "2"}, TypeError, "hysteresis must be an integer"),
        ({"consecutive_hysteresis": "yes"}, TypeError, "consecutive_hysteresis must be a bool"),
        ({"growth_interval": 0}, ValueError, "growth_interval must be an integer from 1"),
        ({"hysteresis": 2, "overflow_tolerance": 0.5}, ValueError, "cannot be combined"),
    ],
)
def test_bad_constructor_arguments_name_the_argument(kwargs, error, match):
    with pytest.raises(error, match=match):
        cstorch.amp.GradScaler("dynamic", **kwargs)


def test_importers_refuse_bad_settings_before_building_anything():
    with pytest.raises(ValueError, match=r"fp16.hysteresis is \"auto\""):
        cstorch.amp.GradScaler.from_deepspeed_config(
            {"fp16": {"enabled": True, "hysteresis": "auto"}}
        )
    with pytest.raises(ValueError, match=r"--clip-grad=1.0 asks"):
        cstorch.amp.GradScaler.from_megatron_args(["--bf16"])
    static = cstorch.amp.GradScaler.from_megatron_args(["--bf16"], clip_in_scaler=False)
    assert static.get_scale() == 1.0 and not static.is_enabled()
    pinned = cstorch.amp.GradScaler.from_deepspeed_config({"bf16": {"enabled": True}})
    assert pinned.get_scale() == torch.tensor(1.0) and pinned.config.max_gradient_norm == 1.0
