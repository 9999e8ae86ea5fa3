"""jit versus eager, compile-once training loops, the state pytree and ``state_dict`` round trips."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import optax
import pytest
import torch
from amp_helpers import assert_trees_bitwise_equal

import amp_core

CONFIGS = {
    "dynamic": amp_core.DynamicLossScale(
        init_scale=2.0**10, steps_per_increase=3, overflow_tolerance=0.25
    ),
    "dynamic-gcc": amp_core.DynamicLossScale(
        init_scale=3.0, steps_per_increase=2, min_loss_scale=1.0, max_gradient_norm=2.0
    ),
    "static": amp_core.StaticLossScale(loss_scale=4.0),
}


def random_tree(seed: int) -> dict:
    """A random nested gradient tree; odd seeds put an inf or NaN in one leaf."""
    rng = np.random.default_rng(seed)

    def normal(shape, dtype, magnitude=1e3):
        return np.asarray(rng.standard_normal(shape) * magnitude).astype(dtype)

    leaves = [
        normal((4, 3), np.float32),
        normal((3,), np.float16),
        normal((2, 2), ml_dtypes.bfloat16),
        normal((), np.float32),
        normal((6,), np.float32, magnitude=1e-3),
    ]
    if seed % 2:
        leaf = leaves[rng.integers(len(leaves))]
        leaf.reshape(-1)[rng.integers(max(leaf.size, 1))] = rng.choice([np.inf, -np.inf, np.nan])
    tree = {"a": {"w": leaves[0], "b": leaves[1]}, "c": [leaves[2], leaves[3]], "d": (leaves[4],)}
    return jax.tree_util.tree_map(jnp.asarray, tree)


def random_state(cfg, seed: int) -> amp_core.LossScaleState:
    rng = np.random.default_rng(seed)
    values = {"loss_scale": float(2.0 ** rng.integers(-3, 20))}
    if cfg.is_dynamic:
        values |= {
            "steps_since_rescale": int(rng.integers(0, 4)),
            "overflows_since_rescale": int(rng.integers(0, 2)),
            "num_skipped_steps": int(rng.integers(0, 100)),
        }
    return amp_core.from_state_dict(cfg, amp_core.init(cfg), values)


# -- jit versus eager -----------------------------------------------------------------------------

SEEDS = range(6)


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("name", CONFIGS)
def test_gradient_functions_are_bitwise_identical_with_and_without_jit(name, seed):
    cfg = CONFIGS[name]
    state, grads = random_state(cfg, seed), random_tree(seed)
    for fn in (amp_core.check_grads, amp_core.unscale_and_check, amp_core.check_and_update):
        eager = fn(cfg, state, grads)
        jitted = jax.jit(functools.partial(fn, cfg))(state, grads)
        assert_trees_bitwise_equal(jitted, eager)


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("name", CONFIGS)
def test_update_is_bitwise_identical_with_and_without_jit(name, seed):
    cfg = CONFIGS[name]
    state = random_state(cfg, seed)
    norm = jnp.float32(seed * 1.5)
    jitted_update = jax.jit(functools.partial(amp_core.update, cfg))
    for isfinite in (True, False):
        eager = amp_core.update(cfg, state, isfinite, norm)
        jitted = jitted_update(state, jnp.asarray(isfinite), norm)
        assert_trees_bitwise_equal(jitted, eager)


@pytest.mark.parametrize("loss", [jnp.float16(0.3), jnp.bfloat16(-7.0), jnp.float32(1e30), 2.5])
def test_scale_loss_is_bitwise_identical_with_and_without_jit(loss):
    state = random_state(CONFIGS["dynamic"], 3)
    eager = amp_core.scale_loss(state, loss)
    jitted = jax.jit(amp_core.scale_loss)(state, loss)
    assert_trees_bitwise_equal(jitted, eager)
    assert eager.dtype == jnp.float32
    assert float(eager) == np.float32(loss) * np.float32(state.loss_scale)


@pytest.mark.parametrize("isfinite", [True, False])
def test_select_if_finite_is_bitwise_identical_with_and_without_jit(isfinite):
    new, old = random_tree(0), random_tree(2)
    eager = amp_core.select_if_finite(isfinite, new, old)
    jitted = jax.jit(amp_core.select_if_finite)(jnp.asarray(isfinite), new, old)
    assert_trees_bitwise_equal(jitted, eager)
    assert_trees_bitwise_equal(eager, new if isfinite else old)


def test_select_if_finite_keeps_signed_zeros_and_nans_of_the_chosen_tree():
    old = {"w": jnp.array([-0.0, jnp.nan, 1.0], jnp.float32)}
    new = {"w": jnp.array([0.0, 2.0, jnp.inf], jnp.float32)}
    assert_trees_bitwise_equal(amp_core.select_if_finite(False, new, old), old)
    assert_trees_bitwise_equal(amp_core.select_if_finite(True, new, old), new)


def test_select_if_finite_rejects_trees_of_different_structure():
    with pytest.raises(ValueError, match="same structure"):
        amp_core.select_if_finite(True, {"a": jnp.zeros(2)}, {"b": jnp.zeros(2)})


# -- compile once ---------------------------------------------------------------------------------


def test_check_and_update_traces_once_over_many_steps():
    cfg = CONFIGS["dynamic-gcc"]
    traces = []

    @jax.jit
    def step(state, grads):
        traces.append(1)
        return amp_core.check_and_update(cfg, state, grads)

    state = amp_core.init(cfg)
    for seed in range(20):  # finite and overflowing trees of the same structure
        state = step(state, random_tree(seed)).next_state
    assert len(traces) == 1
    assert int(state.num_skipped_steps) == 10


def test_fifty_step_training_loop_traces_once_despite_overflows():
    """A float16-compute training step: overflows come from the scale and from poisoned steps."""
    cfg = amp_core.DynamicLossScale(
        init_scale=2.0**24, max_loss_scale=2.0**30, steps_per_increase=4
    )
    optimizer = optax.sgd(0.05)
    traces = []
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.standard_normal((32, 8)), jnp.float32)
    y = jnp.asarray(rng.standard_normal((32, 1)), jnp.float32)

    def loss_fn(params):
        hidden = x.astype(jnp.float16) @ params["w"].astype(jnp.float16)
        pred = hidden.astype(jnp.float32) + params["b"]
        return jnp.mean((pred - y) ** 2)

    @jax.jit
    def train_step(params, opt_state, scaler, poison):
        traces.append(1)
        grads = jax.grad(lambda p: amp_core.scale_loss(scaler, loss_fn(p)))(params)
        grads = jax.tree_util.tree_map(lambda g: g * poison, grads)
        result = amp_core.check_and_update(cfg, scaler, grads)
        grads = amp_core.apply_multiplier(grads, result.multiplier)
        updates, new_opt_state = optimizer.update(grads, opt_state, params)
        new_params = optax.apply_updates(params, updates)
        params, opt_state = amp_core.select_if_finite(
            result.isfinite, (new_params, new_opt_state), (params, opt_state)
        )
        return params, opt_state, result.next_state, loss_fn(params)

    params = {"w": jnp.zeros((8, 1), jnp.float32), "b": jnp.zeros((1,), jnp.float32)}
    opt_state, scaler = optimizer.init(params), amp_core.init(cfg)
    poisoned = {20, 21, 40}
    losses = []
    for step in range(50):
        poison = jnp.float32(jnp.inf if step in poisoned else 1.0)
        params, opt_state, scaler, loss = train_step(params, opt_state, scaler, poison)
        losses.append(float(loss))
    assert len(traces) == 1
    assert int(scaler.num_skipped_steps) > len(poisoned)  # the scale of 2**24 overflowed too
    assert all(np.isfinite(losses))
    assert losses[-1] < losses[0]


# -- the state pytree -----------------------------------------------------------------------------

DOCUMENTED_DTYPES = {
    "loss_scale": jnp.float32,
    "non_clamped_scale": jnp.float32,
    "steps_since_rescale": jnp.int32,
    "overflows_since_rescale": jnp.int32,
    "num_skipped_steps": jnp.int32,
    "isfinite": jnp.bool_,
    "global_norm": jnp.float32,
    "overflows_at_min_scale": jnp.int32,
    "absorbed_overflows": jnp.int32,
}


def states_to_check():
    for name, cfg in CONFIGS.items():
        state = amp_core.init(cfg)
        yield f"{name}-init", state
        yield f"{name}-eager-update", amp_core.update(cfg, state, False, jnp.float32(2.0))
        jitted = jax.jit(functools.partial(amp_core.check_and_update, cfg))
        yield f"{name}-jit-update", jitted(state, random_tree(1)).next_state
        yield f"{name}-loaded", amp_core.from_state_dict(cfg, state, {"loss_scale": 2})


@pytest.mark.parametrize(("label", "state"), list(states_to_check()), ids=lambda v: str(v)[:30])
def test_state_is_named_tuple_of_scalar_arrays_with_documented_dtypes(label, state):
    assert isinstance(state, amp_core.LossScaleState)
    assert isinstance(state, tuple)
    assert state._fields == tuple(DOCUMENTED_DTYPES)
    leaves = jax.tree_util.tree_leaves(state)
    assert len(leaves) == len(DOCUMENTED_DTYPES)
    for name, value in zip(state._fields, state, strict=True):
        assert isinstance(value, jax.Array), name
        assert value.shape == (), name
        assert value.dtype == DOCUMENTED_DTYPES[name], name
        assert not jax.typeof(value).weak_type, name  # a weak type would retrace the next step


def test_state_survives_pytree_round_trip():
    cfg = CONFIGS["dynamic"]
    state = random_state(cfg, 5)
    leaves, treedef = jax.tree_util.tree_flatten(state)
    rebuilt = jax.tree_util.tree_unflatten(treedef, leaves)
    assert isinstance(rebuilt, amp_core.LossScaleState)
    assert_trees_bitwise_equal(rebuilt, state)


# -- state_dict -----------------------------------------------------------------------------------


def test_dynamic_state_dict_has_the_cstorch_keys_as_python_numbers():
    cfg = CONFIGS["dynamic"]
    step = jax.jit(functools.partial(amp_core.update, cfg))
    state = amp_core.init(cfg)
    for isfinite in [True, False, True, True, False, False, True]:
        state = step(state, jnp.asarray(isfinite))
    sd = amp_core.to_state_dict(cfg, state)
    assert list(sd) == [
        "loss_scale",
        "steps_since_rescale",
        "overflows_since_rescale",
        "num_skipped_steps",
        "overflows_at_min_scale",
    ]
    assert type(sd["loss_scale"]) is float
    assert all(type(sd[k]) is int for k in list(sd)[1:])
    assert sd == {
        "loss_scale": float(state.loss_scale),
        "steps_since_rescale": int(state.steps_since_rescale),
        "overflows_since_rescale": int(state.overflows_since_rescale),
        "num_skipped_steps": 3,
        "overflows_at_min_scale": int(state.overflows_at_min_scale),
    }
    assert amp_core.state_dict_keys(cfg) == tuple(sd)


def test_static_state_dict_has_only_the_loss_scale():
    cfg = CONFIGS["static"]
    assert amp_core.to_state_dict(cfg, amp_core.init(cfg)) == {"loss_scale": 4.0}
    assert amp_core.state_dict_keys(cfg) == ("loss_scale",)


def test_state_dict_round_trip_restores_the_state():
    cfg = CONFIGS["dynamic"]
    state = random_state(cfg, 9)
    restored = amp_core.from_state_dict(cfg, amp_core.init(cfg), amp_core.to_state_dict(cfg, state))
    for name in ("loss_scale", "steps_since_rescale", "overflows_since_rescale"):
        assert_trees_bitwise_equal(getattr(restored, name), getattr(state, name))
    assert_trees_bitwise_equal(restored.num_skipped_steps, state.num_skipped_steps)
    assert float(restored.non_clamped_scale) == float(state.loss_scale)


def test_loaded_state_continues_exactly_like_the_original():
    cfg = CONFIGS["dynamic"]
    step = jax.jit(functools.partial(amp_core.update, cfg))
    original = amp_core.init(cfg)
    for isfinite in [True, False, True]:
        original = step(original, jnp.asarray(isfinite))
    loaded = amp_core.from_state_dict(
        cfg, amp_core.init(cfg), amp_core.to_state_dict(cfg, original)
    )
    for isfinite in [True, True, False, True, True, True, True]:
        original, loaded = (
            step(original, jnp.asarray(isfinite)),
            step(loaded, jnp.asarray(isfinite)),
        )
        assert amp_core.to_state_dict(cfg, loaded) == amp_core.to_state_dict(cfg, original)


def test_partial_state_dict_keeps_the_other_fields():
    cfg = CONFIGS["dynamic"]
    state = random_state(cfg, 4)
    loaded = amp_core.from_state_dict(cfg, state, {"num_skipped_steps": 7})
    assert int(loaded.num_skipped_steps) == 7
    for name in ("loss_scale", "non_clamped_scale", "steps_since_rescale"):
        assert_trees_bitwise_equal(getattr(loaded, name), getattr(state, name))
    assert_trees_bitwise_equal(amp_core.from_state_dict(cfg, state, {}), state)


@pytest.mark.parametrize(
    "value",
    [8, 8.0, np.float32(8.0), np.float64(8.0), np.int64(8), jnp.float32(8.0), torch.tensor(8.0)],
    ids=repr,
)
def test_state_dict_scale_accepts_numbers_arrays_and_tensors(value):
    cfg = CONFIGS["dynamic"]
    loaded = amp_core.from_state_dict(cfg, amp_core.init(cfg), {"loss_scale": value})
    assert loaded.loss_scale.dtype == jnp.float32
    assert float(loaded.loss_scale) == 8.0
    assert float(loaded.non_clamped_scale) == 8.0


@pytest.mark.parametrize(
    "value", [3, 3.0, np.int64(3), np.int32(3), jnp.int32(3), torch.tensor(3)], ids=repr
)
def test_state_dict_counters_accept_numbers_arrays_and_tensors(value):
    cfg = CONFIGS["dynamic"]
    loaded = amp_core.from_state_dict(
        cfg,
        amp_core.init(cfg),
        {
            "steps_since_rescale": value,
            "overflows_since_rescale": value,
            "num_skipped_steps": value,
        },
    )
    for counter in (
        loaded.steps_since_rescale,
        loaded.overflows_since_rescale,
        loaded.num_skipped_steps,
    ):
        assert counter.dtype == jnp.int32
        assert int(counter) == 3


@pytest.mark.parametrize(
    ("cfg_name", "state_dict", "error", "pattern"),
    [
        ("dynamic", {"loss_scale": 0.0}, ValueError, "loss_scale"),
        ("dynamic", {"loss_scale": -2.0}, ValueError, r"loss_scale.*-2\.0"),
        ("dynamic", {"loss_scale": float("inf")}, ValueError, "loss_scale"),
        ("dynamic", {"loss_scale": float("nan")}, ValueError, "loss_scale"),
        ("dynamic", {"loss_scale": "8"}, TypeError, "loss_scale"),
        ("dynamic", {"loss_scale": None}, TypeError, "loss_scale"),
        ("dynamic", {"loss_scale": True}, TypeError, "loss_scale"),
        ("dynamic", {"loss_scale": torch.ones(2)}, TypeError, "loss_scale"),
        ("dynamic", {"steps_since_rescale": -1}, ValueError, r"steps_since_rescale.*-1"),
        ("dynamic", {"overflows_since_rescale": 1.5}, ValueError, "overflows_since_rescale"),
        ("dynamic", {"num_skipped_steps": 2**40}, ValueError, "num_skipped_steps"),
        ("dynamic", {"num_skipped_steps": float("nan")}, ValueError, "num_skipped_steps"),
        ("dynamic", {"scale": 8.0}, ValueError, "scale"),
        ("static", {"steps_since_rescale": 1}, ValueError, "steps_since_rescale"),
        ("dynamic", [("loss_scale", 8.0)], TypeError, "mapping"),
    ],
)
def test_bad_state_dict_is_rejected_with_a_clear_error(cfg_name, state_dict, error, pattern):
    cfg = CONFIGS[cfg_name]
    with pytest.raises(error, match=pattern):
        amp_core.from_state_dict(cfg, amp_core.init(cfg), state_dict)
