"""flax linen: ``amp_core.flax_linen.LossScaledTrainState``, and the migration from ``DynamicScale``.

A float16 linen model (float32 master weights) trained from a loss scale of 2^24. Oracles:
flax's own ``DynamicScale`` recipe (a ``jnp.where`` skip over params and opt_state) step for
step, the bits of params and optimizer state, and counts of applied steps made from the bits.
"""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax.training import train_state
from flax.training.dynamic_scale import DynamicScale

import amp_core
from amp_core.flax_linen import LossScaledTrainState

# optax's adam computes ``decay ** count`` (a float to an int32 power), which strict dtype
# promotion rejects; see tests/conftest.py.
DTYPE_PROMOTION = "standard"

FLOAT32_MAX = float(np.finfo(np.float32).max)
GROWTH_INTERVAL = 3
STEPS = 30
X = jax.random.normal(jax.random.key(0), (32, 4), jnp.float32)
Y = jnp.ones((32, 1), jnp.float32)


class Float16MLP(nn.Module):
    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        x = nn.Dense(16, dtype=jnp.float16, param_dtype=jnp.float32)(x)
        return nn.Dense(1, dtype=jnp.float16, param_dtype=jnp.float32)(jnp.tanh(x))


MODEL = Float16MLP()
PARAMS = MODEL.init(jax.random.key(1), X)["params"]


def loss_fn(params, x=X, y=Y) -> jax.Array:
    return jnp.mean((MODEL.apply({"params": params}, x).astype(jnp.float32) - y) ** 2)


def bits(tree) -> list[bytes]:
    return [np.array(leaf).tobytes() for leaf in jax.tree_util.tree_leaves(tree)]


def migrated_config(dynamic_scale: DynamicScale) -> amp_core.DynamicLossScale:
    """docs/jax/flax-linen.md's mapping of ``DynamicScale``'s arguments (growth 2, backoff 0.5)."""
    return amp_core.DynamicLossScale(
        init_scale=float(dynamic_scale.scale),
        steps_per_increase=dynamic_scale.growth_interval,
        min_loss_scale=max(dynamic_scale.minimum_scale, 2.0**-14),
        max_loss_scale=FLOAT32_MAX,
    )


def our_step(traces: list[int]):
    @jax.jit
    def step(state: LossScaledTrainState, factor: jax.Array) -> LossScaledTrainState:
        traces.append(1)
        grads = jax.grad(lambda p: state.scale_loss(loss_fn(p, X * factor)))(state.params)
        return state.apply_gradients(grads=grads)

    return step


@jax.jit
def migrated_step(state: LossScaledTrainState) -> LossScaledTrainState:
    """The migrated recipe: the same loss as :func:`dynamic_scale_step`, scaled by the state."""
    grads = jax.grad(lambda p: state.scale_loss(loss_fn(p)))(state.params)
    return state.apply_gradients(grads=grads)


@jax.jit
def dynamic_scale_step(state: train_state.TrainState, dynamic_scale: DynamicScale):
    """flax's recipe: DynamicScale.value_and_grad, then a hand-written skip."""
    dynamic_scale, is_finite, _, grads = dynamic_scale.value_and_grad(loss_fn)(state.params)
    new_state = state.apply_gradients(grads=grads)
    keep = jax.tree_util.tree_map
    new_state = new_state.replace(
        params=keep(lambda n, o: jnp.where(is_finite, n, o), new_state.params, state.params),
        opt_state=keep(
            lambda n, o: jnp.where(is_finite, n, o), new_state.opt_state, state.opt_state
        ),
    )
    return new_state, dynamic_scale, is_finite


def test_train_state_trains_float16_skipping_bit_identically_and_counts_applied_steps():
    config = amp_core.DynamicLossScale(
        init_scale=2.0**24, max_loss_scale=2.0**24, steps_per_increase=GROWTH_INTERVAL
    )
    state = LossScaledTrainState.create(
        apply_fn=MODEL.apply, params=PARAMS, tx=optax.adam(1e-2), config=config
    )
    traces: list[int] = []
    step_fn = our_step(traces)
    applied = 0
    for step in range(STEPS):
        factor = jnp.float32(np.inf) if step == 20 else jnp.float32(1.0)
        before = state
        state = step_fn(state, factor)
        if bits(state.params) == bits(before.params):
            assert bits(state.opt_state.inner_state) == bits(before.opt_state.inner_state)
            assert not bool(state.scaler.isfinite)
        else:
            applied += 1
            assert bool(state.scaler.isfinite)
        assert int(state.step) == applied
    assert len(traces) == 1
    skipped = int(state.scaler.num_skipped_steps)
    assert skipped >= 4 and applied + skipped == STEPS
    assert int(state.opt_state.inner_state[0].count) == applied  # what optax schedules read
    assert state.step.dtype == jnp.int32
    assert amp_core.scaler_metrics(state)["num_skipped_steps"] == skipped
    assert f"{state.scaler.loss_scale:.1f}" == f"{float(state.scaler.loss_scale):.1f}"


@pytest.mark.parametrize(
    ("tx", "rtol"),
    [(optax.sgd(0.05), 1e-6), (optax.adam(1e-2), 1e-4)],
    ids=["sgd", "adam"],
)
def test_migration_from_dynamic_scale_takes_the_same_steps(tx, rtol):
    """Scale, counters and skip decisions equal flax's DynamicScale recipe at every step.

    The unscaled gradients are the same (a power-of-two scale divides exactly), but the two
    train steps are different XLA programs (they skip differently), whose fusions may round the
    optimizer's arithmetic differently in the last bit: the parameters agree to rounding (SGD:
    an ulp now and then).
    """
    dynamic_scale = DynamicScale(growth_interval=GROWTH_INTERVAL, scale=2.0**24)
    reference = train_state.TrainState.create(apply_fn=MODEL.apply, params=PARAMS, tx=tx)
    state = LossScaledTrainState.create(
        apply_fn=MODEL.apply, params=PARAMS, tx=tx, config=migrated_config(dynamic_scale)
    )
    finite_steps = 0
    for _ in range(STEPS):
        reference, dynamic_scale, is_finite = dynamic_scale_step(reference, dynamic_scale)
        state = migrated_step(state)
        scaler = state.scaler
        assert bool(scaler.isfinite) == bool(is_finite)
        assert float(scaler.loss_scale) == float(dynamic_scale.scale)
        assert int(scaler.steps_since_rescale) == int(dynamic_scale.fin_steps)
        finite_steps += bool(is_finite)
        for ours, theirs in zip(
            jax.tree_util.tree_leaves(state.params),
            jax.tree_util.tree_leaves(reference.params),
            strict=True,
        ):
            np.testing.assert_allclose(np.asarray(ours), np.asarray(theirs), rtol=rtol)
    assert 5 < finite_steps < STEPS - 5  # the run saw an overflow episode and grew again
    assert int(state.step) == finite_steps  # flax's TrainState counted every step
    assert int(reference.step) == STEPS
    assert int(state.scaler.num_skipped_steps) == STEPS - finite_steps


def test_create_rejects_a_config_that_is_not_one():
    with pytest.raises(TypeError, match=r"config must be an amp_core\.DynamicLossScale.*float"):
        LossScaledTrainState.create(
            apply_fn=MODEL.apply, params=PARAMS, tx=optax.sgd(0.1), config=2.0**15
        )


def test_static_scaling_counts_every_step():
    config = amp_core.StaticLossScale(loss_scale=4.0)
    state = LossScaledTrainState.create(
        apply_fn=MODEL.apply, params=PARAMS, tx=optax.sgd(0.01), config=config
    )
    step_fn = our_step([])
    for _ in range(3):
        state = step_fn(state, jnp.float32(1.0))
    assert int(state.step) == 3
    assert float(state.scale_loss(jnp.float16(0.5))) == 2.0
    assert state.config == config


def test_the_train_state_itself_passes_strict_dtype_promotion():
    """The module runs under standard promotion for adam; the train state's own code is strict."""
    config = amp_core.DynamicLossScale(init_scale=2.0**24, max_loss_scale=2.0**24)
    with jax.numpy_dtype_promotion("strict"):
        state = LossScaledTrainState.create(
            apply_fn=MODEL.apply, params=PARAMS, tx=optax.sgd(0.1), config=config
        )
        step_fn = our_step([])
        for _ in range(3):
            state = step_fn(state, jnp.float32(1.0))
        skipped = amp_core.scaler_metrics(state)["num_skipped_steps"]
    assert int(state.step) + skipped == 3
