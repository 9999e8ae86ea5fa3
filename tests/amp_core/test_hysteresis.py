"""Hysteresis, consecutive hysteresis and the growth interval of the update rule.

Oracles: hand-computed traces (each step's expected state written out below, derived from the
rule in ``DynamicLossScale``'s docstring), and SPEC section 2 itself: with the new arguments at
their defaults, every state equals the state of a configuration that never had them. The
frameworks' own classes are the oracles of ``test_framework_rules.py``.
"""

from __future__ import annotations

import functools
import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from amp_helpers import F, T, update_trace

import amp_core


@pytest.fixture(params=["eager", "jit"])
def run(request):
    """``run(cfg, isfinite_sequence) -> [(scale, steps, absorbed, skipped, at_min)]``."""

    def run_trace(cfg, sequence):
        return [
            (
                float(state.loss_scale),
                int(state.steps_since_rescale),
                int(state.absorbed_overflows),
                int(state.num_skipped_steps),
                int(state.overflows_at_min_scale),
            )
            for state in update_trace(cfg, sequence, jit=request.param == "jit")
        ]

    return run_trace


def dynamic(**kwargs):
    return amp_core.DynamicLossScale(**kwargs)


def test_hysteresis_absorbs_overflows_until_the_last_strike(run):
    cfg = dynamic(init_scale=64.0, steps_per_increase=100, hysteresis=3)
    assert run(cfg, [F, T, F, F, F]) == [
        (64.0, 0, 1, 1, 0),  # absorbed: skipped, scale kept, the step count restarts
        (64.0, 1, 1, 1, 0),  # a finite step forgives nothing (not consecutive)
        (64.0, 0, 2, 2, 0),  # absorbed: the last strike is left
        (32.0, 0, 2, 3, 0),  # the third overflow halves; the strikes stay used up
        (16.0, 0, 2, 4, 0),  # and every overflow halves until the scale grows
    ]


def test_growth_restores_the_hysteresis(run):
    cfg = dynamic(init_scale=64.0, steps_per_increase=2, hysteresis=2)
    assert run(cfg, [F, F, T, T, T, F, F]) == [
        (64.0, 0, 1, 1, 0),
        (32.0, 0, 1, 2, 0),
        (32.0, 1, 1, 2, 0),
        (32.0, 2, 1, 2, 0),
        (64.0, 0, 0, 2, 0),  # grown: the strike is given back
        (64.0, 0, 1, 3, 0),  # absorbed again
        (32.0, 0, 1, 4, 0),
    ]


def test_consecutive_hysteresis_forgives_at_every_finite_step(run):
    cfg = dynamic(
        init_scale=64.0, steps_per_increase=100, hysteresis=2, consecutive_hysteresis=True
    )
    assert run(cfg, [F, T, F, T, F, F]) == [
        (64.0, 0, 1, 1, 0),
        (64.0, 1, 0, 1, 0),  # forgiven
        (64.0, 0, 1, 2, 0),  # so this one is absorbed too
        (64.0, 1, 0, 2, 0),
        (64.0, 0, 1, 3, 0),
        (32.0, 0, 1, 4, 0),  # two in a row: halved
    ]


def test_growth_interval_counts_from_the_growth_step(run):
    """``growth_interval=2`` with ``steps_per_increase=3``: the first growth after 4 steps, the
    next ones every 2 (DeepSpeed's window: ``W + 1`` steps, then every ``W``)."""
    cfg = dynamic(init_scale=1.0, steps_per_increase=3, growth_interval=2, max_loss_scale=2.0**20)
    assert [s[:2] for s in run(cfg, [T] * 8 + [F] + [T] * 4)] == [
        (1.0, 1),
        (1.0, 2),
        (1.0, 3),
        (2.0, 2),  # grown; the count restarts at steps_per_increase + 1 - growth_interval
        (2.0, 3),
        (4.0, 2),
        (4.0, 3),
        (8.0, 2),
        (4.0, 0),  # an overflow restarts from zero: 4 steps again
        (4.0, 1),
        (4.0, 2),
        (4.0, 3),
        (8.0, 2),
    ]


def test_an_absorbed_overflow_at_the_minimum_is_not_counted_as_a_stall(run):
    cfg = dynamic(init_scale=1.0, min_loss_scale=1.0, steps_per_increase=100, hysteresis=2)
    assert [(s[2], s[4]) for s in run(cfg, [F, F, F, T, F])] == [
        (1, 0),  # absorbed: not a try to lower the scale
        (1, 1),  # halving at the minimum: a stalled step
        (1, 2),
        (1, 0),  # a finite step ends the stall
        (1, 1),  # strikes are still used up (no growth since)
    ]
    stalled = amp_core.DynamicLossScale(
        init_scale=1.0, min_loss_scale=1.0, hysteresis=2, stall_steps=1
    )
    state = amp_core.update(stalled, amp_core.init(stalled), False)
    assert not bool(amp_core.is_stalled(stalled, state))
    state = amp_core.update(stalled, state, False)
    assert bool(amp_core.is_stalled(stalled, state))


@pytest.mark.parametrize("tolerance", [0.0, 0.25])
def test_the_defaults_are_spec_section_2(tolerance):
    """Every sequence of 8 steps: explicit defaults give the states of the plain configuration
    (whose rule test_update_rule.py and the reference traces pin down)."""
    plain = dynamic(init_scale=8.0, steps_per_increase=2, overflow_tolerance=tolerance)
    explicit = dynamic(
        init_scale=8.0,
        steps_per_increase=2,
        overflow_tolerance=tolerance,
        hysteresis=1,
        consecutive_hysteresis=False,
        growth_interval=3,
    )
    assert plain == explicit

    def trace(cfg, flags):
        def body(state, isfinite):
            state = amp_core.update(cfg, state, isfinite)
            return state, state

        return jax.lax.scan(body, amp_core.init(cfg), flags)[1]

    sequences = jnp.asarray(list(itertools.product([True, False], repeat=8)))
    states = jax.jit(jax.vmap(functools.partial(trace, plain)))(sequences)
    assert not np.any(np.asarray(states.absorbed_overflows))
    # An independent oracle for the whole grid: SPEC section 2 transcribed in plain Python.
    for flags, scales in zip(sequences.tolist(), np.asarray(states.loss_scale), strict=True):
        assert list(scales) == spec_section_2_scales(8.0, 2, tolerance, flags)


def spec_section_2_scales(scale, steps_per_increase, tolerance, flags):
    steps = overflows = 0
    out = []
    for isfinite in flags:
        steps += 1
        overflows += not isfinite
        if np.float32(overflows) / np.float32(steps) > np.float32(tolerance):
            scale, steps, overflows = scale / 2, 0, 0
        if steps > steps_per_increase:
            scale, steps, overflows = scale * 2, 0, 0
        out.append(max(min(scale, 2.0**15), 2.0**-14))
        scale = out[-1]
    return out


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"hysteresis": 0}, ValueError, r"hysteresis must be an integer from 1.*got 0"),
        ({"hysteresis": 2.5}, ValueError, r"hysteresis must be a whole number; got 2.5"),
        ({"hysteresis": "2"}, TypeError, r"hysteresis must be an integer; got '2'"),
        ({"hysteresis": True}, TypeError, r"hysteresis must be an integer; got True"),
        ({"consecutive_hysteresis": 1}, TypeError, r"consecutive_hysteresis must be a bool"),
        ({"growth_interval": 0}, ValueError, r"growth_interval must be an integer from 1"),
        ({"growth_interval": 12}, ValueError, r"growth_interval must be from 1 to.* = 11; got 12"),
        (
            {"hysteresis": 2, "overflow_tolerance": 0.1},
            ValueError,
            r"hysteresis=2 and overflow_tolerance=0.1 cannot be combined",
        ),
        (
            {"growth_interval": 5, "overflow_tolerance": 0.1},
            ValueError,
            r"growth_interval=5 needs overflow_tolerance=0",
        ),
    ],
)
def test_bad_hysteresis_arguments_name_the_argument(kwargs, error, match):
    with pytest.raises(error, match=match):
        dynamic(steps_per_increase=10, **kwargs)
    with pytest.raises(error, match=match):
        amp_core.make_config("dynamic", steps_per_increase=10, **kwargs)


def test_static_scaling_checks_the_hysteresis_arguments_too():
    assert amp_core.make_config(4.0, hysteresis=3) == amp_core.StaticLossScale(4.0)
    with pytest.raises(ValueError, match="hysteresis must be an integer from 1"):
        amp_core.make_config(4.0, hysteresis=0)


def test_state_dict_has_the_strikes_only_with_hysteresis():
    assert "absorbed_overflows" not in amp_core.state_dict_keys(dynamic())
    cfg = dynamic(init_scale=64.0, hysteresis=3)
    state = amp_core.update(cfg, amp_core.init(cfg), False)
    saved = amp_core.to_state_dict(cfg, state)
    assert saved["absorbed_overflows"] == 1 and isinstance(saved["absorbed_overflows"], int)
    with pytest.raises(ValueError, match=r"absorbed_overflows.*does not have"):
        amp_core.from_state_dict(dynamic(), amp_core.init(dynamic()), saved)
    with pytest.raises(ValueError, match=r"absorbed_overflows'\] must be less than hysteresis=3"):
        amp_core.from_state_dict(cfg, amp_core.init(cfg), {"absorbed_overflows": 3})
    with pytest.raises(ValueError, match=r"absorbed_overflows'\] must be a non-negative"):
        amp_core.from_state_dict(cfg, amp_core.init(cfg), {"absorbed_overflows": -1})


def test_a_checkpoint_resumes_the_strikes_bit_for_bit():
    cfg = dynamic(init_scale=2.0**10, steps_per_increase=3, hysteresis=3)
    flags = [F, T, F, T, T, T, T, F, F, F, T, F, T, T, T, T, F]
    step = jax.jit(functools.partial(amp_core.update, cfg))
    uninterrupted = [amp_core.init(cfg)]
    for isfinite in flags:
        uninterrupted.append(step(uninterrupted[-1], isfinite))
    for cut in range(len(flags)):
        saved = amp_core.to_state_dict(cfg, uninterrupted[cut])
        state = amp_core.from_state_dict(cfg, amp_core.init(cfg), saved)
        for isfinite in flags[cut:]:
            state = step(state, isfinite)
        assert amp_core.to_state_dict(cfg, state) == amp_core.to_state_dict(cfg, uninterrupted[-1])
        assert float(state.loss_scale) == float(uninterrupted[-1].loss_scale)


def test_an_old_checkpoint_without_the_strikes_loads_with_all_strikes_left():
    cfg = dynamic(init_scale=64.0, hysteresis=2)
    old = {"loss_scale": 32.0, "steps_since_rescale": 3, "overflows_since_rescale": 0}
    state = amp_core.from_state_dict(cfg, amp_core.init(cfg), old)
    assert int(state.absorbed_overflows) == 0
    state = amp_core.update(cfg, state, False)  # the first overflow is absorbed
    assert float(state.loss_scale) == 32.0


def test_a_state_pytree_saved_before_the_field_is_found_without_a_target():
    """A checkpoint restored without a target, written before ``absorbed_overflows`` existed:
    a mapping of the eight older fields. It is found, with no strike used."""
    cfg = dynamic()
    state = amp_core.update(cfg, amp_core.init(cfg), False)
    old = {k: v for k, v in state._asdict().items() if k != "absorbed_overflows"}
    found = amp_core.loss_scale_state({"opt_state": {"scaler": old, "inner_state": ()}})
    assert float(found.loss_scale) == float(state.loss_scale)
    assert int(found.absorbed_overflows) == 0
    eight = amp_core.LossScaleState(*list(state)[:8])  # as an eight-field pickle unpickles
    assert int(eight.absorbed_overflows) == 0


def test_hysteresis_composes_with_the_optax_wrapper():
    """One overflow absorbed, the second halves: parameters untouched on both skips."""
    import optax

    cfg = dynamic(init_scale=4.0, steps_per_increase=100, hysteresis=2)
    tx = amp_core.with_loss_scaling(optax.sgd(0.5), cfg)
    params = {"w": jnp.ones(2)}
    opt_state = tx.init(params)
    grads_by_step = [jnp.array([jnp.inf, 0.0]), jnp.array([jnp.nan, 0.0]), jnp.array([4.0, 8.0])]
    scales = []
    for grads in grads_by_step:
        updates, opt_state = tx.update({"w": grads}, opt_state, params)
        params = optax.apply_updates(params, updates)
        scales.append(float(amp_core.loss_scale_state(opt_state).loss_scale))
    assert scales == [4.0, 2.0, 2.0]
    np.testing.assert_array_equal(np.asarray(params["w"]), [1.0 - 0.5 * 2.0, 1.0 - 0.5 * 4.0])
