"""flax NNX: ``nnx.Optimizer`` over ``with_loss_scaling`` and ``amp_core.flax_nnx.LossScaledOptimizer``.

A float16 model (float32 master weights) trained from a loss scale of 2^24, so the first steps
overflow in the float16 backward pass, plus NaN inputs injected on chosen steps. Oracles: the
bits of the parameters and optimizer state (a step was applied exactly when the parameters
changed), counts of those steps made by hand from the bits, a trace counter inside the jitted
step, and ``amp_core.scale_loss`` itself.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import amp_core
from amp_core.flax_nnx import LossScaledOptimizer

# optax's adam computes ``decay ** count`` (a float to an int32 power), which strict dtype
# promotion rejects; see tests/conftest.py.
DTYPE_PROMOTION = "standard"

CONFIG = amp_core.DynamicLossScale(
    init_scale=2.0**24, max_loss_scale=2.0**24, steps_per_increase=3, half_dtype="float16"
)
STEPS = 24
POISONED = (14, 19)  # NaN inputs on these steps, after the scale has come down
X = jax.random.normal(jax.random.key(0), (32, 4), jnp.float32)
Y = jnp.ones((32, 1), jnp.float32)


class Float16MLP(nnx.Module):
    """Computes in float16, keeps float32 parameters."""

    def __init__(self, rngs: nnx.Rngs) -> None:
        self.hidden = nnx.Linear(4, 16, dtype=jnp.float16, param_dtype=jnp.float32, rngs=rngs)
        self.out = nnx.Linear(16, 1, dtype=jnp.float16, param_dtype=jnp.float32, rngs=rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        return self.out(jnp.tanh(self.hidden(x)))


def loss_fn(model: Float16MLP, x: jax.Array, y: jax.Array) -> jax.Array:
    return jnp.mean((model(x).astype(jnp.float32) - y) ** 2)


def bits(tree) -> list[bytes]:
    """The exact bytes of every leaf (Variables unwrapped), copied off the device."""
    return [np.array(leaf).tobytes() for leaf in jax.tree_util.tree_leaves(tree)]


def poison(step: int) -> jax.Array:
    return jnp.float32(np.nan) if step in POISONED else jnp.float32(1.0)


def make_train_step(traces: list[int]):
    @nnx.jit
    def train_step(model, optimizer, x, y, factor):
        traces.append(1)

        def scaled_loss(m):
            loss = loss_fn(m, x * factor, y)
            return optimizer.scale_loss(loss), loss

        grads, loss = nnx.grad(scaled_loss, has_aux=True)(model)
        return loss, optimizer.update(model, grads)

    return train_step


def test_loss_scale_state_of_a_plain_nnx_optimizer_reads_as_python_numbers():
    model = Float16MLP(nnx.Rngs(0))
    tx = amp_core.with_loss_scaling(optax.adam(1e-2), CONFIG)
    optimizer = nnx.Optimizer(model, tx, wrt=nnx.Param)
    for source in (optimizer, optimizer.opt_state, nnx.state(optimizer)):
        scaler = amp_core.loss_scale_state(source)
        assert all(isinstance(field, jax.Array) for field in scaler)
        assert bool(scaler.isfinite) is True
        assert f"{scaler.loss_scale:.1f}" == "16777216.0"
        assert float(scaler.global_norm) == 0.0
        assert int(scaler.num_skipped_steps) == 0
        assert bool(amp_core.is_stalled(CONFIG, scaler)) is False
        assert amp_core.scaler_metrics(source) == {
            "loss_scale": 2.0**24,
            "num_skipped_steps": 0,
            "global_norm": 0.0,
            "isfinite": True,
        }


def test_loss_scaled_optimizer_trains_float16_skipping_bit_identically_with_one_trace():
    model = Float16MLP(nnx.Rngs(0))
    optimizer = LossScaledOptimizer(model, optax.adam(1e-2), CONFIG, wrt=nnx.Param)
    traces: list[int] = []
    train_step = make_train_step(traces)
    changed, flags = [], []
    for step in range(STEPS):
        params_before = bits(nnx.state(model, nnx.Param))
        inner_before = bits(optimizer.opt_state.inner_state)
        step_before = int(optimizer.step)
        _, isfinite = train_step(model, optimizer, X, Y, poison(step))
        params_changed = bits(nnx.state(model, nnx.Param)) != params_before
        changed.append(params_changed)
        flags.append(bool(isfinite))
        if not params_changed:  # a skipped step: optimizer state and step counter kept too
            assert bits(optimizer.opt_state.inner_state) == inner_before
            assert int(optimizer.step) == step_before
        else:
            assert int(optimizer.step) == step_before + 1
    assert len(traces) == 1
    assert flags == changed  # update's isfinite says exactly which steps were applied
    assert not any(changed[:3]) and not any(changed[s] for s in POISONED)
    applied = sum(changed)
    assert 5 <= applied < STEPS - 3
    scaler = optimizer.scaler
    assert int(optimizer.step) == applied
    assert int(scaler.num_skipped_steps) == STEPS - applied
    assert isinstance(optimizer.step[...], jax.Array)
    assert optimizer.step[...].dtype == jnp.uint32
    # The inner optimizer's own count (what optax schedules read) agrees with step.
    assert int(optimizer.opt_state.inner_state[0].count[...]) == applied
    metrics = amp_core.scaler_metrics(optimizer)
    assert metrics["num_skipped_steps"] == STEPS - applied
    assert metrics["loss_scale"] == float(scaler.loss_scale)
    assert isinstance(metrics["isfinite"], bool) and isinstance(metrics["global_norm"], float)


def test_a_plain_nnx_optimizer_counts_every_step_the_loss_scaled_one_only_applied_ones():
    """The difference the wrapper makes: both take the same decisions, only ``step`` differs."""
    plain_model, model = Float16MLP(nnx.Rngs(0)), Float16MLP(nnx.Rngs(0))
    plain = nnx.Optimizer(
        plain_model, amp_core.with_loss_scaling(optax.sgd(0.1), CONFIG), wrt=nnx.Param
    )
    scaled = LossScaledOptimizer(model, optax.sgd(0.1), CONFIG, wrt=nnx.Param)

    @nnx.jit
    def plain_step(model, optimizer, x, y):
        scaler = amp_core.loss_scale_state(optimizer)
        grads = nnx.grad(lambda m: amp_core.scale_loss(scaler, loss_fn(m, x, y)))(model)
        optimizer.update(model, grads)

    train_step = make_train_step([])
    for _ in range(8):
        plain_step(plain_model, plain, X, Y)
        train_step(model, scaled, X, Y, jnp.float32(1.0))
        assert bits(nnx.state(plain_model)) == bits(nnx.state(model))
    skipped = int(scaled.scaler.num_skipped_steps)
    assert skipped >= 3
    assert int(plain.step) == 8
    assert int(scaled.step) == 8 - skipped


def test_scale_loss_and_scaler_are_those_of_amp_core():
    model = Float16MLP(nnx.Rngs(0))
    optimizer = LossScaledOptimizer(model, optax.sgd(0.1), CONFIG, wrt=nnx.Param)
    scaler = optimizer.scaler
    assert amp_core.to_state_dict(CONFIG, scaler) == amp_core.to_state_dict(
        CONFIG, amp_core.init(CONFIG)
    )
    loss = jnp.float16(0.75)
    assert float(optimizer.scale_loss(loss)) == float(amp_core.scale_loss(scaler, loss))
    assert optimizer.config == CONFIG


def test_static_scaling_applies_every_step():
    config = amp_core.StaticLossScale(loss_scale=8.0)
    model = Float16MLP(nnx.Rngs(0))
    optimizer = LossScaledOptimizer(model, optax.sgd(0.01), config, wrt=nnx.Param)
    train_step = make_train_step([])
    for step in range(4):
        _, isfinite = train_step(model, optimizer, X, Y, poison(14 if step == 2 else 0))
        assert bool(isfinite)
    assert int(optimizer.step) == 4
    assert int(optimizer.scaler.num_skipped_steps) == 0


def test_loss_scaled_optimizer_rejects_a_config_that_is_not_one():
    model = Float16MLP(nnx.Rngs(0))
    with pytest.raises(TypeError, match=r"config must be an amp_core\.DynamicLossScale.*dict"):
        LossScaledOptimizer(model, optax.sgd(0.1), {"init_scale": 2.0}, wrt=nnx.Param)
    with pytest.raises(TypeError, match=r"inner must be an optax\.GradientTransformation"):
        LossScaledOptimizer(model, "sgd", CONFIG, wrt=nnx.Param)


def test_scaler_metrics_inside_nnx_jit_needs_as_arrays():
    model = Float16MLP(nnx.Rngs(0))
    optimizer = LossScaledOptimizer(model, optax.sgd(0.1), CONFIG, wrt=nnx.Param)

    @nnx.jit
    def metrics(optimizer):
        return amp_core.scaler_metrics(optimizer, as_arrays=True)

    values = metrics(optimizer)
    assert set(values) == {"loss_scale", "num_skipped_steps", "global_norm", "isfinite"}
    assert float(values["loss_scale"]) == 2.0**24

    @nnx.jit
    def host_metrics(optimizer):
        return amp_core.scaler_metrics(optimizer)

    with pytest.raises(TypeError, match="as_arrays=True"):
        host_metrics(optimizer)


def test_the_optimizer_itself_passes_strict_dtype_promotion():
    """The module runs under standard promotion for adam; the wrapper's own code is strict."""
    model = Float16MLP(nnx.Rngs(0))
    optimizer = LossScaledOptimizer(model, optax.sgd(0.1), CONFIG, wrt=nnx.Param)
    with jax.numpy_dtype_promotion("strict"):
        train_step = make_train_step([])
        for _ in range(3):
            train_step(model, optimizer, X, Y, jnp.float32(1.0))
        metrics = amp_core.scaler_metrics(optimizer)
    assert int(optimizer.step) + metrics["num_skipped_steps"] == 3
