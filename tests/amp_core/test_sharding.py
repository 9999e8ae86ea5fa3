"""Gradients sharded over 8 devices give one global decision (tests/conftest.py sets the flag)."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec

import amp_core

pytestmark = pytest.mark.skipif(
    jax.device_count() < 8,
    reason="needs 8 devices: XLA_FLAGS=--xla_force_host_platform_device_count=8",
)

DEVICES = 8
CFG = amp_core.DynamicLossScale(init_scale=2.0**12, steps_per_increase=5, max_gradient_norm=4.0)


@pytest.fixture(scope="module")
def mesh():
    return Mesh(np.array(jax.devices()[:DEVICES]), ("data",))


def host_grads(seed: int = 0) -> dict:
    rng = np.random.default_rng(seed)
    return {
        "kernel": (rng.standard_normal((DEVICES * 4, 3)) * 100).astype(np.float32),
        "bias": (rng.standard_normal((DEVICES * 2,)) * 100).astype(np.float32),
        "half": (rng.standard_normal((DEVICES, 5)) * 100).astype(np.float16),
    }


def shard(mesh, tree: dict) -> dict:
    """Places every leaf split over the devices along its leading axis."""
    sharding = NamedSharding(mesh, PartitionSpec("data"))
    return {key: jax.device_put(value, sharding) for key, value in tree.items()}


def assert_identical_on_every_device(tree):
    for leaf in jax.tree_util.tree_leaves(tree):
        shards = leaf.addressable_shards
        assert len({s.device for s in shards}) == DEVICES, leaf.sharding
        assert leaf.sharding.is_fully_replicated, leaf.sharding
        first = np.asarray(shards[0].data)
        for s in shards[1:]:
            assert np.asarray(s.data).tobytes() == first.tobytes(), s.device


def test_grads_really_are_split_over_eight_devices(mesh):
    grads = shard(mesh, host_grads())
    kernel_shards = grads["kernel"].addressable_shards
    assert len(kernel_shards) == DEVICES
    assert {s.data.shape for s in kernel_shards} == {(4, 3)}


@pytest.mark.parametrize("device_index", [0, 5, 7])
@pytest.mark.parametrize("bad", [np.inf, np.nan], ids=["inf", "nan"])
def test_inf_in_one_shard_skips_the_step_everywhere(mesh, device_index, bad):
    grads = host_grads()
    grads["kernel"][device_index * 4 + 1, 2] = bad  # a row that lives on that device only
    sharded = shard(mesh, grads)
    owner = [
        s for s in sharded["kernel"].addressable_shards if s.index[0].start == device_index * 4
    ]
    assert not np.isfinite(np.asarray(owner[0].data)).all()

    state = amp_core.init(CFG)
    result = jax.jit(functools.partial(amp_core.check_and_update, CFG))(state, sharded)
    assert not bool(result.isfinite)
    assert int(result.next_state.num_skipped_steps) == 1
    assert float(result.next_state.loss_scale) == 2.0**11
    assert_identical_on_every_device((result.isfinite, result.multiplier, result.next_state))


def test_finite_sharded_grads_give_the_unsharded_norm_and_values(mesh):
    grads = host_grads(1)
    state = amp_core.init(CFG)
    step = jax.jit(functools.partial(amp_core.check_and_update, CFG))
    sharded_result = step(state, shard(mesh, grads))
    plain_result = step(state, {k: jnp.asarray(v) for k, v in grads.items()})
    assert bool(sharded_result.isfinite)
    np.testing.assert_allclose(
        float(sharded_result.global_norm), float(plain_result.global_norm), rtol=1e-6
    )
    assert_identical_on_every_device(sharded_result.next_state)

    # Below max_gradient_norm nothing is clipped: both paths multiply by the power of two
    # 2**-12, which is exact, however the norm was summed. So the values agree bit for bit, the
    # float16 leaf too (a relative 1e-5 was 50 times finer than float16 resolves, and a clip
    # multiplier that differs by the norm's rounding could move a float16 value by one ulp).
    assert float(plain_result.global_norm) < CFG.max_gradient_norm
    unscale = jax.jit(functools.partial(amp_core.unscale_and_check, CFG))
    sharded_grads, _, _ = unscale(state, shard(mesh, grads))
    plain_grads, _, _ = unscale(state, {k: jnp.asarray(v) for k, v in grads.items()})
    for key in grads:
        assert sharded_grads[key].dtype == grads[key].dtype
        assert np.asarray(sharded_grads[key]).tobytes() == np.asarray(plain_grads[key]).tobytes()


def test_optax_wrapper_skips_on_every_shard(mesh):
    tx = amp_core.with_loss_scaling(optax.adamw(1e-2), CFG)
    params = shard(mesh, {k: np.ones_like(v) for k, v in host_grads().items()})
    opt_state = tx.init(params)

    @jax.jit
    def apply(grads, opt_state, params):
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state

    grads = host_grads(2)
    grads["bias"][3] = np.inf
    with jax.numpy_dtype_promotion("standard"):  # optax's adamw promotes implicitly
        new_params, new_opt_state = apply(shard(mesh, grads), opt_state, params)
    for key in params:
        assert np.asarray(new_params[key]).tobytes() == np.asarray(params[key]).tobytes()
    scaler = amp_core.loss_scale_state(new_opt_state)
    assert not bool(scaler.isfinite)
    assert_identical_on_every_device(scaler)
