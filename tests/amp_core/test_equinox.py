"""equinox: whole models through ``value_and_grad``, ``apply_scaled_gradients`` and the optax wrapper.

An ``eqx.nn.MLP`` (its activation functions are non-array leaves) computing in float16, trained
from a loss scale of 2^24. Oracles: ``eqx.filter_value_and_grad`` of the unscaled loss,
``eqx.apply_updates``, the bits of the model and optimizer state on skipped steps, a trace
counter inside ``eqx.filter_jit``.
"""

from __future__ import annotations

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import amp_core

# optax's adam computes ``decay ** count`` (a float to an int32 power), which strict dtype
# promotion rejects; see tests/conftest.py.
DTYPE_PROMOTION = "standard"

CONFIG = amp_core.DynamicLossScale(init_scale=2.0**24, max_loss_scale=2.0**24, steps_per_increase=3)
STEPS = 20
X = jax.random.normal(jax.random.key(0), (32, 4), jnp.float32)
Y = jnp.ones((32, 1), jnp.float32)


def make_model() -> eqx.nn.MLP:
    return eqx.nn.MLP(4, 1, 16, 2, activation=jax.nn.tanh, key=jax.random.key(1))


def float16_loss(model: eqx.nn.MLP, x: jax.Array, y: jax.Array) -> jax.Array:
    """float16 compute, float32 master weights: cast the arrays, keep the other leaves."""
    half = jax.tree_util.tree_map(
        lambda leaf: leaf.astype(jnp.float16) if eqx.is_inexact_array(leaf) else leaf, model
    )
    pred = jax.vmap(half)(x.astype(jnp.float16))
    return jnp.mean((pred.astype(jnp.float32) - y) ** 2)


def bits(tree) -> list[bytes]:
    return [
        np.array(leaf).tobytes()
        for leaf in jax.tree_util.tree_leaves(eqx.filter(tree, eqx.is_array))
    ]


def test_value_and_grad_takes_a_whole_equinox_model():
    model = make_model()
    state = amp_core.init(CONFIG)._replace(loss_scale=jnp.float32(2.0**10))
    # Both sides run eagerly: XLA may keep fused float16 intermediates in float32 under jit,
    # so float16 results are comparable bit for bit only within one kind of execution.
    grad_fn = amp_core.value_and_grad(float16_loss, CONFIG)
    value, grads, isfinite, norm = grad_fn(state, model, X, Y)
    # The oracle: equinox differentiates the scaled loss; unscaling by a power of two is exact.
    expected_value, scaled = eqx.filter_value_and_grad(
        lambda m: amp_core.scale_loss(state, float16_loss(m, X, Y))
    )(model)
    assert bool(isfinite)
    assert float(value) * 2.0**10 == float(expected_value)
    assert grads.activation is None and grads.final_activation is None
    assert jax.tree_util.tree_structure(grads) == jax.tree_util.tree_structure(scaled)
    for ours, theirs in zip(
        jax.tree_util.tree_leaves(grads), jax.tree_util.tree_leaves(scaled), strict=True
    ):
        np.testing.assert_array_equal(np.asarray(ours), np.asarray(theirs) / np.float32(2.0**10))
    flat = np.concatenate([np.ravel(g) for g in jax.tree_util.tree_leaves(grads)])
    np.testing.assert_allclose(float(norm), np.linalg.norm(flat.astype(np.float64)), rtol=1e-5)


def test_value_and_grad_passes_non_array_leaves_and_integer_arrays_through():
    cfg = amp_core.DynamicLossScale(init_scale=4.0)
    tree = {"w": jnp.array([1.0, 2.0]), "n": jnp.array(3, jnp.int32), "act": jnp.square, "k": 0.5}

    def fun(t, scale):
        return jnp.sum(t["act"](t["w"])) * t["k"] * t["n"].astype(jnp.float32) * scale

    _, grads, isfinite, _ = amp_core.value_and_grad(fun, cfg, argnums=(0, 1))(
        amp_core.init(cfg), tree, 2.0
    )
    tree_grads, scale_grad = grads
    assert bool(isfinite)
    np.testing.assert_array_equal(np.asarray(tree_grads["w"]), [6.0, 12.0])
    assert tree_grads["n"] is None and tree_grads["act"] is None and tree_grads["k"] is None
    assert scale_grad is None  # a Python number is not differentiated, as in equinox


def test_value_and_grad_rejects_argnums_beyond_the_arguments():
    grad_fn = amp_core.value_and_grad(lambda w: jnp.sum(w), CONFIG, argnums=1)
    with pytest.raises(ValueError, match=r"argnums=1 names positional argument 1"):
        grad_fn(amp_core.init(CONFIG), jnp.ones(2))


def test_apply_scaled_gradients_trains_a_whole_model_skipping_bit_identically():
    inner = optax.adam(1e-2)
    model = make_model()
    opt_state = amp_core.with_loss_scaling(inner, CONFIG).init(
        eqx.filter(model, eqx.is_inexact_array)
    )
    traces: list[int] = []

    @eqx.filter_jit
    def train_step(model, opt_state, factor):
        traces.append(1)
        scaler = amp_core.loss_scale_state(opt_state)
        grads = eqx.filter_grad(
            lambda m: amp_core.scale_loss(scaler, float16_loss(m, X * factor, Y))
        )(model)
        return amp_core.apply_scaled_gradients(inner, CONFIG, grads, opt_state, model)

    applied = 0
    for step in range(STEPS):
        factor = jnp.float32(np.nan) if step == 15 else jnp.float32(1.0)
        before, inner_before = bits(model), bits(opt_state.inner_state)
        model, opt_state = train_step(model, opt_state, factor)
        assert model.activation is jax.nn.tanh  # non-array leaves pass through
        if bits(model) == before:
            assert bits(opt_state.inner_state) == inner_before
        else:
            applied += 1
    assert len(traces) == 1
    skipped = int(amp_core.loss_scale_state(opt_state).num_skipped_steps)
    assert skipped >= 4 and applied + skipped == STEPS
    assert int(opt_state.inner_state[0].count) == applied


def test_apply_scaled_gradients_equals_the_wrapper_with_eqx_apply_updates():
    inner = optax.sgd(0.05, momentum=0.9)
    tx = amp_core.with_loss_scaling(inner, CONFIG)
    fused = wrapped = make_model()
    fused_state = wrapped_state = tx.init(eqx.filter(wrapped, eqx.is_inexact_array))

    def scaled_grads(model, opt_state):
        scaler = amp_core.loss_scale_state(opt_state)
        return eqx.filter_grad(lambda m: amp_core.scale_loss(scaler, float16_loss(m, X, Y)))(model)

    @eqx.filter_jit
    def fused_step(model, opt_state):
        grads = scaled_grads(model, opt_state)
        return amp_core.apply_scaled_gradients(inner, CONFIG, grads, opt_state, model)

    @eqx.filter_jit
    def wrapper_step(model, opt_state):  # the recipe of docs/jax/equinox.md
        grads = scaled_grads(model, opt_state)
        params = eqx.filter(model, eqx.is_inexact_array)
        updates, opt_state = tx.update(grads, opt_state, params)
        return eqx.apply_updates(model, updates), opt_state

    for _ in range(12):
        fused, fused_state = fused_step(fused, fused_state)
        wrapped, wrapped_state = wrapper_step(wrapped, wrapped_state)
        ours, theirs = (
            amp_core.loss_scale_state(fused_state),
            amp_core.loss_scale_state(wrapped_state),
        )
        assert bool(ours.isfinite) == bool(theirs.isfinite)
        assert float(ours.loss_scale) == float(theirs.loss_scale)
    for a, b in zip(
        jax.tree_util.tree_leaves(eqx.filter(fused, eqx.is_array)),
        jax.tree_util.tree_leaves(eqx.filter(wrapped, eqx.is_array)),
        strict=True,
    ):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-7)
    assert int(amp_core.loss_scale_state(fused_state).num_skipped_steps) >= 4


def test_apply_scaled_gradients_names_params_whose_structure_is_not_that_of_grads():
    inner = optax.sgd(0.1)
    params = {"w": jnp.ones(2)}
    opt_state = amp_core.with_loss_scaling(inner, CONFIG).init(params)
    with pytest.raises(ValueError, match="params must have the structure of grads"):
        amp_core.apply_scaled_gradients(
            inner, CONFIG, {"w": jnp.ones(2), "b": jnp.ones(1)}, opt_state, params
        )
