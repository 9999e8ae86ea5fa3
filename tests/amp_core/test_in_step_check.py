"""The overflow check inside a train step: one leaf after the other, bit-identical to the plain sum.

``with_loss_scaling``, ``apply_scaled_gradients`` and ``value_and_grad`` sum the unscaled squares
with :func:`amp_core.scaling._in_step_sum_of_unscaled_squares`: on the CPU a chain of selects
that makes XLA write and sum one leaf at a time, elsewhere the branch-free sum. Oracles: the
branch-free :func:`amp_core.sum_of_unscaled_squares` (bit for bit), a float64 sum of squares,
IEEE propagation of inf and NaN, XLA's memory analysis of the compiled step (no temporary larger
than one leaf), and the StableHLO JAX exports for another platform.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import optax
import pytest
from amp_helpers import assert_bitwise_equal

import amp_core
from amp_core.scaling import (
    _chained_squares,
    _fused_squares,
    _in_memory,
)
from amp_core.scaling import in_step_sum_of_unscaled_squares as _in_step_sum_of_unscaled_squares

DTYPE_PROMOTION = "standard"  # optax's adamw (see test_optax.py)


def leaves_of(seed: int) -> dict:
    """float32, float16 and bfloat16 leaves of several sizes (magnitudes like scaled gradients)."""
    rng = np.random.default_rng(seed)
    return {
        "big": jnp.asarray(rng.standard_normal((64, 33)).astype(np.float32) * 300),
        "vector": jnp.asarray(rng.standard_normal(17).astype(np.float32) * 3),
        "half": jnp.asarray((rng.standard_normal((5, 7)) * 100).astype(np.float16)),
        "brain": jnp.asarray((rng.standard_normal(9) * 100).astype(ml_dtypes.bfloat16)),
        "scalar": jnp.float32(rng.standard_normal() * 50),
    }


def computed(grads):
    """``grads`` recomputed inside the traced function (``jnp.negative`` twice): values the step makes."""
    return jax.tree_util.tree_map(lambda g: jnp.negative(jnp.negative(g)), grads)


def in_step_sum_of(source: str):
    """``_in_step_sum_of_unscaled_squares`` over leaves computed in the step, passed into it as
    jit inputs, or given eagerly (concrete arrays)."""
    if source == "computed":
        return jax.jit(lambda g, inv: _in_step_sum_of_unscaled_squares(computed(g), inv))
    if source == "jit inputs":
        return jax.jit(_in_step_sum_of_unscaled_squares)
    return _in_step_sum_of_unscaled_squares


@pytest.mark.parametrize("inv", [2.0**-10, 1.0 / 3.0, 1.0])
@pytest.mark.parametrize("source", ["computed", "jit inputs", "eager"])
def test_equals_the_plain_sums_bit_for_bit(inv, source):
    """Computed leaves give the branch-free sum's bits (the chain); leaves in memory the one-read
    sum's (for a power-of-two scale the two are the same bits)."""
    grads = leaves_of(0)
    total = in_step_sum_of(source)(grads, jnp.float32(inv))
    branch_free = source == "computed"
    expected = amp_core.sum_of_unscaled_squares(grads, jnp.float32(inv), branch_free=branch_free)
    assert_bitwise_equal(total, expected)
    oracle = sum(
        np.sum(
            (np.asarray(g).astype(np.float32) * np.float32(inv))
            .astype(np.asarray(g).dtype)
            .astype(np.float64)
            ** 2
        )
        for g in jax.tree_util.tree_leaves(grads)
    )
    np.testing.assert_allclose(float(total), oracle, rtol=1e-6)


def test_leaves_in_memory_and_computed_ones_mix():
    grads = leaves_of(3)
    inv = jnp.float32(2.0**-6)

    def half_computed(g, inv):
        return _in_step_sum_of_unscaled_squares(
            {**g, "big": jnp.negative(jnp.negative(g["big"]))}, inv
        )

    total = jax.jit(half_computed)(grads, inv)
    np.testing.assert_allclose(
        float(total), float(amp_core.sum_of_unscaled_squares(grads, inv)), rtol=1e-6
    )
    poisoned = {**grads, "vector": grads["vector"].at[0].set(jnp.inf)}
    assert float(jax.jit(half_computed)(poisoned, inv)) == np.inf


def test_where_the_leaves_come_from_is_read_from_the_tracer():
    seen = {}

    def step(x):
        seen["input"] = _in_memory(x)
        seen["computed"] = _in_memory(x * 2)
        total, _ = jax.lax.scan(lambda acc, y: (acc + y, None), x, jnp.stack([x, x]))
        seen["scan output"] = _in_memory(total)
        jax.grad(lambda y: jnp.sum(y * (seen.setdefault("under grad", _in_memory(y)) + 1)))(x)
        return total

    jax.jit(step)(jnp.ones(3))
    assert seen == {"input": True, "computed": False, "scan output": True, "under grad": False}
    assert _in_memory(jnp.ones(3)) and _in_memory(np.ones(3))


def test_power_of_two_scale_gives_the_default_sum_bit_for_bit():
    """Scaling by a power of two commutes with rounding: the same bits as the one-read sum."""
    grads = leaves_of(1)
    inv = jnp.float32(2.0**-12)
    assert_bitwise_equal(
        jax.jit(_in_step_sum_of_unscaled_squares)(grads, inv),
        amp_core.sum_of_unscaled_squares(grads, inv),
    )


@pytest.mark.parametrize(
    ("values", "expected"),
    [
        ([[1.0, np.inf], [2.0], [3.0]], np.inf),
        ([[1.0], [2.0], [-np.inf]], np.inf),
        ([[np.nan], [np.inf], [1.0]], np.nan),
        ([[np.inf], [np.nan], [1.0]], np.nan),
        ([[1.0], [np.inf], [np.nan]], np.nan),
        ([[3e19], [1.0], [2.0]], np.inf),  # a finite value whose square overflows float32
        ([[3.0, 4.0], [0.0], [-0.0]], 25.0),
    ],
    ids=["inf-first", "inf-last", "nan-then-inf", "inf-then-nan", "nan-last", "square", "finite"],
)
@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
def test_inf_and_nan_come_out_as_the_plain_sum_gives_them(values, expected, jit):
    """The chain turns later leaves into NaN only after the running sum is NaN: ``inf`` stays
    ``inf`` (the global norm reports an overflow as ``inf``), NaN stays NaN."""
    grads = [jnp.asarray(v, jnp.float32) for v in values]
    fn = jax.jit(_in_step_sum_of_unscaled_squares) if jit else _in_step_sum_of_unscaled_squares
    total = float(fn(grads, jnp.float32(1.0)))
    if np.isnan(expected):
        assert np.isnan(total)
    else:
        assert total == expected


def test_both_platform_branches_agree_and_an_empty_tree_sums_to_zero():
    grads = jax.tree_util.tree_leaves(leaves_of(2))
    inv = jnp.float32(2.0**-7)
    assert_bitwise_equal(jax.jit(_chained_squares)(grads, inv), jax.jit(_fused_squares)(grads, inv))
    assert float(_in_step_sum_of_unscaled_squares({}, inv)) == 0.0
    assert float(_in_step_sum_of_unscaled_squares({"step": jnp.int32(3)}, inv)) == 0.0


@pytest.mark.parametrize(
    ("platform", "source", "selects"),
    [("cpu", "computed", True), ("cpu", "jit inputs", False), ("cuda", "computed", False)],
)
def test_the_chain_is_lowered_for_computed_leaves_on_the_cpu_only(platform, source, selects):
    """Exported for a GPU (no GPU needed), the sum is the branch-free one: no select chain; on
    the CPU gradients passed in are read once, without the chain's copies."""
    grads = [jnp.ones((8, 4), jnp.float32), jnp.ones(3, jnp.float32)]
    exported = jax.export.export(in_step_sum_of(source), platforms=[platform])(
        grads, jnp.float32(0.5)
    )
    text = exported.mlir_module()
    assert ("stablehlo.select" in text) == selects
    assert text.count("stablehlo.reduce") >= 2


# -- the train step ------------------------------------------------------------------------------

LEAF_SHAPES = [(256, 96), (256, 64), (128, 128), (200, 100), (64, 256), (1000,), (300,), (96, 96)]


def synthetic_loss(params):
    """``0.5 * sum(p16**2)``: gradients element-wise in the parameters, as XLA fuses them."""
    return sum(
        0.5 * jnp.sum(jnp.square(p.astype(jnp.float16)), dtype=jnp.float32)
        for p in jax.tree_util.tree_leaves(params)
    )


def make_step(fused_apply: bool):
    cfg = amp_core.DynamicLossScale(init_scale=2.0**10)
    inner = optax.adamw(1e-3)
    tx = amp_core.with_loss_scaling(inner, cfg)
    traces = []

    def step(params, opt_state, poison):
        traces.append(1)
        scaler = amp_core.loss_scale_state(opt_state)
        grads = jax.grad(lambda p: amp_core.scale_loss(scaler, synthetic_loss(p) * poison))(params)
        if fused_apply:
            return amp_core.apply_scaled_gradients(inner, cfg, grads, opt_state, params)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state

    return tx, step, traces


def params_of(seed: int) -> dict:
    rng = np.random.default_rng(seed)
    return {
        f"p{i}": jnp.asarray(rng.standard_normal(shape).astype(np.float32))
        for i, shape in enumerate(LEAF_SHAPES)
    }


@pytest.mark.parametrize("fused_apply", [False, True], ids=["with_loss_scaling", "apply_scaled"])
def test_a_step_keeps_at_most_one_gradient_alive_on_the_cpu(fused_apply):
    """The gradients are computed in the step: XLA writes each one out to sum it (no reduction
    fuses its producer on the CPU), but the chain lets only one be alive at a time, where the
    default scheduler would run every write first (all gradients alive: fresh memory each
    call)."""
    if jax.default_backend() != "cpu":
        pytest.skip("the chain is the CPU's")
    tx, step, _ = make_step(fused_apply)
    params = params_of(0)
    compiled = (
        jax.jit(step, donate_argnums=(0, 1))
        .lower(params, tx.init(params), jnp.float32(1.0))
        .compile()
    )
    memory = compiled.memory_analysis()
    if memory is None:
        pytest.skip("this backend reports no memory analysis")
    leaves = [p.nbytes for p in params.values()]
    assert memory.temp_size_in_bytes < 1.25 * max(leaves) < 0.5 * sum(leaves)


@pytest.mark.parametrize("fused_apply", [False, True], ids=["with_loss_scaling", "apply_scaled"])
def test_one_trace_bit_identical_skips_and_eager_agrees_with_jit(fused_apply):
    tx, step, traces = make_step(fused_apply)
    jitted = jax.jit(step, donate_argnums=(0, 1))
    params, eager_params = params_of(1), params_of(1)
    opt_state, eager_state = tx.init(params), tx.init(eager_params)
    for index in range(5):
        poison = jnp.float32(np.inf) if index in (1, 3) else jnp.float32(1.0)
        before = [np.asarray(x).tobytes() for x in jax.tree_util.tree_leaves(params)]
        before += [np.asarray(x).tobytes() for x in jax.tree_util.tree_leaves(opt_state[1])]
        params, opt_state = jitted(params, opt_state, poison)
        eager_params, eager_state = step(eager_params, eager_state, poison)
        after = [np.asarray(x).tobytes() for x in jax.tree_util.tree_leaves(params)]
        after += [np.asarray(x).tobytes() for x in jax.tree_util.tree_leaves(opt_state[1])]
        assert (after == before) == (index in (1, 3))
    assert len(traces) == 1 + 5  # one trace under jit, then one per eager call
    scaler = amp_core.loss_scale_state(opt_state)
    assert int(scaler.num_skipped_steps) == 2
    assert float(scaler.loss_scale) == 2.0**8
    for ours, eager in zip(
        jax.tree_util.tree_leaves(params), jax.tree_util.tree_leaves(eager_params), strict=True
    ):
        np.testing.assert_allclose(np.asarray(ours), np.asarray(eager), rtol=1e-6, atol=1e-7)
