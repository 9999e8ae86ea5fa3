"""The optax wrapper (:func:`amp_core.with_loss_scaling`) and :func:`amp_core.value_and_grad`.

Oracles: the same optax optimizer run on the unscaled loss, bit patterns of the parameters and
optimizer state from before an overflowed step, the same run without donation or without jit,
and XLA's memory analysis of the compiled step (no temporary the size of the parameters).
"""

from __future__ import annotations

import warnings
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from amp_helpers import assert_trees_close

import amp_core

# optax's adamw computes ``decay ** count`` (a float to an int32 power), which strict dtype
# promotion rejects; see tests/conftest.py.
DTYPE_PROMOTION = "standard"

LEARNING_RATE = 1e-2
RNG = np.random.default_rng(0)
X = jnp.asarray(RNG.standard_normal((16, 4)), jnp.float32)
Y = jnp.asarray(RNG.standard_normal((16, 2)), jnp.float32)


def init_params() -> dict:
    rng = np.random.default_rng(1)
    return {
        "w1": jnp.asarray(rng.standard_normal((4, 8)) * 0.5, jnp.float32),
        "b1": jnp.zeros((8,), jnp.float32),
        "w2": jnp.asarray(rng.standard_normal((8, 2)) * 0.5, jnp.float32),
    }


def loss_fn(params, x=X, y=Y):
    hidden = jnp.tanh(x @ params["w1"] + params["b1"])
    return jnp.mean((hidden @ params["w2"] - y) ** 2)


def bits(tree) -> list[bytes]:
    """The exact bit pattern of every leaf (so -0.0 != 0.0 and NaN payloads count)."""
    return [np.asarray(leaf).tobytes() for leaf in jax.tree_util.tree_leaves(tree)]


# Runs of one computation that XLA compiles differently (eager against jit, the scaled against
# the unscaled loss, other fusions) agree to rounding: to a few ulps of each leaf's own dtype
# (amp_helpers.assert_trees_close), never to float32's resolution for a float16 leaf. Each step
# Adam rounds a moment update about three times where a fused run may round once (on CPUs with
# AVX512-FP16 a float16 a*b+c becomes one FMA): at most 1.5 ulps a step, carried on with weight
# <= 1. Measured: float32 leaves <= 1.3 ulps, with XLA's FMA contraction and without it
# (--xla_cpu_max_isa=AVX); float16 leaves <= 1.8 ulps over run_steps' 4 applied steps when their
# update runs in float32 and rounds once (that gives the 2.0527 that the jitted run gave on an
# AVX512-FP16 CPU, where the eager one gave 2.0508). 8 ulps: 9.5e-7 in float32 (it was 1e-6,
# and 1e-5 for some), 7.8e-3 in float16 (it was 1e-5: 50 times finer than float16 resolves).
ROUNDING_ULPS = 8


def make_scaled_step(tx, loss=loss_fn, *, mode: str = "jit"):
    """A train step that differentiates the scaled loss and applies ``tx``.

    ``mode``: ``"jit"``, ``"donate"`` (jitted, params and optimizer state donated, as a user's
    ``jax.jit(train_step, donate_argnums=(0, 1))``) or ``"eager"``.
    """

    def step(params, opt_state, poison):
        scaler = amp_core.loss_scale_state(opt_state)
        grads = jax.grad(lambda p: amp_core.scale_loss(scaler, loss(p)))(params)
        grads = jax.tree_util.tree_map(lambda g: g * poison.astype(g.dtype), grads)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state

    if mode == "eager":
        return step
    return jax.jit(step, donate_argnums=(0, 1) if mode == "donate" else ())


def make_reference_step(tx, loss=loss_fn):
    @jax.jit
    def step(params, opt_state):
        updates, opt_state = tx.update(jax.grad(loss)(params), opt_state, params)
        return optax.apply_updates(params, updates), opt_state

    return step


FINITE = jnp.float32(1.0)


# -- finite steps ---------------------------------------------------------------------------------


def test_finite_steps_match_unscaled_adamw():
    cfg = amp_core.DynamicLossScale(init_scale=2.0**8, steps_per_increase=2, max_loss_scale=2.0**14)
    inner = optax.adamw(LEARNING_RATE, weight_decay=1e-2)
    scaled_step = make_scaled_step(amp_core.with_loss_scaling(inner, cfg))
    reference_step = make_reference_step(inner)
    params = reference = init_params()
    opt_state = amp_core.with_loss_scaling(inner, cfg).init(params)
    reference_state = inner.init(reference)
    for _ in range(15):
        params, opt_state = scaled_step(params, opt_state, FINITE)
        reference, reference_state = reference_step(reference, reference_state)
    assert_trees_close(params, reference, ulps=ROUNDING_ULPS)
    # The gradients agree to rounding only: XLA orders the backward pass's float ops
    # differently once the (power-of-two) scale is a traced value rather than the constant 1.
    assert_trees_close(opt_state.inner_state, reference_state, ulps=ROUNDING_ULPS)
    scaler = amp_core.loss_scale_state(opt_state)
    assert float(scaler.loss_scale) == 2.0**13  # grew on updates 3, 6, 9, 12, 15
    assert int(scaler.num_skipped_steps) == 0
    assert loss_fn(params) < loss_fn(init_params())


# -- overflowed steps -----------------------------------------------------------------------------


@pytest.mark.parametrize("bad", [np.inf, -np.inf, np.nan], ids=["inf", "-inf", "nan"])
@pytest.mark.parametrize("mode", ["jit", "eager"])
def test_overflow_step_leaves_params_and_adamw_state_bit_identical(bad, mode):
    cfg = amp_core.DynamicLossScale(init_scale=2.0**10, steps_per_increase=100)
    tx = amp_core.with_loss_scaling(optax.adamw(LEARNING_RATE, weight_decay=1e-2), cfg)
    params = init_params()
    params["half"] = jnp.asarray([1.0, -0.0, 3.0], jnp.float16)
    loss = lambda p: loss_fn(p) + jnp.sum(p["half"].astype(jnp.float32) ** 2)  # noqa: E731
    step = make_scaled_step(tx, loss)
    opt_state = tx.init(params)
    for _ in range(3):  # give adamw non-trivial moments and count
        params, opt_state = step(params, opt_state, FINITE)
    params["w1"] = params["w1"].at[0, 0].set(-0.0).at[0, 1].set(0.0)

    scaler = amp_core.loss_scale_state(opt_state)
    grads = jax.grad(lambda p: amp_core.scale_loss(scaler, loss(p)))(params)
    grads["w2"] = grads["w2"].at[1, 1].set(bad)
    update = tx.update if mode == "eager" else jax.jit(tx.update)
    updates, new_opt_state = update(grads, opt_state, params)
    new_params = optax.apply_updates(params, updates)

    assert bits(new_params) == bits(params)
    assert np.signbit(np.asarray(new_params["w1"][0, 0]))
    assert new_params["half"].dtype == jnp.float16
    assert bits(new_opt_state.inner_state) == bits(opt_state.inner_state)
    new_scaler = amp_core.loss_scale_state(new_opt_state)
    assert not bool(new_scaler.isfinite)
    assert float(new_scaler.loss_scale) == float(scaler.loss_scale) / 2
    assert int(new_scaler.num_skipped_steps) == int(scaler.num_skipped_steps) + 1
    assert int(new_scaler.steps_since_rescale) == 0


def test_training_continues_after_overflow_like_a_run_without_the_bad_step():
    """Skipped steps leave no trace: the run equals one where the bad steps never happened."""
    cfg = amp_core.DynamicLossScale(init_scale=2.0**10, steps_per_increase=1000)
    inner = optax.adamw(LEARNING_RATE)
    tx = amp_core.with_loss_scaling(inner, cfg)
    step, reference_step = make_scaled_step(tx), make_reference_step(inner)
    params = reference = init_params()
    opt_state, reference_state = tx.init(params), inner.init(reference)
    for index in range(10):
        poison = jnp.float32(np.nan if index in (2, 3, 7) else 1.0)
        params, opt_state = step(params, opt_state, poison)
        if index not in (2, 3, 7):
            reference, reference_state = reference_step(reference, reference_state)
    assert_trees_close(params, reference, ulps=ROUNDING_ULPS)
    assert int(amp_core.loss_scale_state(opt_state).num_skipped_steps) == 3
    assert int(opt_state.inner_state[0].count) == 7


# -- the branch-free skip: donation, composition, unusual inner states ----------------------------

POISONED_STEPS = (2, 5)


def poison_at(step: int):
    return jnp.float32(np.nan) if step in POISONED_STEPS else FINITE


def params_with_special_values() -> dict:
    """init_params plus a leaf the loss ignores, holding -0.0, +0.0 and NaN, and a float16 leaf.

    (No zero in the float16 leaf: adamw's eps underflows in float16, so a zero gradient there
    gives 0 / 0.)
    """
    params = init_params()
    params["unused"] = jnp.asarray([-0.0, 0.0, np.nan, 1.5], jnp.float32)
    params["half"] = jnp.asarray([1.0, -2.0, 3.0], jnp.float16)
    return params


def loss_with_half(params):
    return loss_fn(params) + jnp.sum(params["half"].astype(jnp.float32) ** 2)


def run_steps(tx, mode: str, steps: int = 7):
    """Trains from params_with_special_values; returns each step's bits and the final trees.

    Asserts on the way that every poisoned step left the parameters bit-identical and counted
    a skipped step, and that no other step was skipped.
    """
    step_fn = make_scaled_step(tx, loss_with_half, mode=mode)
    params = params_with_special_values()
    opt_state = tx.init(params)
    history = []
    for step in range(steps):
        before = bits(params)  # read before a donating call invalidates the buffers
        skipped_before = int(amp_core.loss_scale_state(opt_state).num_skipped_steps)
        params, opt_state = step_fn(params, opt_state, poison_at(step))
        history.append(bits((params, opt_state)))
        scaler = amp_core.loss_scale_state(opt_state)
        if step in POISONED_STEPS:
            assert bits(params) == before
            assert not bool(scaler.isfinite)
            assert int(scaler.num_skipped_steps) == skipped_before + 1
        else:
            assert bool(scaler.isfinite)
    return history, params, opt_state


def test_donated_steps_equal_undonated_steps_bit_for_bit():
    """Donation changes where XLA writes, never what: every step's params and state agree."""
    cfg = amp_core.DynamicLossScale(init_scale=2.0**8, steps_per_increase=2)
    tx = amp_core.with_loss_scaling(optax.adamw(LEARNING_RATE, weight_decay=1e-2), cfg)
    donated, params, opt_state = run_steps(tx, "donate")
    assert donated == run_steps(tx, "jit")[0]
    assert np.isnan(np.asarray(params["unused"])[2])
    assert int(amp_core.loss_scale_state(opt_state).num_skipped_steps) == len(POISONED_STEPS)
    assert int(opt_state.inner_state[0].count) == 7 - len(POISONED_STEPS)


def test_skipped_steps_leave_the_inner_state_bit_identical_under_donation():
    cfg = amp_core.DynamicLossScale(init_scale=2.0**8)
    tx = amp_core.with_loss_scaling(optax.adamw(LEARNING_RATE, weight_decay=1e-2), cfg)
    step_fn = make_scaled_step(tx, loss_with_half, mode="donate")
    params = params_with_special_values()
    opt_state = tx.init(params)
    for step in range(4):
        params, opt_state = step_fn(params, opt_state, poison_at(step))
    before = bits(opt_state.inner_state)
    params, opt_state = step_fn(params, opt_state, jnp.float32(np.inf))
    assert bits(opt_state.inner_state) == before


def test_eager_run_agrees_with_the_jitted_one():
    """Without jit every primitive runs on its own: the same run, to rounding."""
    cfg = amp_core.DynamicLossScale(init_scale=2.0**8, steps_per_increase=2)
    tx = amp_core.with_loss_scaling(optax.adamw(LEARNING_RATE, weight_decay=1e-2), cfg)
    _, params, opt_state = run_steps(tx, "eager", steps=5)
    _, reference, reference_state = run_steps(tx, "jit", steps=5)
    assert_trees_close(params, reference, ulps=ROUNDING_ULPS)
    assert_trees_close(opt_state.inner_state, reference_state.inner_state, ulps=ROUNDING_ULPS)
    norm = jnp.float32(0.0)
    ours, theirs = amp_core.loss_scale_state(opt_state), amp_core.loss_scale_state(reference_state)
    assert bits(ours._replace(global_norm=norm)) == bits(theirs._replace(global_norm=norm))


def float16_rounded_once(inner: optax.GradientTransformation) -> optax.GradientTransformation:
    """``inner`` with the update of every float16 leaf computed in float32 and rounded once."""

    def widen(tree):
        return jax.tree_util.tree_map(
            lambda x: x.astype(jnp.float32) if x.dtype == jnp.float16 else x, tree
        )

    def update(grads, state, params=None):
        updates, new_state = inner.update(widen(grads), widen(state), widen(params))
        narrow = lambda new, old: new.astype(old.dtype)  # noqa: E731
        return (
            jax.tree_util.tree_map(narrow, updates, grads),
            jax.tree_util.tree_map(narrow, new_state, state),
        )

    return optax.GradientTransformation(inner.init, update)


def test_float16_rounded_elsewhere_agrees_to_float16_rounding():
    """The other rounding regime of float16, emulated, stays within ``ROUNDING_ULPS``.

    XLA:CPU rounds every float16 op on most CPUs, but computes float16 natively on CPUs with
    AVX512-FP16, where a jitted fusion rounds fewer times than the eager primitives. A machine
    has one regime only, so the far end of the other is emulated: each float16 update computed
    in float32 and rounded once, against the eager run, which rounds every op on every CPU (the
    emulation turns the eager 2.0508 of one moment into the 2.0527 that a jitted run gave on
    such a CPU).
    """
    cfg = amp_core.DynamicLossScale(init_scale=2.0**8, steps_per_increase=2)
    inner = optax.adamw(LEARNING_RATE, weight_decay=1e-2)
    _, params, opt_state = run_steps(amp_core.with_loss_scaling(inner, cfg), "eager", steps=5)
    _, fused, fused_state = run_steps(
        amp_core.with_loss_scaling(float16_rounded_once(inner), cfg), "jit", steps=5
    )
    moments, fused_moments = opt_state.inner_state[0], fused_state.inner_state[0]
    half_moments = (moments.mu["half"], moments.nu["half"])
    assert bits(half_moments) != bits((fused_moments.mu["half"], fused_moments.nu["half"]))
    assert_trees_close(fused, params, ulps=ROUNDING_ULPS)
    assert_trees_close(fused_state.inner_state, opt_state.inner_state, ulps=ROUNDING_ULPS)


@pytest.mark.parametrize("mode", ["eager", "jit", "donate"])
def test_skip_inside_optax_chain_leaves_params_bit_identical(mode):
    """Loss scaling first in a chain: what follows sees -0.0 updates and keeps them -0.0."""
    cfg = amp_core.DynamicLossScale(init_scale=2.0**8)
    wrapped = amp_core.with_loss_scaling(optax.adamw(LEARNING_RATE), cfg)
    tx = optax.chain(optax.scale(1.0), wrapped, optax.scale(0.5), optax.clip(1.0))
    with pytest.warns(UserWarning, match="element 1 of an optax.chain"):  # harmless: linear
        _, _, opt_state = run_steps(tx, mode, steps=4)
    assert int(amp_core.loss_scale_state(opt_state).num_skipped_steps) == 1
    assert int(opt_state[1].inner_state[0].count) == 3


def test_chain_matches_the_same_chain_on_the_unscaled_loss():
    cfg = amp_core.DynamicLossScale(init_scale=2.0**8, steps_per_increase=3)
    inner = optax.chain(optax.scale_by_adam(), optax.add_decayed_weights(1e-2))
    tx = optax.chain(amp_core.with_loss_scaling(inner, cfg), optax.scale(-LEARNING_RATE))
    reference_tx = optax.chain(inner, optax.scale(-LEARNING_RATE))
    step, reference_step = make_scaled_step(tx, mode="donate"), make_reference_step(reference_tx)
    params, reference = init_params(), init_params()
    opt_state, reference_state = tx.init(params), reference_tx.init(reference)
    for index in range(8):
        params, opt_state = step(params, opt_state, poison_at(index))
        if index not in POISONED_STEPS:
            reference, reference_state = reference_step(reference, reference_state)
    assert_trees_close(params, reference, ulps=ROUNDING_ULPS)


@pytest.mark.parametrize(
    "inner",
    [
        optax.adamw(LEARNING_RATE, weight_decay=1e-2),
        optax.sgd(LEARNING_RATE, momentum=0.9, nesterov=True),
        optax.GradientTransformation(
            optax.adam(LEARNING_RATE).init, jax.jit(optax.adam(LEARNING_RATE).update)
        ),
    ],
    ids=["adamw", "sgd-nesterov", "jitted-adam"],
)
def test_donated_step_needs_no_parameter_sized_temporary(inner):
    """The skip costs no extra pass over memory: no buffer the size of the parameters.

    With ``lax.cond`` the updates left the branch as a whole temporary array (as large as the
    parameters, fresh memory on every call); selecting only at the end made XLA copy every
    moment first. Selecting each state leaf where it is defined (inside a nested ``jit`` too)
    lets XLA write moments and parameters in place, as for the plain optimizer. The overflow
    check reads one leaf at a time: on the CPU, at most one leaf's unscaled copy is alive.
    """
    params = {f"w{i}": jnp.ones((256, 256 + i), jnp.float32) for i in range(8)}
    tx = amp_core.with_loss_scaling(inner, amp_core.DynamicLossScale())

    def step(params, opt_state, grads):
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state

    compiled = jax.jit(step, donate_argnums=(0, 1)).lower(params, tx.init(params), params).compile()
    memory = compiled.memory_analysis()
    if memory is None:
        pytest.skip("this backend reports no memory analysis")
    largest = max(leaf.nbytes for leaf in jax.tree_util.tree_leaves(params))
    assert memory.temp_size_in_bytes < 1.25 * largest


def test_jitted_inner_update_matches_the_plain_one():
    cfg = amp_core.DynamicLossScale(init_scale=2.0**8)
    inner = optax.adam(LEARNING_RATE)
    jitted = optax.GradientTransformation(inner.init, jax.jit(inner.update))
    _, params, _ = run_steps(amp_core.with_loss_scaling(jitted, cfg), "donate")
    _, reference, _ = run_steps(amp_core.with_loss_scaling(inner, cfg), "donate")
    assert_trees_close(params, reference, ulps=ROUNDING_ULPS)


class OddState(NamedTuple):
    previous: dict  # the incoming gradient itself
    twin_a: dict  # one computed value returned as two leaves
    twin_b: dict
    untouched: jax.Array  # returned as given
    constant: jax.Array  # a fresh constant every step
    count: jax.Array


def odd_transformation() -> optax.GradientTransformation:
    """A transformation whose state outputs are every kind of jaxpr output there is."""

    def init(params):
        zeros = jax.tree_util.tree_map(jnp.zeros_like, params)
        return OddState(zeros, zeros, zeros, jnp.float32(7.0), jnp.float32(0.0), jnp.int32(0))

    def update(grads, state, params=None):
        del params
        twin = jax.tree_util.tree_map(lambda g, p: 0.5 * p + g, grads, state.previous)
        updates = jax.tree_util.tree_map(lambda t: -0.1 * t, twin)
        constant = jnp.ones((), jnp.float32)
        return updates, OddState(grads, twin, twin, state.untouched, constant, state.count + 1)

    return optax.GradientTransformation(init, update)


@pytest.mark.parametrize("mode", ["eager", "jit"])
def test_unusual_state_outputs_are_kept_on_overflow_and_updated_otherwise(mode):
    cfg = amp_core.DynamicLossScale(init_scale=2.0**4)
    tx = amp_core.with_loss_scaling(odd_transformation(), cfg)
    update = tx.update if mode == "eager" else jax.jit(tx.update)
    params = {"w": jnp.asarray([1.0, -0.0], jnp.float32)}
    state = tx.init(params)
    updates, state = update({"w": jnp.asarray([16.0, 32.0], jnp.float32)}, state, params)
    np.testing.assert_array_equal(np.asarray(updates["w"]), np.float32([-0.1, -0.2]))
    inner = state.inner_state
    np.testing.assert_array_equal(np.asarray(inner.previous["w"]), [1.0, 2.0])
    assert bits(inner.twin_a) == bits(inner.twin_b)
    assert (float(inner.untouched), float(inner.constant), int(inner.count)) == (7.0, 1.0, 1)

    before = bits(state.inner_state)
    bad = {"w": jnp.asarray([np.inf, 32.0], jnp.float32)}
    updates, state = update(bad, state, params)
    assert bits(optax.apply_updates(params, updates)) == bits(params)
    assert bits(state.inner_state) == before


def every_other_step(inner: optax.GradientTransformation) -> optax.GradientTransformation:
    """``inner`` applied on even steps only, its state updated under a ``lax.cond``."""

    def init(params):
        return inner.init(params), jnp.zeros((), jnp.int32)

    def update(grads, state, params=None):
        inner_state, count = state

        def apply(_):
            return inner.update(grads, inner_state, params)

        def hold(_):
            return jax.tree.map(jnp.zeros_like, grads), inner_state

        updates, inner_state = jax.lax.cond(count % 2 == 0, apply, hold, None)
        return updates, (inner_state, count + 1)

    return optax.GradientTransformation(init, update)


def test_inner_state_updated_inside_control_flow():
    """An inner transformation that updates its state under its own lax.cond."""
    cfg = amp_core.DynamicLossScale(init_scale=2.0**8)
    inner = every_other_step(optax.adam(LEARNING_RATE))
    tx = amp_core.with_loss_scaling(inner, cfg)
    step, reference_step = make_scaled_step(tx, mode="donate"), make_reference_step(inner)
    params, reference = init_params(), init_params()
    opt_state, reference_state = tx.init(params), inner.init(reference)
    for index in range(9):
        before = bits((params, opt_state.inner_state))
        params, opt_state = step(params, opt_state, poison_at(index))
        if index in POISONED_STEPS:
            assert bits((params, opt_state.inner_state)) == before
        else:
            reference, reference_state = reference_step(reference, reference_state)
    assert_trees_close(params, reference, ulps=ROUNDING_ULPS)
    assert int(opt_state.inner_state[1]) == int(reference_state[1])


def test_extra_arguments_reach_the_inner_update_under_jit():
    def update(updates, state, params=None, *, factor):
        del params
        return jax.tree_util.tree_map(lambda g: -factor * g, updates), state

    inner = optax.GradientTransformationExtraArgs(lambda params: optax.EmptyState(), update)
    cfg = amp_core.DynamicLossScale(init_scale=2.0**4)
    tx = amp_core.with_loss_scaling(inner, cfg)
    grads = {"w": jnp.asarray([16.0, -32.0], jnp.float32)}
    state = tx.init(grads)

    @jax.jit
    def step(grads, state, factor):
        return tx.update(grads, state, None, factor=factor)

    updates, _ = step(grads, state, jnp.float32(0.5))
    np.testing.assert_array_equal(np.asarray(updates["w"]), [-0.5, 1.0])


def test_one_trace_for_finite_and_skipped_steps():
    cfg = amp_core.DynamicLossScale(init_scale=2.0**8, steps_per_increase=1)
    tx = amp_core.with_loss_scaling(optax.adamw(LEARNING_RATE), cfg)
    traces = []

    def step(params, opt_state, poison):
        traces.append(1)
        grads = jax.tree_util.tree_map(lambda p: p * poison, params)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state

    step = jax.jit(step, donate_argnums=(0, 1))
    params = init_params()
    opt_state = tx.init(params)
    for index in range(6):
        params, opt_state = step(params, opt_state, poison_at(index))
    assert len(traces) == 1


# -- GCC ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("max_norm", [0.05, 1e3])
def test_gcc_matches_clip_by_global_norm_then_adamw(max_norm):
    """optax clips by ``max_norm / norm`` where torch and SPEC use ``max_norm / (norm + 1e-6)``."""
    cfg = amp_core.DynamicLossScale(
        init_scale=2.0**6, steps_per_increase=3, max_loss_scale=2.0**10, max_gradient_norm=max_norm
    )
    inner = optax.adamw(LEARNING_RATE)
    step = make_scaled_step(amp_core.with_loss_scaling(inner, cfg))
    reference_tx = optax.chain(optax.clip_by_global_norm(max_norm), inner)
    reference_step = make_reference_step(reference_tx)
    params = reference = init_params()
    opt_state = amp_core.with_loss_scaling(inner, cfg).init(params)
    reference_state = reference_tx.init(reference)
    for _ in range(8):
        params, opt_state = step(params, opt_state, FINITE)
        reference, reference_state = reference_step(reference, reference_state)
    assert_trees_close(params, reference, ulps=ROUNDING_ULPS)
    scaler = amp_core.loss_scale_state(opt_state)
    assert np.isfinite(float(scaler.global_norm))
    if max_norm < 1:
        assert float(scaler.global_norm) > max_norm  # clipping was really active


def test_gcc_clipped_gradients_reach_the_inner_optimizer():
    """With plain SGD the update is ``-lr * clipped grad``: check the clip directly."""
    cfg = amp_core.DynamicLossScale(init_scale=2.0**4, max_gradient_norm=1.0)
    tx = amp_core.with_loss_scaling(optax.sgd(1.0), cfg)
    params = {"w": jnp.zeros((2,), jnp.float32)}
    grads = {"w": jnp.array([30.0, 40.0], jnp.float32) * 16}
    updates, state = tx.update(grads, tx.init(params), params)
    np.testing.assert_allclose(np.asarray(updates["w"]), [-0.6, -0.8], rtol=1e-6)
    assert float(amp_core.loss_scale_state(state).global_norm) == 50.0


# -- finding the scaler state ---------------------------------------------------------------------


def test_loss_scale_state_is_found_inside_optax_chain():
    cfg = amp_core.DynamicLossScale(init_scale=2.0**5, overflow_tolerance=0.0)
    tx = optax.chain(
        optax.scale(1.0), amp_core.with_loss_scaling(optax.sgd(0.1), cfg), optax.scale(1.0)
    )
    params = {"w": jnp.ones((3,), jnp.float32)}
    with pytest.warns(UserWarning, match="element 1 of an optax.chain"):
        state = tx.init(params)
    assert float(amp_core.loss_scale_state(state).loss_scale) == 32.0
    _, state = tx.update({"w": jnp.array([1.0, np.inf, 0.0], jnp.float32)}, state, params)
    scaler = amp_core.loss_scale_state(state)
    assert float(scaler.loss_scale) == 16.0
    assert int(scaler.num_skipped_steps) == 1


def test_loss_scale_state_of_the_wrapper_own_state():
    cfg = amp_core.DynamicLossScale()
    state = amp_core.with_loss_scaling(optax.sgd(0.1), cfg).init({"w": jnp.zeros(2)})
    assert isinstance(state, amp_core.LossScaledState)
    assert amp_core.loss_scale_state(state) is state.scaler


def test_loss_scale_state_rejects_states_without_or_with_two_scalers():
    params = {"w": jnp.zeros(2)}
    with pytest.raises(ValueError, match="found 0"):
        amp_core.loss_scale_state(optax.adamw(0.1).init(params))
    wrapped = amp_core.with_loss_scaling(optax.sgd(0.1), amp_core.DynamicLossScale())
    with pytest.raises(ValueError, match="found 2"):
        amp_core.loss_scale_state(optax.chain(wrapped, wrapped).init(params))


def test_wrapper_rejects_what_is_not_a_gradient_transformation():
    with pytest.raises(TypeError, match="inner"):
        amp_core.with_loss_scaling(lambda g: g, amp_core.DynamicLossScale())


# -- static scaling -------------------------------------------------------------------------------


def test_static_config_never_skips_even_with_inf_gradients():
    tx = amp_core.with_loss_scaling(optax.sgd(0.1), amp_core.StaticLossScale(1.0))
    params = {"w": jnp.ones((3,), jnp.float32)}
    state = tx.init(params)
    updates, state = tx.update({"w": jnp.array([1.0, np.inf, np.nan], jnp.float32)}, state, params)
    new_params = optax.apply_updates(params, updates)
    expected = np.float32(1) - np.float32(0.1) * np.array([1.0, np.inf, np.nan], np.float32)
    np.testing.assert_array_equal(np.asarray(new_params["w"]), expected)
    scaler = amp_core.loss_scale_state(state)
    assert bool(scaler.isfinite)
    assert int(scaler.num_skipped_steps) == 0
    assert float(scaler.loss_scale) == 1.0


def test_static_scale_matches_unscaled_training():
    inner = optax.adamw(LEARNING_RATE)
    tx = amp_core.with_loss_scaling(inner, amp_core.StaticLossScale(2.0**7))
    step, reference_step = make_scaled_step(tx), make_reference_step(inner)
    params = reference = init_params()
    opt_state, reference_state = tx.init(params), inner.init(reference)
    for _ in range(5):
        params, opt_state = step(params, opt_state, FINITE)
        reference, reference_state = reference_step(reference, reference_state)
    assert_trees_close(params, reference, ulps=ROUNDING_ULPS)
    assert float(amp_core.loss_scale_state(opt_state).loss_scale) == 2.0**7


# -- value_and_grad -------------------------------------------------------------------------------

VG_CONFIG = amp_core.DynamicLossScale(init_scale=2.0**12)


def test_value_and_grad_returns_unscaled_value_and_grads():
    grad_fn = amp_core.value_and_grad(loss_fn, VG_CONFIG)
    params = init_params()
    value, grads, isfinite, norm = grad_fn(amp_core.init(VG_CONFIG), params)
    expected_value, expected_grads = jax.value_and_grad(loss_fn)(params)
    assert float(value) == float(expected_value)
    assert_trees_close(grads, expected_grads, ulps=ROUNDING_ULPS)
    assert bool(isfinite)
    flat = np.concatenate([np.ravel(g) for g in jax.tree_util.tree_leaves(expected_grads)])
    np.testing.assert_allclose(float(norm), np.linalg.norm(flat.astype(np.float64)), rtol=1e-5)


def test_value_and_grad_with_aux():
    def fun(params):
        loss = loss_fn(params)
        return loss, {"doubled": 2 * loss}

    grad_fn = jax.jit(amp_core.value_and_grad(fun, VG_CONFIG, has_aux=True))
    (value, aux), grads, isfinite, _ = grad_fn(amp_core.init(VG_CONFIG), init_params())
    (expected_value, expected_aux), expected_grads = jax.value_and_grad(fun, has_aux=True)(
        init_params()
    )
    np.testing.assert_allclose(float(value), float(expected_value), rtol=1e-6)
    np.testing.assert_allclose(float(aux["doubled"]), float(expected_aux["doubled"]), rtol=1e-6)
    assert_trees_close(grads, expected_grads, ulps=ROUNDING_ULPS)
    assert bool(isfinite)


def test_value_and_grad_with_integer_argnums_and_keyword_arguments():
    def fun(x, params, *, y):
        return loss_fn(params, x, y)

    grad_fn = amp_core.value_and_grad(fun, VG_CONFIG, argnums=1)
    _, grads, _, _ = grad_fn(amp_core.init(VG_CONFIG), X, init_params(), y=Y)
    expected = jax.grad(fun, argnums=1)(X, init_params(), y=Y)
    assert jax.tree_util.tree_structure(grads) == jax.tree_util.tree_structure(expected)
    assert_trees_close(grads, expected, ulps=ROUNDING_ULPS)


def test_value_and_grad_with_tuple_argnums():
    def fun(x, params):
        return loss_fn(params, x)

    grad_fn = amp_core.value_and_grad(fun, VG_CONFIG, argnums=(0, 1))
    _, grads, isfinite, norm = grad_fn(amp_core.init(VG_CONFIG), X, init_params())
    expected = jax.grad(fun, argnums=(0, 1))(X, init_params())
    assert isinstance(grads, tuple) and len(grads) == 2
    assert_trees_close(grads, expected, ulps=ROUNDING_ULPS)
    flat = np.concatenate([np.ravel(g) for g in jax.tree_util.tree_leaves(expected)])
    np.testing.assert_allclose(float(norm), np.linalg.norm(flat.astype(np.float64)), rtol=1e-5)
    assert bool(isfinite)


def test_value_and_grad_reports_float16_overflow_of_a_large_scale():
    """The cbfloat16 default scale (2**31) overflows a float16 backward pass."""
    cfg = amp_core.DynamicLossScale(half_dtype="cbfloat16")

    def fun(w):
        return jnp.sum(w.astype(jnp.float16) ** 2).astype(jnp.float32)

    w = jnp.array([1.0, 2.0], jnp.float32)
    grad_fn = amp_core.value_and_grad(fun, cfg)
    value, _, isfinite, _ = grad_fn(amp_core.init(cfg), w)
    assert float(value) == 5.0
    assert not bool(isfinite)
    small = amp_core.DynamicLossScale(init_scale=2.0**8)
    _, grads, isfinite, _ = amp_core.value_and_grad(fun, small)(amp_core.init(small), w)
    assert bool(isfinite)
    np.testing.assert_array_equal(np.asarray(grads), [2.0, 4.0])


def test_value_and_grad_clips_with_gcc():
    cfg = amp_core.DynamicLossScale(init_scale=2.0**4, max_gradient_norm=1.0)

    def fun(w):
        return jnp.sum(jnp.array([30.0, 40.0], jnp.float32) * w)

    _, grads, isfinite, norm = amp_core.value_and_grad(fun, cfg)(
        amp_core.init(cfg), jnp.zeros((2,), jnp.float32)
    )
    assert bool(isfinite)
    assert float(norm) == 50.0
    np.testing.assert_allclose(np.asarray(grads), [0.6, 0.8], rtol=1e-6)


def test_value_and_grad_with_static_scale_never_reports_overflow():
    cfg = amp_core.StaticLossScale(2.0)

    def fun(w):
        return jnp.sum(w * jnp.array([np.inf, 1.0], jnp.float32))

    _, grads, isfinite, _ = amp_core.value_and_grad(fun, cfg)(
        amp_core.init(cfg), jnp.ones((2,), jnp.float32)
    )
    assert bool(isfinite)
    np.testing.assert_array_equal(np.asarray(grads), [np.inf, 1.0])


def test_wrapper_itself_passes_strict_dtype_promotion():
    """The module runs under standard promotion for adamw; the wrapper's own code is strict."""
    cfg = amp_core.DynamicLossScale(init_scale=2.0**10, max_gradient_norm=1.0)
    tx = amp_core.with_loss_scaling(optax.sgd(0.1), cfg)
    params = {"w": jnp.ones((3,), jnp.float32), "h": jnp.ones((2,), jnp.float16)}
    with jax.numpy_dtype_promotion("strict"):
        state = tx.init(params)
        for bad in (1.0, np.inf):
            grads = {"w": jnp.array([1.0, bad, 2.0], jnp.float32), "h": jnp.ones((2,), jnp.float16)}
            updates, state = jax.jit(tx.update)(grads, state, params)
            params = optax.apply_updates(params, updates)
    assert params["h"].dtype == jnp.float16
    assert int(amp_core.loss_scale_state(state).num_skipped_steps) == 1


# -- apply_scaled_gradients: the fused fast path ---------------------------------------------------


def test_apply_scaled_gradients_matches_the_wrapper_then_apply_updates():
    cfg = amp_core.DynamicLossScale(init_scale=2.0**8, steps_per_increase=2, max_loss_scale=2.0**14)
    inner = optax.adamw(LEARNING_RATE, weight_decay=1e-2)
    tx = amp_core.with_loss_scaling(inner, cfg)
    wrapper_step = make_scaled_step(tx)

    @jax.jit
    def fused_step(params, opt_state, poison):
        scaler = amp_core.loss_scale_state(opt_state)
        grads = jax.grad(lambda p: amp_core.scale_loss(scaler, loss_fn(p)))(params)
        grads = jax.tree_util.tree_map(lambda g: g * poison.astype(g.dtype), grads)
        return amp_core.apply_scaled_gradients(inner, cfg, grads, opt_state, params)

    params = fused = init_params()
    opt_state = fused_state = tx.init(params)
    for step in range(12):
        poison = jnp.float32(np.inf) if step in (4, 9) else FINITE
        params, opt_state = wrapper_step(params, opt_state, poison)
        before = bits((fused, fused_state.inner_state))
        fused, fused_state = fused_step(fused, fused_state, poison)
        if step in (4, 9):  # skipped: bit-identical parameters and inner state
            assert bits((fused, fused_state.inner_state)) == before
    assert_trees_close(fused, params, ulps=ROUNDING_ULPS)
    assert_trees_close(fused_state.inner_state, opt_state.inner_state, ulps=ROUNDING_ULPS)
    ours, theirs = amp_core.loss_scale_state(fused_state), amp_core.loss_scale_state(opt_state)
    # The two paths compile to different fusions, so parameters (and with them the last
    # gradient norm) agree to rounding only; every decision and counter agrees exactly.
    norm = jnp.float32(0.0)
    assert bits(ours._replace(global_norm=norm)) == bits(theirs._replace(global_norm=norm))
    np.testing.assert_allclose(float(ours.global_norm), float(theirs.global_norm), rtol=1e-5)
    assert int(ours.num_skipped_steps) == 2


def test_apply_scaled_gradients_rejects_a_plain_optimizer_state():
    inner = optax.sgd(0.1)
    params = init_params()
    with pytest.raises(TypeError, match="opt_state must be the LossScaledState"):
        amp_core.apply_scaled_gradients(
            inner, amp_core.DynamicLossScale(), params, inner.init(params), params
        )


def test_apply_scaled_gradients_with_static_scale_never_skips():
    cfg = amp_core.StaticLossScale(loss_scale=4.0)
    inner = optax.sgd(0.5)
    params = {"w": jnp.ones(2)}
    state = amp_core.with_loss_scaling(inner, cfg).init(params)
    grads = {"w": jnp.array([4.0, jnp.inf])}
    new_params, _ = amp_core.apply_scaled_gradients(inner, cfg, grads, state, params)
    assert new_params["w"].tolist() == [0.5, -np.inf]


@pytest.mark.parametrize(
    ("inner", "config", "message"),
    [
        (
            lambda g: g,
            amp_core.DynamicLossScale(),
            r"inner must be an optax\.GradientTransformation",
        ),
        (
            optax.sgd(0.1),
            {"loss_scale": "dynamic"},
            r"config must be an amp_core\.DynamicLossScale.*dict",
        ),
    ],
    ids=["inner", "config"],
)
def test_with_loss_scaling_rejects_what_is_not_a_transformation_or_a_config(inner, config, message):
    with pytest.raises(TypeError, match=message):
        amp_core.with_loss_scaling(inner, config)


# -- composition: the scaler wraps everything that reads gradient values -------------------------


def test_clipping_inside_the_scaler_clips_the_unscaled_gradients_and_outside_warns():
    """The issue's numbers: at scale 2**10, clipping outside clips the scaled gradients."""
    cfg = amp_core.DynamicLossScale(init_scale=2.0**10)
    params = {"w": jnp.zeros(3)}
    grads = {"w": jnp.array([1.0, 2.0, 2.0]) * 2.0**10}  # unscaled norm 3, clipped to 1
    right = amp_core.with_loss_scaling(
        optax.chain(optax.clip_by_global_norm(1.0), optax.sgd(0.1)), cfg
    )
    wrong = optax.chain(
        optax.clip_by_global_norm(1.0), amp_core.with_loss_scaling(optax.sgd(0.1), cfg)
    )
    right_updates, _ = right.update(grads, right.init(params), params)
    np.testing.assert_allclose(right_updates["w"], -0.1 * np.array([1.0, 2.0, 2.0]) / 3, rtol=1e-6)
    with pytest.warns(UserWarning, match=r"with_loss_scaling\(optax\.chain\("):
        wrong_state = wrong.init(params)
    wrong_updates, _ = wrong.update(grads, wrong_state, params)
    np.testing.assert_allclose(wrong_updates["w"], right_updates["w"] / 2.0**10, rtol=1e-6)


def test_the_order_warning_reaches_through_nested_chains_and_spares_the_right_orders():
    cfg = amp_core.DynamicLossScale()
    scaled = amp_core.with_loss_scaling(optax.sgd(0.1), cfg)
    params = {"w": jnp.zeros(2)}
    nested = optax.chain(optax.clip_by_global_norm(1.0), optax.chain(scaled, optax.scale(1.0)))
    with pytest.warns(UserWarning, match="element 1 of an optax.chain"):
        nested.init(params)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        optax.chain(scaled, optax.scale(0.5)).init(params)
        optax.chain(optax.chain(scaled), optax.scale(0.5)).init(params)
        amp_core.with_loss_scaling(optax.chain(optax.clip(1.0), optax.sgd(0.1)), cfg).init(params)
