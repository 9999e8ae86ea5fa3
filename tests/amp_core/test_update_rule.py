"""One test per consequence of the SPEC section 2 update rule, on hand-computed traces.

Every trace runs twice: eagerly and with the update jitted (config closed over).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from amp_helpers import F, T, update_trace

import amp_core


@pytest.fixture(params=["eager", "jit"])
def run(request):
    """Returns ``run(cfg, isfinite_sequence) -> [state after each update]``."""

    def run_trace(cfg, sequence):
        return [snapshot(s) for s in update_trace(cfg, sequence, jit=request.param == "jit")]

    return run_trace


def snapshot(state):
    """(loss_scale, non_clamped_scale, steps, overflows, skipped) as Python numbers."""
    return (
        float(state.loss_scale),
        float(state.non_clamped_scale),
        int(state.steps_since_rescale),
        int(state.overflows_since_rescale),
        int(state.num_skipped_steps),
    )


def dynamic(**kwargs):
    return amp_core.DynamicLossScale(**kwargs)


def test_ratio_equal_to_tolerance_does_not_halve(run):
    """1 overflow in 2 steps is a ratio of exactly 0.5: not above a tolerance of 0.5."""
    cfg = dynamic(init_scale=64.0, steps_per_increase=100, overflow_tolerance=0.5)
    assert run(cfg, [T, F, F]) == [
        (64.0, 64.0, 1, 0, 0),
        (64.0, 64.0, 2, 1, 1),  # ratio 1/2 == 0.5: kept
        (32.0, 32.0, 0, 0, 2),  # ratio 2/3 > 0.5: halved, counters reset
    ]


def test_ratio_just_above_tolerance_halves(run):
    cfg = dynamic(init_scale=64.0, steps_per_increase=100, overflow_tolerance=0.5)
    assert run(cfg, [F])[-1] == (32.0, 32.0, 0, 0, 1)  # ratio 1/1 > 0.5


@pytest.mark.parametrize(
    ("tolerance", "sequence"),
    [
        (1 / 3, [T, T, F]),  # float32(1) / float32(3) == float32(1/3)
        (1 / 3, [T, T, T, T, F, F]),  # 2/6 rounds to the same float32
        (0.1, [T] * 9 + [F]),  # float32(1) / float32(10) == float32(0.1) > float64 0.1
        (0.25, [T, T, T, F]),
    ],
    ids=["1/3", "2/6", "1/10", "1/4"],
)
def test_ratio_equal_to_fractional_tolerance_in_float32_does_not_halve(run, tolerance, sequence):
    """The tolerance and the ratio compare as float32 (SPEC section 2).

    A float64 comparison of ``0.1 < float32(1/10)`` (or of ``1/3`` against ``float32(1/3)``)
    would be true and halve the scale; the reference compares in float32 and does not.
    """
    cfg = dynamic(init_scale=64.0, steps_per_increase=100, overflow_tolerance=tolerance)
    overflows = sequence.count(F)
    assert run(cfg, sequence)[-1] == (64.0, 64.0, len(sequence), overflows, overflows)


def test_zero_tolerance_halves_on_first_overflow(run):
    cfg = dynamic(init_scale=64.0, steps_per_increase=100, overflow_tolerance=0.0)
    assert run(cfg, [F, F]) == [(32.0, 32.0, 0, 0, 1), (16.0, 16.0, 0, 0, 2)]


def test_zero_tolerance_halves_on_overflow_after_many_finite_steps(run):
    cfg = dynamic(init_scale=64.0, steps_per_increase=100, overflow_tolerance=0.0)
    states = run(cfg, [T] * 50 + [F])
    assert states[-2] == (64.0, 64.0, 50, 0, 0)
    assert states[-1] == (32.0, 32.0, 0, 0, 1)


def test_default_tolerance_is_zero():
    assert amp_core.DynamicLossScale().overflow_tolerance == 0.0


def test_growth_happens_on_update_steps_per_increase_plus_one(run):
    cfg = dynamic(init_scale=8.0, max_loss_scale=1024.0, steps_per_increase=3)
    assert run(cfg, [T] * 8) == [
        (8.0, 8.0, 1, 0, 0),
        (8.0, 8.0, 2, 0, 0),
        (8.0, 8.0, 3, 0, 0),  # steps == steps_per_increase: not yet (strict)
        (16.0, 16.0, 0, 0, 0),  # the 4th update doubles and resets
        (16.0, 16.0, 1, 0, 0),
        (16.0, 16.0, 2, 0, 0),
        (16.0, 16.0, 3, 0, 0),
        (32.0, 32.0, 0, 0, 0),
    ]


def test_growth_with_steps_per_increase_one_doubles_every_second_update(run):
    cfg = dynamic(init_scale=1.0, steps_per_increase=1)
    scales = [s[0] for s in run(cfg, [T] * 6)]
    assert scales == [1.0, 2.0, 2.0, 4.0, 4.0, 8.0]


def test_first_growth_after_a_halving_counts_from_the_halving(run):
    cfg = dynamic(init_scale=64.0, steps_per_increase=2, overflow_tolerance=0.0)
    assert run(cfg, [T, F, T, T, T]) == [
        (64.0, 64.0, 1, 0, 0),
        (32.0, 32.0, 0, 0, 1),  # halved: counting restarts here
        (32.0, 32.0, 1, 0, 1),
        (32.0, 32.0, 2, 0, 1),
        (64.0, 64.0, 0, 0, 1),  # 3rd update after the rescale
    ]


def test_overflowed_steps_count_toward_growth(run):
    """An overflow tolerated by the ratio still counts as a step toward ``steps_per_increase``."""
    cfg = dynamic(init_scale=64.0, steps_per_increase=3, overflow_tolerance=0.5)
    assert run(cfg, [T, F, T, T]) == [
        (64.0, 64.0, 1, 0, 0),
        (64.0, 64.0, 2, 1, 1),
        (64.0, 64.0, 3, 1, 1),
        (128.0, 128.0, 0, 0, 1),  # 4 steps > 3, one of them overflowed: grows anyway
    ]


def test_scale_grows_even_if_every_step_overflowed_under_full_tolerance(run):
    """With tolerance 1 the ratio never exceeds it, so only overflowed steps still grow."""
    cfg = dynamic(init_scale=64.0, steps_per_increase=2, overflow_tolerance=1.0)
    assert run(cfg, [F, F, F]) == [
        (64.0, 64.0, 1, 1, 1),
        (64.0, 64.0, 2, 2, 2),
        (128.0, 128.0, 0, 0, 3),
    ]


def test_num_skipped_steps_counts_every_overflow_and_is_never_reset(run):
    cfg = dynamic(init_scale=2.0**10, steps_per_increase=1, overflow_tolerance=0.0)
    skipped = [s[4] for s in run(cfg, [F, T, T, F, F, T, T, T])]
    assert skipped == [1, 1, 1, 2, 3, 3, 3, 3]


def test_halving_below_minimum_clamps_scale_and_reports_non_clamped(run):
    cfg = dynamic(init_scale=1.0, min_loss_scale=1.0, steps_per_increase=100)
    assert run(cfg, [F, F]) == [
        (1.0, 0.5, 0, 0, 1),  # 1/2 < min: scale stays at min, non-clamped shows 0.5
        (1.0, 0.5, 0, 0, 2),  # halving starts again from the clamped scale, not from 0.5
    ]


def test_halving_to_the_smallest_allowed_minimum(run):
    cfg = dynamic(init_scale=2.0**-13, min_loss_scale=2.0**-14, steps_per_increase=100)
    assert run(cfg, [F, F]) == [
        (2.0**-14, 2.0**-14, 0, 0, 1),
        (2.0**-14, 2.0**-15, 0, 0, 2),
    ]


def test_initial_scale_below_minimum_is_raised_by_the_first_update(run):
    """``init`` clamps only to the maximum; the min clamp happens in the update."""
    cfg = dynamic(init_scale=0.0625, min_loss_scale=1.0, steps_per_increase=3)
    assert float(amp_core.init(cfg).loss_scale) == 0.0625
    assert run(cfg, [T]) == [(1.0, 0.0625, 1, 0, 0)]


def test_growth_above_maximum_clamps_scale_and_non_clamped(run):
    cfg = dynamic(init_scale=8.0, max_loss_scale=8.0, steps_per_increase=1)
    assert run(cfg, [T, T, T]) == [
        (8.0, 8.0, 1, 0, 0),
        (8.0, 8.0, 0, 0, 0),  # doubled to 16, clamped to 8 before the snapshot; counters reset
        (8.0, 8.0, 1, 0, 0),
    ]


def test_non_power_of_two_maximum_clamps_exactly(run):
    cfg = dynamic(init_scale=96.0, max_loss_scale=100.0, steps_per_increase=1)
    assert run(cfg, [T, T]) == [(96.0, 96.0, 1, 0, 0), (100.0, 100.0, 0, 0, 0)]


def test_halving_from_clamped_maximum(run):
    cfg = dynamic(init_scale=2.0**20, max_loss_scale=100.0, steps_per_increase=10)
    assert float(amp_core.init(cfg).loss_scale) == 100.0
    assert run(cfg, [F]) == [(50.0, 50.0, 0, 0, 1)]


def test_min_equal_to_max_pins_the_scale(run):
    cfg = dynamic(init_scale=4.0, min_loss_scale=4.0, max_loss_scale=4.0, steps_per_increase=1)
    assert run(cfg, [F, T, T]) == [
        (4.0, 2.0, 0, 0, 1),
        (4.0, 4.0, 1, 0, 1),
        (4.0, 4.0, 0, 0, 1),
    ]


@pytest.mark.parametrize("scale", [1.0, 128.0, 2.0**31])
def test_static_scale_never_changes(run, scale):
    cfg = amp_core.StaticLossScale(loss_scale=scale)
    initial = snapshot(amp_core.init(cfg))
    assert initial == (scale, scale, 0, 0, 0)
    assert run(cfg, [F, F, F, T, F] * 5) == [initial] * 25


def test_static_update_returns_arrays_equal_to_the_input_state():
    cfg = amp_core.StaticLossScale(loss_scale=16.0)
    before = amp_core.init(cfg)
    after = jax.jit(functools.partial(amp_core.update, cfg))(before, jnp.asarray(False))
    for name, old, new in zip(before._fields, before, after, strict=True):
        if name != "global_norm":
            np.testing.assert_array_equal(np.asarray(new), np.asarray(old), err_msg=name)
    assert bool(after.isfinite)


def test_update_records_isfinite_and_global_norm():
    cfg = dynamic(init_scale=8.0)
    state = amp_core.update(cfg, amp_core.init(cfg), False, jnp.float32(jnp.inf))
    assert not bool(state.isfinite)
    assert float(state.global_norm) == np.inf
    state = amp_core.update(cfg, state, True, jnp.float32(2.5))
    assert bool(state.isfinite)
    assert float(state.global_norm) == 2.5


@pytest.mark.parametrize("bad", [jnp.array([True]), np.zeros((2,), bool)])
def test_update_rejects_non_scalar_isfinite(bad):
    cfg = dynamic()
    with pytest.raises(ValueError, match="isfinite"):
        amp_core.update(cfg, amp_core.init(cfg), bad)
