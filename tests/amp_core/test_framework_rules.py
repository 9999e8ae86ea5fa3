"""The configurations read from DeepSpeed and Megatron take their scalers' decisions, step by step.

Oracles: DeepSpeed's ``DynamicLossScaler`` and Megatron's ``DynamicGradScaler`` themselves
(tests/framework_oracles.py says how they run on a CPU), fed the same overflow sequences as
:func:`amp_core.update` under the configuration :func:`amp_core.from_deepspeed_config` or
:func:`amp_core.from_megatron_args` made from the same settings. Compared after every step: the
scale, the strikes left, and for DeepSpeed the step where it raises at the minimum scale
(:func:`amp_core.is_stalled` turns true there, and only there).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from framework_oracles import deepspeed_trace, megatron_trace

import amp_core


def overflow_sequence(seed: int, length: int = 400) -> list[bool]:
    """Bursts of overflows between runs of finite steps of every length, so that hysteresis is
    spent and restored, the scale halves to its minimum and grows again."""
    rng = np.random.default_rng(seed)
    flags: list[bool] = []
    while len(flags) < length:  # True: an overflow
        flags += [False] * int(rng.integers(0, 16))
        flags += [True] * int(rng.integers(1, 4))
        flags += [bool(x) for x in rng.random(int(rng.integers(1, 8))) < 0.3]
    return flags[:length]


@functools.cache
def _scan(config: amp_core.DynamicLossScale):
    def body(state, overflow):
        state = amp_core.update(config, state, jnp.logical_not(overflow))
        out = (state.loss_scale, state.absorbed_overflows, amp_core.is_stalled(config, state))
        return state, out

    return jax.jit(lambda flags: jax.lax.scan(body, amp_core.init(config), flags)[1])


def ours(config, overflows):
    scales, absorbed, stalled = _scan(config)(jnp.asarray(overflows))
    return [float(s) for s in scales], [int(a) for a in absorbed], [bool(s) for s in stalled]


DEEPSPEED_CASES = [
    # (initial_scale_power, loss_scale_window, hysteresis, consecutive_hysteresis, min_loss_scale)
    (16, 1000, 2, False, 1),  # DeepSpeed's defaults
    (6, 3, 2, False, 1),
    (6, 3, 2, True, 1),
    (8, 1, 3, False, 4),
    (8, 2, 4, True, 1),
    (12, 5, 1, False, 1),
    (12, 5, 1, True, 2),
    (10, 4, 3, True, 16),
]


@pytest.mark.parametrize("case", DEEPSPEED_CASES, ids=str)
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_deepspeed_dynamic_loss_scaler_step_for_step(case, seed):
    power, window, hysteresis, consecutive, min_scale = case
    fp16 = {
        "enabled": True,
        "loss_scale": 0,
        "initial_scale_power": power,
        "loss_scale_window": window,
        "hysteresis": hysteresis,
        "consecutive_hysteresis": consecutive,
        "min_loss_scale": min_scale,
    }
    config = amp_core.from_deepspeed_config({"fp16": fp16, "gradient_clipping": 0})
    overflows = overflow_sequence(seed)
    expected, raised_at = deepspeed_trace(
        overflows,
        init_scale=2.0**power,
        scale_window=window,
        min_scale=min_scale,
        hysteresis=hysteresis,
        consecutive_hysteresis=consecutive,
    )
    scales, absorbed, stalled = ours(config, overflows)
    steps = len(expected)
    # DeepSpeed's scale has no upper bound; here it stops at 2**127 (the docs say so): compare
    # up to the step where DeepSpeed's goes beyond.
    beyond = [i for i, (scale, _) in enumerate(expected) if scale > amp_core.UNBOUNDED_LOSS_SCALE]
    if beyond:
        assert scales[beyond[0]] == amp_core.UNBOUNDED_LOSS_SCALE
        steps = beyond[0]
    assert scales[:steps] == [scale for scale, _ in expected[:steps]]
    assert [hysteresis - a for a in absorbed[:steps]] == [left for _, left in expected[:steps]]
    # DeepSpeed raises at its minimum; here the run is stalled at that step and not before.
    assert not any(stalled[:steps])
    if raised_at is not None:
        assert stalled[raised_at]
    assert steps > 20 and len(set(scales[:steps])) >= 3  # not a trivial trace


MEGATRON_CASES = [
    # (initial_loss_scale, min_loss_scale, loss_scale_window, hysteresis)
    (2.0**32, 1.0, 1000, 2),  # Megatron's defaults
    (64.0, 1.0, 2, 2),
    (64.0, 4.0, 3, 1),
    (2.0**10, 1.0, 4, 3),
    (2.0**10, 8.0, 5, 4),
]


@pytest.mark.parametrize("case", MEGATRON_CASES, ids=str)
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_megatron_dynamic_grad_scaler_step_for_step(case, seed):
    initial, min_scale, window, hysteresis = case
    config = amp_core.from_megatron_args(
        {
            "fp16": True,
            "initial_loss_scale": initial,
            "min_loss_scale": min_scale,
            "loss_scale_window": window,
            "hysteresis": hysteresis,
        }
    )
    overflows = overflow_sequence(seed)
    expected = megatron_trace(
        overflows,
        initial_scale=initial,
        min_scale=min_scale,
        growth_interval=window,
        hysteresis=hysteresis,
    )
    scales, absorbed, _ = ours(config, overflows)
    assert scales == [scale for scale, _ in expected]
    # Megatron's tracker goes on counting down past zero; the strikes left are at least 1.
    assert [hysteresis - a for a in absorbed] == [max(tracker, 1) for _, tracker in expected]
    assert len(set(scales)) >= 3  # not a trivial trace


def test_deepspeed_and_megatron_grow_one_step_apart():
    """The same window, no overflow: DeepSpeed first grows after W + 1 steps, then every W;
    Megatron every W (the difference the docs page shows)."""
    window, steps = 3, 10
    flags = [False] * steps
    ds, _ = deepspeed_trace(
        flags, init_scale=1.0, scale_window=window, min_scale=1, hysteresis=2,
        consecutive_hysteresis=False,
    )  # fmt: skip
    mg = megatron_trace(
        flags, initial_scale=1.0, min_scale=1.0, growth_interval=window, hysteresis=2
    )
    assert [s for s, _ in ds] == [1, 1, 1, 2, 2, 2, 4, 4, 4, 8]
    assert [s for s, _ in mg] == [1, 1, 2, 2, 2, 4, 4, 4, 8, 8]
