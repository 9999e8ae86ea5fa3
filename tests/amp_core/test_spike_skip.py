"""Spike skipping in the JAX door: ``DynamicLossScale(spike_skip=SpikeSkip(...))``.

Oracles: a plain-Python window (``framework_oracles.spike_window_decisions``: a deque of the
applied steps' metrics, NumPy's ``mean`` and ``std(ddof=1)`` in float64) for every decision;
the state before a skipped step for the parameters, the inner optimizer's state and the scaler
(bit for bit); the uninterrupted run for a run resumed from an orbax checkpoint.
"""

from __future__ import annotations

import functools
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp
import pytest
from framework_oracles import spike_window_decisions

import amp_core

DTYPE_PROMOTION = "standard"  # optax's adam: decay ** count


def bits(tree) -> list[bytes]:
    return [np.array(leaf).tobytes() for leaf in jax.tree_util.tree_leaves(tree)]


@pytest.mark.parametrize("jit", [False, True])
@pytest.mark.parametrize(
    ("window", "warmup", "sigma"), [(8, None, 3.0), (5, 12, 2.0), (16, 3, 6.0)]
)
def test_decisions_follow_the_window_of_applied_steps(jit, window, warmup, sigma):
    rng = np.random.default_rng(window)
    metrics = rng.lognormal(0.0, 0.3, 120).astype(np.float32)
    metrics[[20, 21, 60, 61, 62, 100]] *= 40.0  # spikes, some back to back
    finite = np.ones(120, bool)
    finite[[30, 61, 90]] = False  # overflows: neither spikes nor window entries
    metrics[90] = np.inf
    config = amp_core.SpikeSkip(window=window, sigma=sigma, warmup=warmup)
    check = functools.partial(amp_core.check_spike, config)
    if jit:
        check = jax.jit(check)
    spikes = amp_core.init_spikes(config)
    ours = []
    for value, ok in zip(metrics, finite, strict=True):
        spike, spikes = check(spikes, jnp.float32(value), jnp.asarray(ok))
        ours.append((bool(spike), float(spikes.threshold)))
    expected = spike_window_decisions(
        metrics.tolist(), finite.tolist(), window=window, sigma=sigma, warmup=config.warmup
    )
    assert [s for s, _ in ours] == [s for s, _ in expected]
    np.testing.assert_allclose([t for _, t in ours], [t for _, t in expected], rtol=1e-5)
    assert int(spikes.num_spike_skips) == sum(s for s, _ in expected) >= 3
    assert int(spikes.applied) == sum(finite) - sum(s for s, _ in expected)


def test_a_spike_changes_nothing_but_its_counter():
    config = amp_core.DynamicLossScale(
        init_scale=2.0**4,
        steps_per_increase=5,
        spike_skip=amp_core.SpikeSkip(window=4, sigma=3.0),
    )
    tx = amp_core.with_loss_scaling(optax.adam(0.1), config)
    params = {"w": jnp.ones(3)}
    opt_state = tx.init(params)
    update = jax.jit(tx.update)
    rng = np.random.default_rng(0)
    for _ in range(5):  # warm-up: grads of norm ~1 (scaled by 16)
        grads = {"w": jnp.asarray(16 * (1 + 0.1 * rng.standard_normal(3)), jnp.float32)}
        updates, opt_state = update(grads, opt_state, params)
        params = optax.apply_updates(params, updates)
    assert bool(amp_core.step_applied(opt_state))
    before = (params, opt_state.inner_state, opt_state.scaler)
    updates, opt_state = update({"w": jnp.full(3, 16 * 300.0)}, opt_state, params)
    params = optax.apply_updates(params, updates)
    assert bits(params) == bits(before[0])
    assert bits(opt_state.inner_state) == bits(before[1])
    scaler = opt_state.scaler
    for name in (
        "loss_scale",
        "steps_since_rescale",
        "overflows_since_rescale",
        "num_skipped_steps",
    ):
        assert bits(getattr(scaler, name)) == bits(getattr(before[2], name)), name
    assert bool(scaler.isfinite) and float(scaler.global_norm) == pytest.approx(300 * 3**0.5)
    assert not bool(amp_core.step_applied(opt_state))
    metrics = amp_core.scaler_metrics(opt_state)
    assert metrics["num_spike_skips"] == 1 and metrics["num_skipped_steps"] == 0
    assert "num_spike_skips" not in amp_core.scaler_metrics(
        amp_core.with_loss_scaling(optax.adam(0.1), amp_core.DynamicLossScale()).init(params)
    )


def test_the_loss_metric_reads_the_loss_given_to_update():
    config = amp_core.DynamicLossScale(
        spike_skip=amp_core.SpikeSkip(metric="loss", window=3, sigma=2.0)
    )
    tx = amp_core.with_loss_scaling(optax.sgd(0.1), config)
    params = {"w": jnp.zeros(2)}
    opt_state = tx.init(params)
    grads = {"w": jnp.ones(2)}
    for loss in (1.0, 1.1, 0.9, 1.0):
        _, opt_state = tx.update(grads, opt_state, params, loss=jnp.float32(loss))
    _, opt_state = tx.update(grads, opt_state, params, loss=jnp.float32(9.0))
    assert int(amp_core.spike_state(opt_state).num_spike_skips) == 1
    with pytest.raises(TypeError, match=r'metric="loss"\) needs the step\'s loss'):
        tx.update(grads, opt_state, params)
    with pytest.raises(ValueError, match="cannot watch an accumulated step"):
        amp_core.with_loss_scaling(optax.MultiSteps(optax.sgd(0.1), 2), config)
    new_params, _ = amp_core.apply_scaled_gradients(
        optax.sgd(0.1), config, grads, opt_state, params, loss=jnp.float32(1.0)
    )
    assert new_params["w"].shape == (2,)


def test_grad_norm_spikes_are_checked_once_per_accumulated_step():
    config = amp_core.DynamicLossScale(spike_skip=amp_core.SpikeSkip(window=3, sigma=2.0))
    tx = amp_core.with_loss_scaling(optax.MultiSteps(optax.sgd(0.1), 2), config)
    params = {"w": jnp.zeros(2)}
    opt_state = tx.init(params)
    scale = 2.0**15
    for norm in [1.0, 1.1, 0.9, 1.0, 1.05, 0.95, 1.0, 1.0, 1.0, 1.0, 200.0, 200.0]:
        _, opt_state = tx.update({"w": jnp.full(2, scale * norm)}, opt_state, params)
    spikes = amp_core.spike_state(opt_state)
    assert int(spikes.num_spike_skips) == 1 and int(spikes.applied) == 5
    assert not bool(amp_core.step_applied(opt_state))


def test_the_window_resumes_bit_for_bit_from_a_checkpoint(tmp_path: Path):
    config = amp_core.DynamicLossScale(
        init_scale=2.0**8, spike_skip=amp_core.SpikeSkip(window=4, sigma=2.0)
    )
    tx = amp_core.with_loss_scaling(optax.adam(0.05), config)

    @jax.jit
    def step(params, opt_state, i):
        key = jax.random.fold_in(jax.random.key(0), i)
        grads = {"w": 2.0**8 * (1 + 0.2 * jax.random.normal(key, (3,)))}
        grads = {"w": jnp.where(i % 7 == 6, grads["w"] * 100, grads["w"])}
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state

    params = {"w": jnp.ones(3)}
    run = (params, tx.init(params))
    for i in range(10):
        run = step(*run, i)
    checkpointer = ocp.StandardCheckpointer()
    checkpointer.save(tmp_path / "ckpt", {"params": run[0], "opt_state": run[1]})
    checkpointer.wait_until_finished()
    target = {"params": params, "opt_state": tx.init(params)}
    restored = checkpointer.restore(tmp_path / "ckpt", target)
    resumed = (restored["params"], restored["opt_state"])
    for i in range(10, 30):
        run = step(*run, i)
        resumed = step(*resumed, i)
    assert bits(resumed) == bits(run)
    assert int(amp_core.spike_state(run[1]).num_spike_skips) >= 2


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"window": 1}, ValueError, r"window must be an integer from 2"),
        ({"window": 2.5}, ValueError, r"window must be a whole number"),
        ({"window": "8"}, TypeError, r"window must be an integer"),
        ({"sigma": 0.0}, ValueError, r"sigma must be a finite number > 0; got 0.0"),
        ({"sigma": float("nan")}, ValueError, r"sigma must be a finite number > 0"),
        ({"sigma": "6"}, TypeError, r"sigma must be a number"),
        ({"metric": "norm"}, ValueError, r"metric must be one of \['grad_norm', 'loss'\]; got 'norm'"),
        ({"warmup": 1}, ValueError, r"warmup must be an integer from 2"),
    ],
)  # fmt: skip
def test_bad_spike_skip_arguments_name_the_argument(kwargs, error, match):
    with pytest.raises(error, match=match):
        amp_core.SpikeSkip(**kwargs)


def test_spike_skip_needs_dynamic_scaling_and_a_spike_skip_object():
    with pytest.raises(TypeError, match=r"spike_skip must be an amp_core\.SpikeSkip"):
        amp_core.DynamicLossScale(spike_skip={"window": 8})
    with pytest.raises(ValueError, match='spike_skip needs loss_scale="dynamic"'):
        amp_core.make_config(1.0, spike_skip=amp_core.SpikeSkip())
    assert amp_core.make_config("dynamic", spike_skip=amp_core.SpikeSkip()).spike_skip.window == 128


def test_a_planted_bad_batch_hurts_the_default_run_and_not_the_spike_skipping_one():
    """A 52-step version of tests/amp_core/spike_skip_demo.py (docs/jax/spike-skip.md)."""
    from spike_skip_demo import train

    base = {"init_scale": 2.0**10, "steps_per_increase": 100}
    default = train(amp_core.DynamicLossScale(**base), steps=52, bad_step=40, factor=300.0)
    skipping = train(
        amp_core.DynamicLossScale(**base, spike_skip=amp_core.SpikeSkip(window=16)),
        steps=52,
        bad_step=40,
        factor=300.0,
    )
    assert default["before"] == skipping["before"]  # the same run up to the bad step
    assert skipping["after"] == skipping["before"]  # skipped: the parameters did not move
    assert default["after10"] > 2 * skipping["after10"]  # 0.173 and 0.060 on 7 Dec 2026
    assert (default["spike_skips"], skipping["spike_skips"]) == (0, 1)
    assert default["overflow_skips"] == skipping["overflow_skips"] == 0


def test_flax_nnx_counts_only_applied_steps_and_takes_the_loss_through_update():
    from flax import nnx

    from amp_core.flax_nnx import LossScaledOptimizer

    model = nnx.Linear(2, 1, rngs=nnx.Rngs(0))
    config = amp_core.DynamicLossScale(
        init_scale=2.0**10, spike_skip=amp_core.SpikeSkip(metric="loss", window=4, sigma=3.0)
    )
    optimizer = LossScaledOptimizer(model, optax.sgd(0.01), config, wrt=nnx.Param)
    x = jnp.ones((4, 2))

    def step(y):
        def loss_fn(m):
            return jnp.mean((m(x) - y) ** 2)

        loss, grads = nnx.value_and_grad(lambda m: optimizer.scale_loss(loss_fn(m)))(model)
        return optimizer.update(model, grads, loss=loss / optimizer.scaler.loss_scale)

    for i in range(6):
        assert bool(step(jnp.full((4, 1), 1.0 + 0.05 * i)))
    kernel = np.array(model.kernel[...])
    assert not bool(step(jnp.full((4, 1), 300.0)))  # a loss ~10**5 times the usual
    np.testing.assert_array_equal(np.array(model.kernel[...]), kernel)
    assert int(optimizer.step[...]) == 6
    assert amp_core.scaler_metrics(optimizer)["num_spike_skips"] == 1
