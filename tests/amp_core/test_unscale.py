"""Unscaling, overflow detection (SPEC section 3) and fused clipping (SPEC section 4).

Oracles: numpy (float32 multiply, rounded once to the leaf dtype, with ml_dtypes for bfloat16),
float64 norms, and ``torch.nn.utils.clip_grad_norm_`` for the clipping.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
import torch
from amp_helpers import assert_bitwise_equal, eps
from hypothesis import given, settings
from hypothesis import strategies as st

import amp_core


def oracle_unscale(grad, scale: float) -> np.ndarray:
    """``g * (1 / scale)`` with the reciprocal and product in float32, rounded to g's dtype."""
    grad = np.asarray(grad)
    inverse = np.float32(1) / np.float32(scale)
    return (grad.astype(np.float32) * inverse).astype(grad.dtype)


def oracle_norm(grads) -> float:
    """float64 L2 norm over the floating leaves of a tree of numpy arrays."""
    leaves = [np.asarray(g) for g in jax.tree_util.tree_leaves(grads)]
    return float(np.sqrt(sum(np.sum(g.astype(np.float64) ** 2) for g in leaves)))


def random_tree(seed: int, magnitude: float = 100.0) -> dict:
    """A nested tree with float32, float16 and bfloat16 leaves (5 leaves)."""
    rng = np.random.default_rng(seed)

    def normal(shape, dtype):
        return jnp.asarray((rng.standard_normal(shape) * magnitude).astype(dtype))

    return {
        "encoder": {"kernel": normal((3, 4), np.float32), "bias": normal((4,), np.float16)},
        "layers": [normal((2, 3), ml_dtypes.bfloat16), normal((), np.float32)],
        "head": (normal((5,), np.float16),),
    }


def with_bad_value(tree, position: int, bad: float):
    leaves, treedef = jax.tree_util.tree_flatten(tree)
    leaf = leaves[position]
    leaves[position] = leaf.reshape(-1).at[leaf.size // 2].set(bad).reshape(leaf.shape)
    return jax.tree_util.tree_unflatten(treedef, leaves)


DYNAMIC = amp_core.DynamicLossScale(init_scale=2.0**10)


# -- overflow detection ---------------------------------------------------------------------------


@pytest.mark.parametrize("bad", [np.inf, -np.inf, np.nan], ids=["inf", "-inf", "nan"])
@pytest.mark.parametrize("position", range(5))
def test_non_finite_value_in_any_leaf_is_an_overflow(position, bad):
    state = amp_core.init(DYNAMIC)
    grads = with_bad_value(random_tree(position), position, bad)
    _, isfinite, norm = amp_core.unscale_and_check(DYNAMIC, state, grads)
    assert not bool(isfinite)
    assert not np.isfinite(float(norm))
    result = jax.jit(functools.partial(amp_core.check_and_update, DYNAMIC))(state, grads)
    assert not bool(result.isfinite)
    assert int(result.next_state.num_skipped_steps) == 1
    assert float(result.next_state.loss_scale) == 2.0**9


def test_finite_tree_is_not_an_overflow():
    state = amp_core.init(DYNAMIC)
    grads = random_tree(0)
    _, isfinite, norm = amp_core.unscale_and_check(DYNAMIC, state, grads)
    assert bool(isfinite)
    assert np.isfinite(float(norm))


@pytest.mark.parametrize(
    ("values", "dtype"),
    [
        ([1e20], np.float32),
        ([-1e20, 1.0], np.float32),
        ([1.5e19, 1.5e19], np.float32),  # each square is finite, their sum is not
        ([1e20], ml_dtypes.bfloat16),
    ],
)
def test_finite_gradient_whose_square_overflows_float32_counts_as_overflow(values, dtype):
    """SPEC section 3: a finite |g| >= ~1.8e19 overflows the float32 sum of squares."""
    cfg = amp_core.DynamicLossScale(init_scale=1.0)
    grads = {"w": jnp.asarray(np.array(values, dtype))}
    assert np.all(np.isfinite(np.asarray(grads["w"], np.float32)))
    _, isfinite, norm = amp_core.unscale_and_check(cfg, amp_core.init(cfg), grads)
    assert not bool(isfinite)
    assert float(norm) == np.inf


def test_large_squares_split_over_leaves_also_overflow():
    cfg = amp_core.DynamicLossScale(init_scale=1.0)
    grads = [jnp.array([1.5e19], jnp.float32), jnp.array([1.5e19], jnp.float32)]
    assert not bool(amp_core.check_grads(cfg, amp_core.init(cfg), grads).isfinite)


def test_gradient_just_below_the_square_overflow_is_finite():
    cfg = amp_core.DynamicLossScale(init_scale=1.0)
    grads = {"w": jnp.array([1e19], jnp.float32)}
    check = amp_core.check_grads(cfg, amp_core.init(cfg), grads)
    assert bool(check.isfinite)
    np.testing.assert_allclose(float(check.global_norm), 1e19, rtol=1e-6)


@pytest.mark.parametrize(
    "grads", [{}, [], (), None, {"a": None}, [None, None], {"a": [], "b": {}}], ids=repr
)
@pytest.mark.parametrize("cfg", [DYNAMIC, amp_core.StaticLossScale(4.0)], ids=["dynamic", "static"])
def test_empty_gradient_tree_is_finite_with_zero_norm(cfg, grads):
    unscaled, isfinite, norm = amp_core.unscale_and_check(cfg, amp_core.init(cfg), grads)
    assert bool(isfinite)
    assert float(norm) == 0.0
    assert norm.dtype == jnp.float32
    assert jax.tree_util.tree_structure(unscaled) == jax.tree_util.tree_structure(grads)
    jitted = jax.jit(functools.partial(amp_core.check_and_update, cfg))(amp_core.init(cfg), grads)
    assert bool(jitted.isfinite)
    assert float(jitted.global_norm) == 0.0


def test_non_float_leaves_are_ignored_and_passed_through():
    cfg = amp_core.DynamicLossScale(init_scale=2.0)
    grads = {
        "w": jnp.array([6.0, 8.0], jnp.float32),
        "count": jnp.array([7, 2**30], jnp.int32),
        "mask": jnp.array([True, False]),
        "none": None,
    }
    unscaled, isfinite, norm = amp_core.unscale_and_check(cfg, amp_core.init(cfg), grads)
    assert bool(isfinite)
    assert float(norm) == 5.0  # the norm of [3, 4]: the integer leaf is not counted
    assert_bitwise_equal(unscaled["w"], np.array([3.0, 4.0], np.float32))
    assert_bitwise_equal(unscaled["count"], np.array([7, 2**30], np.int32))
    assert_bitwise_equal(unscaled["mask"], np.array([True, False]))
    assert unscaled["none"] is None


# -- unscaling ------------------------------------------------------------------------------------


@pytest.mark.parametrize("scale", [2.0**10, 3.0, 2.0**-14, 1000.0])
@pytest.mark.parametrize("mode", ["eager", "jit"])
def test_unscaled_values_match_numpy_oracle_bitwise(scale, mode):
    cfg = amp_core.DynamicLossScale(init_scale=scale, min_loss_scale=2.0**-14)
    fn = functools.partial(amp_core.unscale_and_check, cfg)
    if mode == "jit":
        fn = jax.jit(fn)
    grads = random_tree(7, magnitude=scale)
    unscaled, isfinite, norm = fn(amp_core.init(cfg), grads)
    assert bool(isfinite)
    expected = jax.tree_util.tree_map(lambda g: oracle_unscale(g, scale), grads)
    jax.tree_util.tree_map(assert_bitwise_equal, unscaled, expected)
    np.testing.assert_allclose(float(norm), oracle_norm(expected), rtol=1e-6)


@pytest.mark.parametrize("dtype", [jnp.float16, jnp.bfloat16, jnp.float32])
def test_unscaled_gradients_keep_their_dtype_and_norm_is_float32(dtype):
    grads = {"a": jnp.ones((3,), dtype) * 4, "b": [jnp.full((2, 2), 8, dtype)]}
    for fn in (amp_core.unscale_and_check, jax.jit(amp_core.unscale_and_check, static_argnums=0)):
        unscaled, isfinite, norm = fn(DYNAMIC, amp_core.init(DYNAMIC), grads)
        assert unscaled["a"].dtype == dtype
        assert unscaled["b"][0].dtype == dtype
        assert norm.dtype == jnp.float32
        assert isfinite.dtype == jnp.bool_


def test_float16_grads_under_cbfloat16_scale_are_not_flushed_to_zero():
    """The reciprocal of 2**31 is computed in float32: in float16 it would round to 0."""
    cfg = amp_core.DynamicLossScale(half_dtype="cbfloat16")
    assert float(amp_core.init(cfg).loss_scale) == 2.0**31
    grads = {"h": jnp.array([65504.0, 16384.0, 1024.0, -512.0], jnp.float16)}
    unscaled, isfinite, norm = amp_core.unscale_and_check(cfg, amp_core.init(cfg), grads)
    assert bool(isfinite)
    assert np.all(np.asarray(unscaled["h"]) != 0)
    assert_bitwise_equal(unscaled["h"], oracle_unscale(grads["h"], 2.0**31))
    assert float(norm) > 0


def test_check_grads_multiplier_is_float32_reciprocal_of_scale():
    cfg = amp_core.DynamicLossScale(init_scale=3.0)
    check = amp_core.check_grads(cfg, amp_core.init(cfg), random_tree(1))
    assert check.multiplier.dtype == jnp.float32
    assert np.asarray(check.multiplier) == np.float32(1) / np.float32(3)


def test_apply_multiplier_of_check_grads_equals_unscale_and_check():
    cfg = amp_core.DynamicLossScale(init_scale=3.0, max_gradient_norm=1.0)
    state = amp_core.init(cfg)
    grads = random_tree(2)
    check = amp_core.check_grads(cfg, state, grads)
    unscaled, isfinite, norm = amp_core.unscale_and_check(cfg, state, grads)
    jax.tree_util.tree_map(
        assert_bitwise_equal, amp_core.apply_multiplier(grads, check.multiplier), unscaled
    )
    assert bool(check.isfinite) == bool(isfinite)
    assert float(check.global_norm) == float(norm)


# -- static scaling -------------------------------------------------------------------------------


@pytest.mark.parametrize("bad", [np.inf, -np.inf, np.nan], ids=["inf", "-inf", "nan"])
def test_static_scaling_never_reports_overflow(bad):
    cfg = amp_core.StaticLossScale(1.0)
    state = amp_core.init(cfg)
    grads = with_bad_value(random_tree(3), 0, bad)
    unscaled, isfinite, _ = amp_core.unscale_and_check(cfg, state, grads)
    assert bool(isfinite)
    jax.tree_util.tree_map(assert_bitwise_equal, unscaled, grads)  # scale 1: a no-op
    result = jax.jit(functools.partial(amp_core.check_and_update, cfg))(state, grads)
    assert bool(result.isfinite)
    assert int(result.next_state.num_skipped_steps) == 0
    assert float(result.next_state.loss_scale) == 1.0


def test_static_scale_unscales_by_its_reciprocal():
    cfg = amp_core.StaticLossScale(8.0)
    grads = with_bad_value(random_tree(4, magnitude=8.0), 1, np.inf)
    unscaled, isfinite, _ = amp_core.unscale_and_check(cfg, amp_core.init(cfg), grads)
    assert bool(isfinite)
    expected = jax.tree_util.tree_map(lambda g: oracle_unscale(g, 8.0), grads)
    jax.tree_util.tree_map(assert_bitwise_equal, unscaled, expected)


def test_static_config_does_not_clip():
    cfg = amp_core.make_config(1.0, max_gradient_norm=1e-3)
    grads = {"w": jnp.array([300.0, 400.0], jnp.float32)}
    unscaled, _, _ = amp_core.unscale_and_check(cfg, amp_core.init(cfg), grads)
    assert_bitwise_equal(unscaled["w"], np.array([300.0, 400.0], np.float32))


# -- DLS + GCC ------------------------------------------------------------------------------------

GCC_SHAPES = [(7, 3), (5,), (), (2, 2, 2)]


def torch_clip(unscaled: list[np.ndarray], max_norm: float) -> tuple[list[np.ndarray], float]:
    """The oracle: ``torch.nn.utils.clip_grad_norm_`` on copies of the same numbers."""
    params = []
    for grad in unscaled:
        param = torch.nn.Parameter(torch.zeros(grad.shape, dtype=torch.float32))
        param.grad = torch.from_numpy(np.array(grad, np.float32))
        params.append(param)
    total = torch.nn.utils.clip_grad_norm_(params, max_norm)
    return [p.grad.numpy() for p in params], float(total)


@pytest.mark.parametrize(
    ("max_norm", "magnitude"),
    [(1.0, 0.01), (1.0, 10.0), (5.0, 1000.0), (0.5, 0.3), (100.0, 1e-4)],
)
@pytest.mark.parametrize("scale", [2.0**12, 1.0])
def test_gcc_matches_torch_clip_grad_norm(max_norm, magnitude, scale):
    rng = np.random.default_rng(int(magnitude * 1000) + int(max_norm))
    unscaled = [np.asarray(rng.standard_normal(s) * magnitude, np.float32) for s in GCC_SHAPES]
    scaled = [jnp.asarray(g * np.float32(scale)) for g in unscaled]  # exact: power of two
    cfg = amp_core.DynamicLossScale(init_scale=scale, max_gradient_norm=max_norm)
    clipped, isfinite, norm = jax.jit(functools.partial(amp_core.unscale_and_check, cfg))(
        amp_core.init(cfg), scaled
    )
    expected, torch_norm = torch_clip(unscaled, max_norm)
    assert bool(isfinite)
    np.testing.assert_allclose(float(norm), torch_norm, rtol=1e-6)
    for ours, theirs in zip(clipped, expected, strict=True):
        assert ours.dtype == jnp.float32
        np.testing.assert_allclose(np.asarray(ours), theirs, rtol=1e-6, atol=0)


def test_gcc_leaves_gradients_unchanged_below_max_norm():
    unscaled = [np.array([0.3, 0.4], np.float32), np.array([[0.0, -0.0]], np.float32)]
    cfg = amp_core.DynamicLossScale(init_scale=2.0**4, max_gradient_norm=1.0)
    scaled = [jnp.asarray(g * np.float32(16)) for g in unscaled]
    clipped, _, norm = amp_core.unscale_and_check(cfg, amp_core.init(cfg), scaled)
    for ours, original in zip(clipped, unscaled, strict=True):
        assert_bitwise_equal(ours, original)
    np.testing.assert_allclose(float(norm), 0.5, rtol=1e-6)


def test_gcc_global_norm_is_of_unscaled_unclipped_grads():
    unscaled = [np.array([30.0, 40.0], np.float32), np.array([0.0], np.float32)]
    cfg = amp_core.DynamicLossScale(init_scale=2.0**8, max_gradient_norm=1.0)
    scaled = [jnp.asarray(g * np.float32(256)) for g in unscaled]
    clipped, _, norm = amp_core.unscale_and_check(cfg, amp_core.init(cfg), scaled)
    assert float(norm) == 50.0  # not 50 * 256 (scaled) and not ~1 (clipped)
    np.testing.assert_allclose(oracle_norm(clipped), 1.0, rtol=1e-6)


def test_gcc_keeps_half_dtypes():
    cfg = amp_core.DynamicLossScale(init_scale=2.0**4, max_gradient_norm=0.1)
    grads = {"h": jnp.full((4,), 64.0, jnp.float16), "b": jnp.full((4,), 64.0, jnp.bfloat16)}
    clipped, _, norm = amp_core.unscale_and_check(cfg, amp_core.init(cfg), grads)
    assert clipped["h"].dtype == jnp.float16
    assert clipped["b"].dtype == jnp.bfloat16
    assert np.asarray(norm) == np.sqrt(np.float32(8 * 16.0))
    # Each clipped value is the exact one rounded to its dtype, within half an ulp: their norm is
    # within half an eps of the coarser dtype, bfloat16's 3.9e-3 (2e-3 was finer than that).
    np.testing.assert_allclose(oracle_norm(clipped), 0.1, rtol=eps(jnp.bfloat16) / 2)


@settings(max_examples=200, deadline=None)
@given(
    norm=st.floats(0.0, 3e38) | st.just(np.inf),
    max_norm=st.floats(1e-6, 1e30, allow_nan=False, allow_infinity=False),
)
def test_clip_coefficient_is_never_above_one(norm, max_norm):
    coef = float(amp_core.clip_coefficient(jnp.float32(norm), max_norm))
    assert 0.0 <= coef <= 1.0
    expected = min(np.float32(max_norm) / (np.float32(norm) + np.float32(1e-6)), np.float32(1))
    # XLA flushes float32 subnormals to zero, hence the atol of the smallest normal.
    np.testing.assert_allclose(coef, expected, rtol=1e-6, atol=np.finfo(np.float32).tiny)


@pytest.mark.parametrize("max_norm", [1e-3, 1.0, 7.5])
@pytest.mark.parametrize("magnitude", [1e-5, 1.0, 1e4])
def test_clipped_gradients_never_exceed_max_norm(max_norm, magnitude):
    cfg = amp_core.DynamicLossScale(init_scale=2.0**6, max_gradient_norm=max_norm)
    rng = np.random.default_rng(11)
    grads = [
        jnp.asarray((rng.standard_normal(s) * magnitude * 64).astype(np.float32))
        for s in GCC_SHAPES
    ]
    clipped, _, norm = amp_core.unscale_and_check(cfg, amp_core.init(cfg), grads)
    assert oracle_norm(clipped) <= max_norm * (1 + 1e-6)
    if float(norm) + 1e-6 <= max_norm:
        unclipped, _, _ = amp_core.unscale_and_check(
            amp_core.DynamicLossScale(init_scale=2.0**6), amp_core.init(cfg), grads
        )
        jax.tree_util.tree_map(assert_bitwise_equal, clipped, unclipped)


def test_gcc_multiplier_stays_finite_on_overflow():
    """On overflow the clip is not applied: a NaN norm must not turn finite zeros into NaN."""
    cfg = amp_core.DynamicLossScale(init_scale=2.0**4, max_gradient_norm=1.0)
    grads = {"w": jnp.array([0.0, np.nan, 32.0], jnp.float32), "z": jnp.zeros((2,), jnp.float32)}
    check = amp_core.check_grads(cfg, amp_core.init(cfg), grads)
    assert not bool(check.isfinite)
    assert np.asarray(check.multiplier) == np.float32(1 / 16)
    applied = amp_core.apply_multiplier(grads, check.multiplier)
    assert_bitwise_equal(applied["z"], np.zeros((2,), np.float32))
    assert np.asarray(applied["w"])[0] == 0.0


# -- helpers for callers that unscale themselves (the torch facade) -------------------------------


@pytest.mark.parametrize("scale", [2.0**-14, 3.0, 2.0**31])
def test_inverse_scale_is_float32_reciprocal(scale):
    cfg = amp_core.DynamicLossScale(init_scale=scale, max_loss_scale=2.0**31)
    inverse = amp_core.inverse_scale(amp_core.init(cfg))
    assert inverse.dtype == jnp.float32
    assert np.asarray(inverse) == np.float32(1) / np.float32(scale)


def test_check_grads_of_already_unscaled_gradients():
    """``unscaled=True``: the norm is of the gradients as given, the multiplier only clips."""
    cfg = amp_core.DynamicLossScale(init_scale=2.0**10, max_gradient_norm=1.0)
    state = amp_core.init(cfg)
    grads = {"w": jnp.array([3.0, 4.0], jnp.float32)}
    check = amp_core.check_grads(cfg, state, grads, unscaled=True)
    assert float(check.global_norm) == 5.0
    assert np.asarray(check.multiplier) == np.float32(1) / (np.float32(5) + np.float32(1e-6))
    result = amp_core.check_and_update(cfg, state, grads, unscaled=True)
    assert float(result.global_norm) == 5.0
    plain = amp_core.DynamicLossScale(init_scale=2.0**10)
    assert float(amp_core.check_grads(plain, state, grads, unscaled=True).multiplier) == 1.0


@pytest.mark.parametrize("max_gradient_norm", [None, 1.0])
@pytest.mark.parametrize("bad", [None, np.inf])
def test_fused_optimizer_args_are_scale_and_found_inf(max_gradient_norm, bad):
    cfg = amp_core.DynamicLossScale(init_scale=2.0**8, max_gradient_norm=max_gradient_norm)
    grads = [jnp.array([0.0, 256.0 * 3, 256.0 * 4 if bad is None else bad], jnp.float32)]
    check = amp_core.check_grads(cfg, amp_core.init(cfg), grads)
    grad_scale, found_inf = amp_core.fused_optimizer_args(check)
    assert grad_scale.dtype == found_inf.dtype == jnp.float32
    assert float(found_inf) == (0.0 if bad is None else 1.0)
    # Dividing by grad_scale is what the fused kernel does: the same as the multiplier.
    np.testing.assert_allclose(float(grad_scale), 1 / float(check.multiplier), rtol=1e-6)
    if bad is None and max_gradient_norm is not None:
        np.testing.assert_allclose(float(grad_scale), 256.0 * (5.0 + 1e-6), rtol=1e-6)
    else:
        assert float(grad_scale) == 256.0
    step_result = amp_core.check_and_update(cfg, amp_core.init(cfg), grads)
    _, found_inf_of_step = amp_core.fused_optimizer_args(step_result)
    assert float(found_inf_of_step) == float(found_inf)


# -- the one-read norm of float32 leaves ----------------------------------------------------------


def _exact_sum_of_unscaled_squares(leaves, inv):
    total = jnp.zeros((), jnp.float32)
    for leaf in leaves:
        total = total + jnp.sum(jnp.square(leaf * inv))
    return total


@pytest.mark.parametrize("exponent", [-31, -15, 0, 3, 14])
def test_float32_norm_read_once_equals_the_unscaled_squares_bit_for_bit(exponent):
    rng = np.random.default_rng(exponent + 40)
    leaves = [
        jnp.asarray(rng.standard_normal(shape) * 10.0 ** rng.integers(-6, 6), jnp.float32)
        for shape in [(1000,), (33, 17), (4096,)]
    ]
    inv = jnp.float32(2.0**exponent)
    ours = jax.jit(amp_core.global_norm_of_unscaled)(leaves, inv)
    exact = jax.jit(lambda g, i: jnp.sqrt(_exact_sum_of_unscaled_squares(g, i)))(leaves, inv)
    assert np.asarray(ours).tobytes() == np.asarray(exact).tobytes()


def test_scaled_values_whose_squares_overflow_still_give_the_unscaled_norm():
    # 1e20 squared overflows float32, but the unscaled value 1e20 * 2**-20 ~ 9.5e13 does not.
    grads = [jnp.array([1e20, -1e20, 3.0], jnp.float32)]
    inv = jnp.float32(2.0**-20)
    norm = float(amp_core.global_norm_of_unscaled(grads, inv))
    expected = float(np.sqrt(2.0) * np.float64(np.float32(1e20)) * 2.0**-20)
    assert np.isfinite(norm)
    np.testing.assert_allclose(norm, expected, rtol=1e-6)
    cfg = amp_core.DynamicLossScale(init_scale=2.0**20, max_loss_scale=2.0**20)
    assert bool(amp_core.check_grads(cfg, amp_core.init(cfg), grads).isfinite)


def test_norm_with_a_scale_that_is_not_a_power_of_two_is_exact_to_rounding():
    rng = np.random.default_rng(7)
    leaves = [jnp.asarray(rng.standard_normal(5000), jnp.float32)]
    inv = jnp.float32(1.0 / 3.0)
    ours = float(amp_core.global_norm_of_unscaled(leaves, inv))
    exact = float(np.sqrt(np.sum((np.asarray(leaves[0], np.float64) * float(inv)) ** 2)))
    np.testing.assert_allclose(ours, exact, rtol=1e-6)
