"""Property test: the jitted core against a plain-Python model of SPEC section 2.

The model below is written from the SPEC text alone, with numpy float32 where the SPEC says
float32, and Python ints for the counters. Each hypothesis example is one random configuration
and one random ``isfinite`` sequence (up to 200 steps), run through ``jax.lax.scan`` with the
configuration static, so each example compiles once.
"""

from __future__ import annotations

import dataclasses
import itertools

import jax
import jax.numpy as jnp
import numpy as np
from hypothesis import assume, event, given, settings
from hypothesis import strategies as st

import amp_core


@dataclasses.dataclass
class ModelState:
    scale: np.float32
    non_clamped: np.float32
    steps: int = 0
    overflows: int = 0
    skipped: int = 0

    def as_tuple(self) -> tuple[float, float, int, int, int]:
        return (
            float(self.scale),
            float(self.non_clamped),
            self.steps,
            self.overflows,
            self.skipped,
        )


def model_init(cfg: amp_core.DynamicLossScale) -> ModelState:
    """SPEC section 1: ``loss_scale = min(max_loss_scale, init_scale)`` as float32."""
    scale = np.float32(min(cfg.max_loss_scale, cfg.init_scale))
    return ModelState(scale=scale, non_clamped=scale)


def model_update(cfg: amp_core.DynamicLossScale, s: ModelState, isfinite: bool) -> ModelState:
    """SPEC section 2, line by line."""
    steps = s.steps + 1
    overflows = s.overflows + (0 if isfinite else 1)
    ratio = np.float32(overflows) / np.float32(steps)
    scale = s.scale
    if np.float32(cfg.overflow_tolerance) < ratio:
        scale = np.float32(scale / np.float32(2))
        steps = overflows = 0
    if cfg.steps_per_increase < steps:
        scale = np.float32(scale * np.float32(2))
        steps = overflows = 0
    scale = min(scale, np.float32(cfg.max_loss_scale))
    non_clamped = scale
    scale = max(scale, np.float32(cfg.min_loss_scale))
    skipped = s.skipped + (0 if isfinite else 1)
    return ModelState(np.float32(scale), np.float32(non_clamped), steps, overflows, skipped)


def model_trace(cfg, sequence):
    state = model_init(cfg)
    trace = []
    for isfinite in sequence:
        state = model_update(cfg, state, isfinite)
        trace.append(state.as_tuple())
    return trace


def core_trace(cfg, sequence):
    """Runs :func:`amp_core.update` over ``sequence`` in one jitted ``lax.scan``."""

    @jax.jit
    def run(isfinite_sequence):
        def body(state, isfinite):
            new = amp_core.update(cfg, state, isfinite)
            return new, new

        return jax.lax.scan(body, amp_core.init(cfg), isfinite_sequence)[1]

    states = jax.device_get(run(jnp.asarray(sequence, jnp.bool_)))
    return [
        (
            float(states.loss_scale[i]),
            float(states.non_clamped_scale[i]),
            int(states.steps_since_rescale[i]),
            int(states.overflows_since_rescale[i]),
            int(states.num_skipped_steps[i]),
        )
        for i in range(len(sequence))
    ]


def powers_of_two(low: int, high: int):
    return st.integers(low, high).map(lambda k: 2.0**k)


def scales(low: float, high: float):
    """Mostly powers of two (as in practice), sometimes arbitrary floats."""
    return st.one_of(
        powers_of_two(int(np.log2(low)), int(np.log2(high))),
        st.floats(low, high, allow_nan=False, allow_infinity=False),
    )


@st.composite
def dynamic_configs(draw):
    half_dtype = draw(st.sampled_from(["float16", "bfloat16", "cbfloat16"]))
    init_scale = draw(st.none() | scales(2.0**-20, 2.0**40))
    min_loss_scale = draw(st.none() | scales(2.0**-14, 2.0**12))
    max_loss_scale = draw(st.none() | scales(2.0**-10, 2.0**40))
    tolerance = draw(
        st.sampled_from([0.0, 0.1, 0.25, 1 / 3, 0.5, 2 / 3, 0.75, 1.0])
        | st.floats(0.0, 1.5, allow_nan=False)
    )
    kwargs = {
        "half_dtype": half_dtype,
        "init_scale": init_scale,
        "min_loss_scale": min_loss_scale,
        "max_loss_scale": max_loss_scale,
        "steps_per_increase": draw(st.integers(1, 10)),
        "overflow_tolerance": tolerance,
    }
    try:
        return amp_core.DynamicLossScale(**kwargs)
    except ValueError:
        assume(False)  # min > max after the defaults: not a valid configuration


@st.composite
def isfinite_sequences(draw):
    """Sequences with a random overflow rate, from none to all, so both rules fire."""
    overflow_per_ten = draw(st.integers(0, 10))
    digits = draw(st.lists(st.integers(0, 9), min_size=1, max_size=200))
    return [digit >= overflow_per_ten for digit in digits]


@settings(max_examples=60, deadline=None)
@given(cfg=dynamic_configs(), sequence=isfinite_sequences())
def test_core_matches_plain_python_model_of_the_spec(cfg, sequence):
    expected = model_trace(cfg, sequence)
    describe_coverage(cfg, expected)
    assert core_trace(cfg, sequence) == expected


def describe_coverage(cfg, trace):
    """Hypothesis events (``--hypothesis-show-statistics``): which rules the example exercised."""
    scales_seen = [model_init(cfg).scale] + [scale for scale, *_ in trace]
    if any(new > old for old, new in itertools.pairwise(scales_seen)):
        event("grew")
    if any(new < old for old, new in itertools.pairwise(scales_seen)):
        event("halved")
    if any(non_clamped < scale for scale, non_clamped, *_ in trace):
        event("clamped at min_loss_scale")
    if any(scale == np.float32(cfg.max_loss_scale) for scale, *_ in trace):
        event("at max_loss_scale")


def test_model_reproduces_a_hand_computed_trace():
    """The model itself is checked against a trace worked out by hand."""
    cfg = amp_core.DynamicLossScale(
        init_scale=4.0, min_loss_scale=2.0, steps_per_increase=2, overflow_tolerance=0.5
    )
    assert model_trace(cfg, [True, False, True, False, False, False]) == [
        (4.0, 4.0, 1, 0, 0),
        (4.0, 4.0, 2, 1, 1),  # ratio 1/2 == tolerance: kept
        (8.0, 8.0, 0, 0, 1),  # 3 steps > 2: doubled
        (4.0, 4.0, 0, 0, 2),  # ratio 1/1 > 0.5: halved
        (2.0, 2.0, 0, 0, 3),
        (2.0, 1.0, 0, 0, 4),  # halved below the minimum: clamped, non-clamped shows 1
    ]
