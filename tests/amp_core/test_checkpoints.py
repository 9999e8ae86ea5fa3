"""Reading the scaler back: optax's accessors, ``scaler_metrics``, and checkpoint round trips.

Checkpoints of every stack (orbax over optax states, ``nnx.state`` of an NNX optimizer, flax's
msgpack of a linen ``TrainState``, ``eqx.tree_serialise_leaves``) are saved mid-run, after an
overflow episode, and restored. Oracles: the run that was not interrupted (the restored one
continues bit for bit), ``amp_core.to_state_dict`` of the saved scaler, and the values that
``optax.tree_utils.tree_get`` and ``scaler_metrics`` must find, read from the state's fields.
"""

from __future__ import annotations

from pathlib import Path

import equinox as eqx
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp
import pytest
from flax import nnx, serialization

import amp_core
from amp_core.flax_linen import LossScaledTrainState
from amp_core.flax_nnx import LossScaledOptimizer

# optax's adam computes ``decay ** count`` (a float to an int32 power), which strict dtype
# promotion rejects; see tests/conftest.py.
DTYPE_PROMOTION = "standard"

CONFIG = amp_core.DynamicLossScale(init_scale=2.0**24, max_loss_scale=2.0**24, steps_per_increase=3)
X = jax.random.normal(jax.random.key(0), (32, 4), jnp.float32)
Y = jnp.ones((32, 1), jnp.float32)
BEFORE, AFTER = 12, 6  # steps before the checkpoint (an overflow episode), steps after


def bits(tree) -> list[bytes]:
    return [np.array(leaf).tobytes() for leaf in jax.tree_util.tree_leaves(tree)]


def float16_mse(pred: jax.Array) -> jax.Array:
    return jnp.mean((pred.astype(jnp.float32) - Y) ** 2)


# -- optax: pure params, optax.tree_utils, orbax --------------------------------------------------


def init_params() -> dict[str, jax.Array]:
    key1, key2 = jax.random.split(jax.random.key(1))
    return {
        "w1": jax.random.normal(key1, (4, 16)) * 0.5,
        "b1": jnp.zeros((16,)),
        "w2": jax.random.normal(key2, (16, 1)) * 0.5,
    }


def optax_loss(params: dict[str, jax.Array]) -> jax.Array:
    half = {k: v.astype(jnp.float16) for k, v in params.items()}
    hidden = jnp.tanh(X.astype(jnp.float16) @ half["w1"] + half["b1"])
    return float16_mse(hidden @ half["w2"])


TX = amp_core.with_loss_scaling(optax.adam(1e-2), CONFIG)


@jax.jit
def optax_step(params, opt_state):
    scaler = amp_core.loss_scale_state(opt_state)
    grads = jax.grad(lambda p: amp_core.scale_loss(scaler, optax_loss(p)))(params)
    updates, opt_state = TX.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state


def trained_optax(steps: int = BEFORE):
    params = init_params()
    opt_state = TX.init(params)
    for _ in range(steps):
        params, opt_state = optax_step(params, opt_state)
    return params, opt_state


def test_optax_tree_get_finds_the_current_scale_and_the_counters():
    params, opt_state = trained_optax()
    tx = optax.chain(TX, optax.clip(10.0))  # nested, as optax users build optimizers
    chained = tx.init(params)
    scaler = amp_core.loss_scale_state(opt_state)
    assert int(scaler.num_skipped_steps) >= 3  # the run overflowed
    get = optax.tree_utils.tree_get
    assert float(get(opt_state, "loss_scale")) == float(scaler.loss_scale)
    assert int(get(opt_state, "num_skipped_steps")) == int(scaler.num_skipped_steps)
    assert bool(get(opt_state, "isfinite")) == bool(scaler.isfinite)
    assert get(opt_state, "scaler") is scaler
    assert float(get(chained, "loss_scale")) == 2.0**24


def test_scaler_metrics_gives_the_same_python_numbers_from_every_kind_of_state():
    params, opt_state = trained_optax()
    scaler = amp_core.loss_scale_state(opt_state)
    expected = {
        "loss_scale": float(scaler.loss_scale),
        "num_skipped_steps": int(scaler.num_skipped_steps),
        "global_norm": float(scaler.global_norm),
        "isfinite": bool(scaler.isfinite),
    }
    host = jax.device_get(opt_state)
    for source in (opt_state, scaler, (params, opt_state), host, serialization.to_state_dict(host)):
        metrics = amp_core.scaler_metrics(source)
        assert metrics == expected
        assert [type(v) for v in metrics.values()] == [float, int, float, bool]
    arrays = jax.jit(lambda s: amp_core.scaler_metrics(s, as_arrays=True))(opt_state)
    assert {k: v.item() for k, v in arrays.items()} == expected


def test_orbax_round_trip_with_a_target_continues_bit_for_bit(tmp_path: Path):
    params, opt_state = trained_optax()
    checkpointer = ocp.StandardCheckpointer()
    checkpointer.save(tmp_path / "ckpt", {"params": params, "opt_state": opt_state})
    checkpointer.wait_until_finished()
    target = {"params": init_params(), "opt_state": TX.init(init_params())}
    restored = checkpointer.restore(tmp_path / "ckpt", target)
    assert isinstance(restored["opt_state"], amp_core.LossScaledState)
    assert bits(restored) == bits({"params": params, "opt_state": opt_state})
    resumed = (restored["params"], restored["opt_state"])
    uninterrupted = (params, opt_state)
    for _ in range(AFTER):
        resumed = optax_step(*resumed)
        uninterrupted = optax_step(*uninterrupted)
    assert bits(resumed) == bits(uninterrupted)


def test_orbax_restore_without_a_target_finds_the_scaler_or_says_how_to_restore(tmp_path: Path):
    params, opt_state = trained_optax()
    checkpointer = ocp.StandardCheckpointer()
    checkpointer.save(tmp_path / "ckpt", {"params": params, "opt_state": opt_state})
    checkpointer.wait_until_finished()
    restored = checkpointer.restore(tmp_path / "ckpt")  # no target: plain dicts and lists
    assert isinstance(restored["opt_state"], dict)
    scaler = amp_core.loss_scale_state(restored)
    assert amp_core.to_state_dict(CONFIG, scaler) == amp_core.to_state_dict(
        CONFIG, amp_core.loss_scale_state(opt_state)
    )
    assert amp_core.scaler_metrics(restored) == amp_core.scaler_metrics(opt_state)
    # It cannot train from plain dicts; the error says how to restore.
    grads = jax.tree_util.tree_map(jnp.zeros_like, params)
    with pytest.raises(TypeError, match=r"state must be the LossScaledState.*with a target"):
        TX.update(grads, restored["opt_state"], params)
    with pytest.raises(TypeError, match=r"opt_state must be the LossScaledState.*from_state_dict"):
        amp_core.apply_scaled_gradients(
            optax.adam(1e-2), CONFIG, grads, restored["opt_state"], params
        )


def test_a_checkpoint_from_before_the_rename_is_read_without_a_target():
    """Saved when the outer field was still called ``loss_scale``: the scaler is found as is."""
    _, opt_state = trained_optax()
    saved = serialization.to_state_dict(jax.device_get(opt_state))
    old = {"loss_scale": saved["scaler"], "inner_state": saved["inner_state"]}
    assert amp_core.scaler_metrics({"opt_state": old}) == amp_core.scaler_metrics(opt_state)


def test_loss_scale_state_without_any_scaler_says_how_to_restore():
    inner_only = {"opt_state": [{"count": jnp.zeros((), jnp.int32)}]}
    with pytest.raises(
        ValueError, match=r"found 0 states.*restore\(path, target\).*from_state_dict"
    ):
        amp_core.loss_scale_state(inner_only)
    partial = {"scaler": {"loss_scale": jnp.float32(2.0)}}  # not every field: not a scaler
    with pytest.raises(ValueError, match="found 0 states"):
        amp_core.loss_scale_state(partial)


# -- flax NNX: nnx.state(optimizer) -----------------------------------------------------------


class NnxMLP(nnx.Module):
    def __init__(self, rngs: nnx.Rngs) -> None:
        self.hidden = nnx.Linear(4, 16, dtype=jnp.float16, rngs=rngs)
        self.out = nnx.Linear(16, 1, dtype=jnp.float16, rngs=rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        return self.out(jnp.tanh(self.hidden(x)))


def fresh_nnx() -> tuple[NnxMLP, LossScaledOptimizer]:
    model = NnxMLP(nnx.Rngs(0))
    return model, LossScaledOptimizer(model, optax.adam(1e-2), CONFIG, wrt=nnx.Param)


@nnx.jit
def nnx_step(model, optimizer):
    grads = nnx.grad(lambda m: optimizer.scale_loss(float16_mse(m(X))))(model)
    optimizer.update(model, grads)


def test_nnx_state_checkpoint_round_trip_continues_bit_for_bit(tmp_path: Path):
    model, optimizer = fresh_nnx()
    for _ in range(BEFORE):
        nnx_step(model, optimizer)
    saved_step, saved_scaler = int(optimizer.step), amp_core.to_state_dict(CONFIG, optimizer.scaler)
    assert saved_step < BEFORE  # skipped steps are not counted

    checkpointer = ocp.StandardCheckpointer()
    checkpointer.save(tmp_path / "model", nnx.state(model))
    checkpointer.save(tmp_path / "optimizer", nnx.state(optimizer))
    checkpointer.wait_until_finished()
    abstract_model, abstract_optimizer = nnx.eval_shape(fresh_nnx)
    new_model, new_optimizer = fresh_nnx()
    nnx.update(new_model, checkpointer.restore(tmp_path / "model", nnx.state(abstract_model)))
    nnx.update(
        new_optimizer, checkpointer.restore(tmp_path / "optimizer", nnx.state(abstract_optimizer))
    )
    assert int(new_optimizer.step) == saved_step
    assert amp_core.to_state_dict(CONFIG, new_optimizer.scaler) == saved_scaler

    # Without a target orbax gives nested dicts; the scaler is still found in them.
    raw = checkpointer.restore(tmp_path / "optimizer")
    assert amp_core.to_state_dict(CONFIG, amp_core.loss_scale_state(raw)) == saved_scaler

    # And through plain dicts (nnx.to_pure_dict / nnx.replace_by_pure_dict).
    pure = nnx.to_pure_dict(nnx.state(optimizer))
    _, dict_optimizer = fresh_nnx()
    template = nnx.state(dict_optimizer)
    nnx.replace_by_pure_dict(template, pure)
    nnx.update(dict_optimizer, template)
    assert bits(nnx.state(dict_optimizer)) == bits(nnx.state(optimizer))

    for _ in range(AFTER):
        nnx_step(model, optimizer)
        nnx_step(new_model, new_optimizer)
    assert bits(nnx.state(new_model)) == bits(nnx.state(model))
    assert bits(nnx.state(new_optimizer)) == bits(nnx.state(optimizer))


# -- flax linen: flax.serialization ----------------------------------------------------------


class LinenMLP(nn.Module):
    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        x = nn.Dense(16, dtype=jnp.float16)(x)
        return nn.Dense(1, dtype=jnp.float16)(jnp.tanh(x))


LINEN = LinenMLP()


def fresh_train_state() -> LossScaledTrainState:
    params = LINEN.init(jax.random.key(1), X)["params"]
    return LossScaledTrainState.create(
        apply_fn=LINEN.apply, params=params, tx=optax.adam(1e-2), config=CONFIG
    )


@jax.jit
def linen_step(state: LossScaledTrainState) -> LossScaledTrainState:
    def scaled_loss(params):
        return state.scale_loss(float16_mse(state.apply_fn({"params": params}, X)))

    return state.apply_gradients(grads=jax.grad(scaled_loss)(state.params))


def test_linen_train_state_round_trip_through_flax_serialization():
    state = fresh_train_state()
    for _ in range(BEFORE):
        state = linen_step(state)
    blob = serialization.to_bytes(state)
    restored = serialization.from_bytes(fresh_train_state(), blob)
    assert int(restored.step) == int(state.step) < BEFORE
    assert bits(restored) == bits(state)
    raw = serialization.msgpack_restore(blob)  # no target: dicts
    assert amp_core.scaler_metrics(raw) == amp_core.scaler_metrics(state)
    for _ in range(AFTER):
        state, restored = linen_step(state), linen_step(restored)
    assert bits(restored) == bits(state)


# -- equinox: tree_serialise_leaves -----------------------------------------------------------


EQX_INNER = optax.adam(1e-2)


def fresh_equinox():
    model = eqx.nn.MLP(4, 1, 16, 1, activation=jax.nn.tanh, key=jax.random.key(2))
    opt_state = amp_core.with_loss_scaling(EQX_INNER, CONFIG).init(
        eqx.filter(model, eqx.is_inexact_array)
    )
    return model, opt_state


@eqx.filter_jit
def equinox_step(model, opt_state):
    def scaled_loss(m):
        half = jax.tree_util.tree_map(
            lambda a: a.astype(jnp.float16) if eqx.is_inexact_array(a) else a, m
        )
        pred = jax.vmap(half)(X.astype(jnp.float16))
        return amp_core.scale_loss(amp_core.loss_scale_state(opt_state), float16_mse(pred))

    grads = eqx.filter_grad(scaled_loss)(model)
    return amp_core.apply_scaled_gradients(EQX_INNER, CONFIG, grads, opt_state, model)


def test_equinox_round_trip_through_tree_serialise_leaves(tmp_path: Path):
    model, opt_state = fresh_equinox()
    for _ in range(BEFORE):
        model, opt_state = equinox_step(model, opt_state)
    assert int(amp_core.loss_scale_state(opt_state).num_skipped_steps) >= 3
    eqx.tree_serialise_leaves(tmp_path / "run.eqx", (model, opt_state))
    restored_model, restored_state = eqx.tree_deserialise_leaves(
        tmp_path / "run.eqx", fresh_equinox()
    )
    assert bits(eqx.filter((restored_model, restored_state), eqx.is_array)) == bits(
        eqx.filter((model, opt_state), eqx.is_array)
    )
    for _ in range(AFTER):
        model, opt_state = equinox_step(model, opt_state)
        restored_model, restored_state = equinox_step(restored_model, restored_state)
    assert bits(eqx.filter((restored_model, restored_state), eqx.is_array)) == bits(
        eqx.filter((model, opt_state), eqx.is_array)
    )
