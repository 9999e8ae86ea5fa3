"""Reading DeepSpeed's ``ds_config`` and Megatron's arguments: every key, every refusal.

The expected configurations are written out from the frameworks' documented meaning of each
key (DeepSpeed's ``DeepSpeedFP16Config`` and ``DeepSpeedBF16Config`` in deepspeed 0.19.8,
megatron-core 0.16.1's ``OptimizerConfig`` and ``get_megatron_optimizer``); that the resulting
rule takes the frameworks' decisions step for step is test_framework_rules.py's job.

The two configs in tests/data are typed after public ones (no file was downloaded):
``ds_config_hf_zero2.json`` is the ZeRO-2 example of the Hugging Face transformers DeepSpeed
guide (with its ``"auto"`` values), ``ds_config_gpt_neox.json`` has the shape of gpt-neox's
model configs (``configs/125M.yml``: the ``"fp16": true`` inside the fp16 section, hysteresis
2, gradient clipping 1.0), with their DeepSpeed part written as JSON.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
from pathlib import Path

import pytest

import amp_core

DATA = Path(__file__).resolve().parent.parent / "data"
HF_ZERO2 = DATA / "ds_config_hf_zero2.json"
GPT_NEOX = DATA / "ds_config_gpt_neox.json"


def deepspeed(config, **kwargs):
    return amp_core.from_deepspeed_config(config, **kwargs)


def test_every_fp16_key_maps_to_its_argument():
    config = deepspeed(
        {
            "fp16": {
                "enabled": True,
                "auto_cast": False,
                "loss_scale": 0,
                "initial_scale_power": 20,
                "loss_scale_window": 300,
                "hysteresis": 4,
                "consecutive_hysteresis": True,
                "min_loss_scale": 8,
                "fp16_master_weights_and_grads": False,
            },
            "gradient_clipping": 0.5,
        }
    )
    assert config == amp_core.DynamicLossScale(
        init_scale=2.0**20,
        steps_per_increase=300,
        growth_interval=300,
        min_loss_scale=8.0,
        max_loss_scale=2.0**127,
        hysteresis=4,
        consecutive_hysteresis=True,
        max_gradient_norm=0.5,
        half_dtype="float16",
        stall_steps=1,
    )


def test_absent_keys_take_deepspeeds_defaults():
    config = deepspeed({"fp16": {"enabled": True}})
    assert (config.init_scale, config.steps_per_increase, config.growth_interval) == (
        2.0**16,
        1000,
        1000,
    )
    assert (config.hysteresis, config.consecutive_hysteresis, config.min_loss_scale) == (
        2,
        False,
        1.0,
    )
    assert config.max_gradient_norm == 1.0  # DeepSpeed's gradient_clipping default
    assert deepspeed({"fp16": {"enabled": True}, "gradient_clipping": 0}).max_gradient_norm is None


def test_the_fp16_section_alone_sets_no_clipping():
    config = deepspeed({"enabled": True, "hysteresis": 3})
    assert config.hysteresis == 3 and config.max_gradient_norm is None


def test_a_static_fp16_scale_is_pinned_and_still_skips():
    """DeepSpeed's ZeRO checks fp16 gradients for overflow and skips the step even with a
    fixed ``loss_scale``: a dynamic configuration whose bounds are the scale."""
    config = deepspeed({"fp16": {"enabled": True, "loss_scale": 128}, "gradient_clipping": 2.0})
    assert (config.init_scale, config.min_loss_scale, config.max_loss_scale) == (128.0,) * 3
    assert config.max_gradient_norm == 2.0 and config.hysteresis == 1
    state = amp_core.update(config, amp_core.init(config), False)
    assert float(state.loss_scale) == 128.0 and int(state.num_skipped_steps) == 1


def test_bf16_pins_the_scale_at_one_or_is_static_without_the_overflow_check():
    checked = deepspeed({"bf16": {"enabled": True}})
    assert checked.is_dynamic and checked.half_dtype == "bfloat16"
    assert (checked.init_scale, checked.min_loss_scale, checked.max_loss_scale) == (1.0,) * 3
    assert checked.max_gradient_norm == 1.0
    old_name = deepspeed({"bfloat16": {"enabled": True}, "gradient_clipping": 0.0})
    assert old_name.is_dynamic and old_name.max_gradient_norm is None
    unchecked = {"bf16": {"enabled": True, "check_grad_overflow": False}}
    assert deepspeed(unchecked, clip_in_scaler=False) == amp_core.StaticLossScale(1.0)
    assert deepspeed({"train_batch_size": 8, "gradient_clipping": 0}) == amp_core.StaticLossScale()


def test_clipping_with_a_static_scale_says_how_to_clip():
    with pytest.raises(ValueError, match=r"gradient_clipping=1.0 asks.*clip_in_scaler=False"):
        deepspeed({"bf16": {"enabled": True, "check_grad_overflow": False}})
    with pytest.raises(ValueError, match=r"gradient_clipping=1.0.*static"):
        deepspeed({"train_batch_size": 8})  # fp32: DeepSpeed does not check for overflow


def test_clip_in_scaler_false_leaves_the_clipping_to_the_loop():
    config = deepspeed({"fp16": {"enabled": True}, "gradient_clipping": 1.0}, clip_in_scaler=False)
    assert config.max_gradient_norm is None
    with pytest.raises(TypeError, match="clip_in_scaler must be a bool"):
        deepspeed({"fp16": {"enabled": True}}, clip_in_scaler="no")


def test_the_hugging_face_zero2_example_says_to_resolve_auto():
    with pytest.raises(ValueError, match=r'fp16.enabled is "auto".*resolved config'):
        deepspeed(HF_ZERO2)
    resolved = json.loads(HF_ZERO2.read_text())
    resolved["fp16"]["enabled"] = True  # what the Trainer writes for --fp16
    with pytest.raises(ValueError, match=r'gradient_clipping is "auto"'):
        deepspeed(resolved)
    resolved["gradient_clipping"] = 1.0  # the Trainer's max_grad_norm default
    config = deepspeed(resolved)
    assert (config.init_scale, config.hysteresis, config.steps_per_increase) == (2.0**16, 2, 1000)
    assert config.max_gradient_norm == 1.0 and config.min_loss_scale == 1.0


def test_a_gpt_neox_config_from_its_json_path(tmp_path):
    config = deepspeed(GPT_NEOX)
    assert (config.init_scale, config.hysteresis, config.max_gradient_norm) == (2.0**12, 2, 1.0)
    assert deepspeed(str(GPT_NEOX)) == config
    disagreeing = json.loads(GPT_NEOX.read_text())
    disagreeing["fp16"]["enabled"] = False
    path = tmp_path / "ds_config.json"
    path.write_text(json.dumps(disagreeing))
    with pytest.raises(ValueError, match=r"fp16.fp16=True \(gpt-neox's flag\) disagrees"):
        deepspeed(path)


@pytest.mark.parametrize(
    ("config", "error", "match"),
    [
        ({"fp16": {"enabled": True, "loss_scale_windw": 10}}, ValueError, r"fp16.loss_scale_windw is not a key of DeepSpeed's fp16"),
        ({"bf16": {"enabled": True, "hysteresis": 2}}, ValueError, r"bf16.hysteresis is not a key of DeepSpeed's bf16"),
        ({"enabled": True, "windw": 3}, ValueError, r"^windw is not a key"),
        ({"fp16": {"enabled": True, "hysteresis": "auto"}}, ValueError, r'fp16.hysteresis is "auto"'),
        ({"fp16": "auto"}, ValueError, r'fp16 is "auto"'),
        ({"fp16": {"enabled": "true"}}, TypeError, r"fp16.enabled must be true or false; got 'true'"),
        ({"fp16": {"enabled": True, "consecutive_hysteresis": 1}}, TypeError, r"fp16.consecutive_hysteresis must be true or false"),
        ({"fp16": {"enabled": True, "loss_scale": -1}}, ValueError, r"fp16.loss_scale must be a finite number >= 0; got -1"),
        ({"fp16": {"enabled": True, "loss_scale": True}}, TypeError, r"fp16.loss_scale must be a number"),
        ({"fp16": {"enabled": True, "hysteresis": 0}}, ValueError, r"fp16.hysteresis must be a finite number >= 1"),
        ({"fp16": {"enabled": True, "hysteresis": 1.5}}, ValueError, r"fp16.hysteresis must be a whole number"),
        ({"fp16": {"enabled": True, "loss_scale_window": 0}}, ValueError, r"fp16.loss_scale_window must be"),
        ({"fp16": {"enabled": True, "initial_scale_power": 128}}, ValueError, r"fp16.initial_scale_power must be at most 127"),
        ({"fp16": {"enabled": True, "min_loss_scale": 0}}, ValueError, r"fp16.min_loss_scale=0.0 is below the smallest"),
        ({"fp16": {"enabled": True, "loss_scale": 1e-6}}, ValueError, r"fp16.loss_scale=1e-06 is below"),
        ({"fp16": {"enabled": True}, "bf16": {"enabled": True}}, ValueError, r"fp16.enabled and bf16.enabled are both true"),
        ({"fp16": {"enabled": True}, "gradient_clipping": -1}, ValueError, r"gradient_clipping must be a finite number >= 0"),
        ({"fp16": {"enabled": True}, "gradient_clipping": "auto"}, ValueError, r'gradient_clipping is "auto"'),
        ({"fp16": [1]}, TypeError, r"fp16 must be a mapping"),
        (["fp16"], TypeError, r"config must be a ds_config mapping"),
    ],
)  # fmt: skip
def test_bad_deepspeed_settings_name_the_key(config, error, match):
    with pytest.raises(error, match=match):
        deepspeed(config)


def test_bad_json_files_name_the_file(tmp_path):
    broken = tmp_path / "broken.json"
    broken.write_text("{not json")
    with pytest.raises(ValueError, match=r"broken.json is not valid JSON"):
        deepspeed(broken)
    listed = tmp_path / "list.json"
    listed.write_text("[]")
    with pytest.raises(TypeError, match=r"list.json must hold a JSON object"):
        deepspeed(listed)
    with pytest.raises(FileNotFoundError):
        deepspeed(tmp_path / "missing.json")


# -- Megatron -------------------------------------------------------------------------------------


def megatron(args, **kwargs):
    return amp_core.from_megatron_args(args, **kwargs)


def test_every_megatron_flag_maps_to_its_argument():
    flags = [
        "--fp16",
        "--initial-loss-scale", "65536",
        "--min-loss-scale", "2",
        "--loss-scale-window", "500",
        "--hysteresis", "3",
        "--clip-grad", "0.5",
        "--num-layers", "12",  # not loss scaling: left alone
    ]  # fmt: skip
    expected = amp_core.DynamicLossScale(
        init_scale=65536.0,
        steps_per_increase=499,
        min_loss_scale=2.0,
        max_loss_scale=2.0**127,
        hysteresis=3,
        max_gradient_norm=0.5,
        half_dtype="float16",
    )
    assert megatron(flags) == expected
    assert expected.growth_interval == 500  # Megatron grows every window, from the start
    namespace = argparse.Namespace(
        fp16=True,
        bf16=False,
        loss_scale=None,
        initial_loss_scale=65536.0,
        min_loss_scale=2.0,
        loss_scale_window=500.0,  # Megatron-LM parses it as a float
        hysteresis=3,
        clip_grad=0.5,
        num_layers=12,
        fp16_lm_cross_entropy=False,
    )
    assert megatron(namespace) == expected
    assert megatron(vars(namespace)) == expected


def test_megatron_defaults_and_an_optimizer_config_like_object():
    @dataclasses.dataclass
    class OptimizerConfig:  # the names of megatron-core's OptimizerConfig
        fp16: bool = True
        bf16: bool = False
        loss_scale: float | None = None
        lr: float = 1e-4

    config = megatron(OptimizerConfig())
    assert (config.init_scale, config.min_loss_scale, config.steps_per_increase) == (
        2.0**32,
        1.0,
        999,
    )
    assert (config.hysteresis, config.max_gradient_norm, config.stall_steps) == (2, 1.0, 999)


def test_megatron_constant_scale_and_bf16():
    pinned = megatron({"fp16": True, "loss_scale": 1024.0})
    assert (pinned.init_scale, pinned.min_loss_scale, pinned.max_loss_scale) == (1024.0,) * 3
    assert megatron({"fp16": True, "loss_scale": 0}).is_dynamic  # 0: Megatron's "not given"
    assert megatron({"bf16": True, "loss_scale": 8.0}).half_dtype == "bfloat16"
    assert megatron(["--bf16"], clip_in_scaler=False) == amp_core.StaticLossScale(1.0)
    assert megatron({"bf16": True, "clip_grad": 0.0}) == amp_core.StaticLossScale(1.0)
    with pytest.raises(ValueError, match=r"--clip-grad=1.0 asks.*clip_in_scaler=False"):
        megatron(["--bf16"])


@pytest.mark.parametrize(
    ("args", "error", "match"),
    [
        (["--fp16", "--loss-scale-windw", "3"], ValueError, r"--loss-scale-windw is not a loss-scaling flag"),
        (["--fp16", "--hysteresis", "two"], ValueError, r"args: argument --hysteresis: invalid int value"),
        (["--fp16", "--hysteresis"], ValueError, r"args: argument --hysteresis: expected one argument"),
        ({"fp16": True, "loss_scale_windw": 3}, ValueError, r"args.loss_scale_windw is not a loss-scaling argument"),
        ({"fp16": True, "hysteresis": 0}, ValueError, r"--hysteresis must be a finite number >= 1"),
        ({"fp16": True, "hysteresis": "2"}, TypeError, r"--hysteresis must be a number; got '2'"),
        ({"fp16": "yes"}, TypeError, r"--fp16 must be a bool"),
        ({"fp16": True, "bf16": True}, ValueError, r"--fp16 and --bf16 are both set"),
        ({"loss_scale": 8.0, "clip_grad": 0}, ValueError, r"--loss-scale=8.0 needs --fp16 or --bf16"),
        ({"fp16": True, "loss_scale_window": 1}, ValueError, r"--loss-scale-window must be at least 2"),
        ({"fp16": True, "loss_scale_window": 10.5}, ValueError, r"--loss-scale-window must be a whole number"),
        ({"fp16": True, "min_loss_scale": 8.0, "initial_loss_scale": 4.0}, ValueError, r"--min-loss-scale=8.0 must not exceed"),
        ({"fp16": True, "initial_loss_scale": float("inf")}, ValueError, r"--initial-loss-scale must be a finite number"),
        ({"fp16": True, "clip_grad": -1.0}, ValueError, r"--clip-grad must be a finite number >= 0"),
        ("--fp16", TypeError, r"got a string '--fp16' \(split it"),
        ([16], TypeError, r"args must be a list of strings"),
        (16, TypeError, r"args must be Megatron's argparse.Namespace"),
    ],
)  # fmt: skip
def test_bad_megatron_arguments_name_the_flag(args, error, match):
    with pytest.raises(error, match=match):
        megatron(args)
