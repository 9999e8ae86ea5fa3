"""Gradient accumulation with loss scaling: one decision per accumulated step (SPEC section 11).

Every way a JAX user accumulates (``optax.MultiSteps`` around the scaler, ``lax.scan`` and a
Python loop inside one jit, flax NNX, flax linen, equinox) trains one linear model over the same
micro-batches, some of them overflowed, and must give the same skipped steps, scales and
parameters. Oracles: a hand-computed trace of the update rule, and SGD over the applied steps'
mean gradients computed in float64 NumPy from the analytic gradient of the model's loss.
"""

from __future__ import annotations

from collections.abc import Callable

import equinox as eqx
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from amp_helpers import assert_trees_bitwise_equal
from flax import nnx

import amp_core
from amp_core.flax_linen import LossScaledTrainState
from amp_core.flax_nnx import LossScaledOptimizer

DTYPE_PROMOTION = "standard"  # optax's adamw (see test_optax.py)

K = 4  # micro-batches per accumulated step
STEPS = 4  # accumulated steps
BATCH, IN, OUT = 8, 4, 2
LR = 0.1
CONFIG = amp_core.DynamicLossScale(init_scale=1024.0, steps_per_increase=1)
RNG = np.random.default_rng(33)
XS = RNG.standard_normal((STEPS * K, BATCH, IN)).astype(np.float32)
YS = RNG.standard_normal((STEPS * K, BATCH, OUT)).astype(np.float32)
W0 = (RNG.standard_normal((IN, OUT)) * 0.5).astype(np.float32)
B0 = (RNG.standard_normal((OUT,)) * 0.1).astype(np.float32)
POISONED = (1, 14)  # micro-batches whose loss is multiplied by inf: in steps 0 and 3
POISON = np.array([np.inf if i in POISONED else 1.0 for i in range(STEPS * K)], np.float32)

# The hand-computed trace (steps_per_increase=1, overflow_tolerance=0): step 0 overflows
# (1024 -> 512, counters reset); step 1 applies (steps=1, 1 < 1 is false: no growth); step 2
# applies (steps=2 > 1: doubles to 1024, counters reset); step 3 overflows (-> 512).
EXPECTED_APPLIED = [False, True, True, False]
EXPECTED_SCALE_USED = [1024.0, 512.0, 512.0, 1024.0]
EXPECTED_SCALE_AFTER = [512.0, 512.0, 1024.0, 512.0]
EXPECTED_SKIPPED = [1, 1, 1, 2]


def oracle_params() -> list[tuple[np.ndarray, np.ndarray]]:
    """(W, b) after each accumulated step: SGD on the mean gradient of the applied steps only.

    loss = mean((x @ W + b - y)**2) over BATCH * OUT elements, so with r = x @ W + b - y:
    dW = 2 x^T r / (BATCH * OUT), db = 2 sum(r) / (BATCH * OUT); float64 throughout.
    """
    w, b = W0.astype(np.float64), B0.astype(np.float64)
    trace = []
    for step in range(STEPS):
        if EXPECTED_APPLIED[step]:
            dw, db = np.zeros_like(w), np.zeros_like(b)
            for i in range(step * K, (step + 1) * K):
                x, y = XS[i].astype(np.float64), YS[i].astype(np.float64)
                r = x @ w + b - y
                dw += 2 * x.T @ r / (BATCH * OUT) / K
                db += 2 * r.sum(axis=0) / (BATCH * OUT) / K
            w, b = w - LR * dw, b - LR * db
        trace.append((w, b))
    return trace


def linear_loss(w, b, x, y):
    return jnp.mean((x @ w + b - y) ** 2)


class Record:
    """What a pattern reports after each accumulated step."""

    def __init__(self) -> None:
        self.params: list[tuple[np.ndarray, np.ndarray]] = []
        self.scales_after: list[float] = []
        self.skipped: list[int] = []
        self.applied: list[bool] = []
        self.bits: list[list[bytes]] = []

    def add(self, w, b, scaler, applied) -> None:
        w, b = np.asarray(w), np.asarray(b)
        self.params.append((w, b))
        self.bits.append([w.tobytes(), b.tobytes()])
        self.scales_after.append(float(scaler.loss_scale))
        self.skipped.append(int(scaler.num_skipped_steps))
        self.applied.append(bool(applied))


def micro_batches(step: int):
    sl = slice(step * K, (step + 1) * K)
    return jnp.asarray(XS[sl]), jnp.asarray(YS[sl]), jnp.asarray(POISON[sl])


def dict_params():
    return {"w": jnp.asarray(W0), "b": jnp.asarray(B0)}


def scaled_micro_loss(scaler, p, x, y, poison):
    # torch's loop: scale(loss / k); an overflowed micro-batch has its loss multiplied by inf.
    return amp_core.scale_loss(scaler, linear_loss(p["w"], p["b"], x, y) * poison / K)


# --- the patterns ------------------------------------------------------------------------------


def run_multi_steps(as_gradient_transformation: bool) -> Record:
    multi_steps = optax.MultiSteps(optax.sgd(LR), K)  # the mean of the micro-batch gradients
    inner = multi_steps.gradient_transformation() if as_gradient_transformation else multi_steps
    tx = amp_core.with_loss_scaling(inner, CONFIG)
    params = dict_params()
    opt_state = tx.init(params)

    @jax.jit
    def micro_step(params, opt_state, x, y, poison):
        scaler = amp_core.loss_scale_state(opt_state)
        grads = jax.grad(scaled_micro_loss, argnums=1)(scaler, params, x, y, poison * K)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state

    record = Record()
    for step in range(STEPS):
        xs, ys, poisons = micro_batches(step)
        for i in range(K):
            scale = float(amp_core.loss_scale_state(opt_state).loss_scale)
            assert scale == EXPECTED_SCALE_USED[step]  # the scale read at the step's start
            params, opt_state = micro_step(params, opt_state, xs[i], ys[i], poisons[i])
            if i < K - 1:
                assert not bool(amp_core.step_applied(opt_state))
        # The next accumulated step starts from a clean accumulator.
        assert all(bool((acc == 0).all()) for acc in jax.tree.leaves(opt_state.acc_grads))
        scaler = amp_core.loss_scale_state(opt_state)
        record.add(params["w"], params["b"], scaler, amp_core.step_applied(opt_state))
    assert micro_step._cache_size() == 1
    return record


def scaled_sum_of_micro_batches(scaler, params, xs, ys, poisons, *, scan: bool):
    grad = jax.grad(lambda p, x, y, poison: scaled_micro_loss(scaler, p, x, y, poison))
    if scan:

        def body(acc, batch):
            return jax.tree.map(jnp.add, acc, grad(params, *batch)), None

        zeros = jax.tree.map(jnp.zeros_like, params)
        return jax.lax.scan(body, zeros, (xs, ys, poisons))[0]
    acc = None
    for i in range(K):
        g = grad(params, xs[i], ys[i], poisons[i])
        acc = g if acc is None else jax.tree.map(jnp.add, acc, g)
    return acc


def run_in_one_jit(scan: bool, whole_step: bool) -> Record:
    inner = optax.sgd(LR)
    tx = amp_core.with_loss_scaling(inner, CONFIG)
    params = dict_params()
    opt_state = tx.init(params)

    @jax.jit
    def accumulated_step(params, opt_state, xs, ys, poisons):
        scaler = amp_core.loss_scale_state(opt_state)
        grads = scaled_sum_of_micro_batches(scaler, params, xs, ys, poisons, scan=scan)
        if whole_step:
            return amp_core.apply_scaled_gradients(inner, CONFIG, grads, opt_state, params)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state

    record = Record()
    for step in range(STEPS):
        params, opt_state = accumulated_step(params, opt_state, *micro_batches(step))
        scaler = amp_core.loss_scale_state(opt_state)
        record.add(params["w"], params["b"], scaler, amp_core.step_applied(opt_state))
    return record


def make_nnx_model() -> nnx.Linear:
    model = nnx.Linear(IN, OUT, rngs=nnx.Rngs(0))
    model.kernel[...] = jnp.asarray(W0)
    model.bias[...] = jnp.asarray(B0)
    return model


def nnx_scaled_loss(optimizer, model, x, y, poison, k=1):
    return optimizer.scale_loss(jnp.mean((model(x) - y) ** 2) * poison / k)


def run_nnx(multi_steps: bool) -> Record:
    model = make_nnx_model()
    tx = optax.MultiSteps(optax.sgd(LR), K) if multi_steps else optax.sgd(LR)
    optimizer = LossScaledOptimizer(model, tx, CONFIG, wrt=nnx.Param)

    @nnx.jit
    def micro_step(model, optimizer, x, y, poison):
        grads = nnx.grad(lambda m: nnx_scaled_loss(optimizer, m, x, y, poison))(model)
        return optimizer.update(model, grads)

    @nnx.jit
    def accumulated_step(model, optimizer, xs, ys, poisons):
        acc = None
        for i in range(K):
            g = nnx.grad(nnx_scaled_loss, argnums=1)(optimizer, model, xs[i], ys[i], poisons[i], K)
            acc = g if acc is None else jax.tree.map(jnp.add, acc, g)
        return optimizer.update(model, acc)

    record = Record()
    for step in range(STEPS):
        xs, ys, poisons = micro_batches(step)
        steps_before = int(optimizer.step)
        if multi_steps:
            flags = [bool(micro_step(model, optimizer, xs[i], ys[i], poisons[i])) for i in range(K)]
            assert not any(flags[:-1])  # micro-batches that only accumulate apply nothing
            applied = flags[-1]
        else:
            applied = bool(accumulated_step(model, optimizer, xs, ys, poisons))
        assert int(optimizer.step) == steps_before + applied
        record.add(model.kernel[...], model.bias[...], optimizer.scaler, applied)
    return record


def run_linen(multi_steps: bool) -> Record:
    module = nn.Dense(OUT)
    tx = optax.MultiSteps(optax.sgd(LR), K) if multi_steps else optax.sgd(LR)
    state = LossScaledTrainState.create(
        apply_fn=module.apply,
        params={"kernel": jnp.asarray(W0), "bias": jnp.asarray(B0)},
        tx=tx,
        config=CONFIG,
    )

    def grads_of(state, params, x, y, poison, k=1):
        def scaled(p):
            loss = jnp.mean((state.apply_fn({"params": p}, x) - y) ** 2)
            return state.scale_loss(loss * poison / k)

        return jax.grad(scaled)(params)

    @jax.jit
    def micro_step(state, x, y, poison):
        return state.apply_gradients(grads=grads_of(state, state.params, x, y, poison))

    @jax.jit
    def accumulated_step(state, xs, ys, poisons):
        def body(acc, batch):
            return jax.tree.map(jnp.add, acc, grads_of(state, state.params, *batch, K)), None

        zeros = jax.tree.map(jnp.zeros_like, state.params)
        grads = jax.lax.scan(body, zeros, (xs, ys, poisons))[0]
        return state.apply_gradients(grads=grads)

    record = Record()
    for step in range(STEPS):
        xs, ys, poisons = micro_batches(step)
        steps_before = int(state.step)
        if multi_steps:
            for i in range(K):
                state = micro_step(state, xs[i], ys[i], poisons[i])
        else:
            state = accumulated_step(state, xs, ys, poisons)
        applied = bool(amp_core.step_applied(state))
        assert int(state.step) == steps_before + applied
        record.add(state.params["kernel"], state.params["bias"], state.scaler, applied)
    return record


def make_eqx_model() -> eqx.nn.Linear:
    model = eqx.nn.Linear(IN, OUT, key=jax.random.PRNGKey(0))
    return eqx.tree_at(lambda m: (m.weight, m.bias), model, (jnp.asarray(W0.T), jnp.asarray(B0)))


def eqx_loss(model, x, y):
    return jnp.mean((jax.vmap(model)(x) - y) ** 2)


def run_equinox(multi_steps: bool) -> Record:
    model = make_eqx_model()
    inner = optax.MultiSteps(optax.sgd(LR), K) if multi_steps else optax.sgd(LR)
    tx = amp_core.with_loss_scaling(inner, CONFIG)
    opt_state = tx.init(eqx.filter(model, eqx.is_inexact_array))

    def scaled_grads(model, scaler, x, y, poison, k=1):
        def loss(m):
            return amp_core.scale_loss(scaler, eqx_loss(m, x, y) * poison / k)

        return eqx.filter_grad(loss)(model)

    @eqx.filter_jit
    def micro_step(model, opt_state, x, y, poison):
        grads = scaled_grads(model, amp_core.loss_scale_state(opt_state), x, y, poison)
        params = eqx.filter(model, eqx.is_inexact_array)
        updates, opt_state = tx.update(grads, opt_state, params)
        return eqx.apply_updates(model, updates), opt_state

    @eqx.filter_jit
    def accumulated_step(model, opt_state, xs, ys, poisons):
        scaler = amp_core.loss_scale_state(opt_state)
        acc = None
        for i in range(K):
            g = scaled_grads(model, scaler, xs[i], ys[i], poisons[i], K)
            acc = g if acc is None else jax.tree.map(jnp.add, acc, g)
        return amp_core.apply_scaled_gradients(inner, CONFIG, acc, opt_state, model)

    record = Record()
    for step in range(STEPS):
        xs, ys, poisons = micro_batches(step)
        if multi_steps:
            for i in range(K):
                model, opt_state = micro_step(model, opt_state, xs[i], ys[i], poisons[i])
        else:
            model, opt_state = accumulated_step(model, opt_state, xs, ys, poisons)
        scaler = amp_core.loss_scale_state(opt_state)
        record.add(model.weight.T, model.bias, scaler, amp_core.step_applied(opt_state))
    return record


PATTERNS: dict[str, Callable[[], Record]] = {
    "with_loss_scaling(MultiSteps)": lambda: run_multi_steps(False),
    "with_loss_scaling(MultiSteps.gradient_transformation())": lambda: run_multi_steps(True),
    "lax.scan + update": lambda: run_in_one_jit(scan=True, whole_step=False),
    "python loop + apply_scaled_gradients": lambda: run_in_one_jit(scan=False, whole_step=True),
    "nnx loop": lambda: run_nnx(multi_steps=False),
    "nnx MultiSteps": lambda: run_nnx(multi_steps=True),
    "linen scan": lambda: run_linen(multi_steps=False),
    "linen MultiSteps": lambda: run_linen(multi_steps=True),
    "equinox loop + apply_scaled_gradients": lambda: run_equinox(multi_steps=False),
    "equinox MultiSteps": lambda: run_equinox(multi_steps=True),
}


@pytest.fixture(scope="module")
def records() -> dict[str, Record]:
    return {name: run() for name, run in PATTERNS.items()}


@pytest.mark.parametrize("pattern", list(PATTERNS))
def test_every_pattern_follows_the_hand_computed_trace(records, pattern):
    record = records[pattern]
    assert record.applied == EXPECTED_APPLIED
    assert record.scales_after == EXPECTED_SCALE_AFTER
    assert record.skipped == EXPECTED_SKIPPED


@pytest.mark.parametrize("pattern", list(PATTERNS))
def test_every_pattern_trains_as_sgd_over_the_applied_steps(records, pattern):
    record = records[pattern]
    for (w, b), (ow, ob) in zip(record.params, oracle_params(), strict=True):
        np.testing.assert_allclose(w, ow, rtol=2e-6, atol=2e-7)
        np.testing.assert_allclose(b, ob, rtol=2e-6, atol=2e-7)
    # A skipped accumulated step leaves the parameters bit-identical.
    initial = [W0.tobytes(), B0.tobytes()]
    assert record.bits[0] == initial
    assert record.bits[3] == record.bits[2]
    assert record.bits[1] != record.bits[0] and record.bits[2] != record.bits[1]


def test_every_pattern_gives_the_same_parameters(records):
    """The patterns are one computation: the same steps, and parameters equal to rounding."""
    reference = records["lax.scan + update"]
    for name, record in records.items():
        for (w, b), (rw, rb) in zip(record.params, reference.params, strict=True):
            np.testing.assert_allclose(w, rw, rtol=1e-6, atol=1e-7, err_msg=name)
            np.testing.assert_allclose(b, rb, rtol=1e-6, atol=1e-7, err_msg=name)


def test_the_issue_run_skips_only_the_overflowed_accumulated_step():
    """The report: 12 micro-batches, one inf in the second; before, all 3 steps were skipped."""
    tx = amp_core.with_loss_scaling(optax.MultiSteps(optax.sgd(0.1), 4), CONFIG)
    params = {"w": jnp.ones(3)}
    opt_state = tx.init(params)
    applied, scales, norms = [], [], []
    for i in range(12):
        scaler = amp_core.loss_scale_state(opt_state)
        grads = jax.grad(lambda p, s: amp_core.scale_loss(s, jnp.sum(p["w"] ** 2)))(params, scaler)
        if i == 1:
            grads = {"w": grads["w"].at[0].set(jnp.inf)}
        updates, opt_state = tx.update(grads, opt_state, params)
        params = optax.apply_updates(params, updates)
        if i % 4 == 3:
            scaler = amp_core.loss_scale_state(opt_state)
            applied.append(bool(amp_core.step_applied(opt_state)))
            scales.append(float(scaler.loss_scale))
            norms.append(float(scaler.global_norm))
    assert applied == [False, True, True]
    assert scales == [512.0, 512.0, 1024.0]
    assert np.isnan(norms[0]) or np.isinf(norms[0])
    # Finite steps: the mean gradient is 2 w (unscaled), so w <- w - 0.1 * 2 w = 0.8 w.
    np.testing.assert_allclose(norms[1:], [np.sqrt(12.0), 0.8 * np.sqrt(12.0)], rtol=1e-6)
    np.testing.assert_allclose(params["w"], np.full(3, 0.64), rtol=1e-6)


def test_skipped_accumulated_step_keeps_the_adamw_state_bit_identical():
    tx = amp_core.with_loss_scaling(optax.MultiSteps(optax.adamw(1e-2), 2), CONFIG)
    params = dict_params()
    opt_state = tx.init(params)
    grads = jax.tree.map(jnp.ones_like, params)
    for _ in range(2):  # one applied step: the moments are nonzero
        _, opt_state = tx.update(grads, opt_state, params)
    before = opt_state.inner_opt_state.inner_state
    bad = {"w": grads["w"].at[0, 0].set(jnp.nan), "b": grads["b"]}
    updates, opt_state = tx.update(bad, opt_state, params)
    assert not bool(amp_core.step_applied(opt_state))
    updates, opt_state = tx.update(grads, opt_state, params)  # ends the overflowed step
    assert not bool(amp_core.step_applied(opt_state))
    assert int(amp_core.loss_scale_state(opt_state).num_skipped_steps) == 1
    assert_trees_bitwise_equal(opt_state.inner_opt_state.inner_state, before)
    assert all(
        bool((u == 0).all()) and bool(jnp.signbit(u).all()) for u in jax.tree.leaves(updates)
    )
    for _ in range(2):  # the next accumulated step applies with finite gradients
        _, opt_state = tx.update(grads, opt_state, params)
    assert bool(amp_core.step_applied(opt_state))


def test_multi_steps_with_adamw_matches_plain_adamw_on_the_applied_mean_gradients():
    """Oracle: plain optax AdamW fed the unscaled mean gradient of each applied step."""
    inner = optax.adamw(1e-2)
    tx = amp_core.with_loss_scaling(optax.MultiSteps(inner, K), CONFIG)
    params, reference = dict_params(), dict_params()
    opt_state, ref_state = tx.init(params), inner.init(reference)
    grad = jax.jit(jax.grad(lambda p, x, y: linear_loss(p["w"], p["b"], x, y)))
    for step in range(STEPS):
        xs, ys, poisons = micro_batches(step)
        for i in range(K):
            scaler = amp_core.loss_scale_state(opt_state)
            # MultiSteps takes the mean itself: the micro-batch loss is not divided by K.
            grads = jax.grad(scaled_micro_loss, argnums=1)(
                scaler, params, xs[i], ys[i], poisons[i] * K
            )
            updates, opt_state = tx.update(grads, opt_state, params)
            params = optax.apply_updates(params, updates)
        if EXPECTED_APPLIED[step]:
            mean = jax.tree.map(
                lambda *g: sum(g) / K, *[grad(reference, xs[i], ys[i]) for i in range(K)]
            )
            ref_updates, ref_state = inner.update(mean, ref_state, reference)
            reference = optax.apply_updates(reference, ref_updates)
        for leaf, ref in zip(jax.tree.leaves(params), jax.tree.leaves(reference), strict=True):
            np.testing.assert_allclose(leaf, ref, rtol=1e-5, atol=1e-6)


def test_gcc_clips_the_accumulated_gradient_once():
    """``max_gradient_norm`` clips the mean over the micro-batches, as clip-then-SGD on it."""
    config = amp_core.DynamicLossScale(init_scale=2.0**10, max_gradient_norm=0.5)
    tx = amp_core.with_loss_scaling(optax.MultiSteps(optax.sgd(1.0), 2), config)
    reference = optax.chain(optax.clip_by_global_norm(0.5), optax.sgd(1.0))
    params = {"w": jnp.zeros(2)}
    opt_state = tx.init(params)
    micro = [jnp.array([3.0, 0.0]), jnp.array([0.0, 4.0])]  # unscaled; the mean is [1.5, 2]
    for g in micro:
        updates, opt_state = tx.update({"w": g * 2.0**10}, opt_state, params)
    expected, _ = reference.update({"w": (micro[0] + micro[1]) / 2}, reference.init(params))
    np.testing.assert_allclose(updates["w"], expected["w"], rtol=1e-6)
    np.testing.assert_allclose(float(amp_core.loss_scale_state(opt_state).global_norm), 2.5)


def test_static_scaling_with_multi_steps_never_skips():
    config = amp_core.StaticLossScale(loss_scale=8.0)
    tx = amp_core.with_loss_scaling(optax.MultiSteps(optax.sgd(1.0), 2), config)
    params = {"w": jnp.zeros(2)}
    opt_state = tx.init(params)
    for g in (jnp.array([8.0, 16.0]), jnp.array([24.0, 32.0])):
        updates, opt_state = tx.update({"w": g}, opt_state, params)
    np.testing.assert_allclose(updates["w"], [-2.0, -3.0])  # -(mean / 8)
    assert bool(amp_core.step_applied(opt_state))


def test_a_checkpoint_taken_mid_accumulation_resumes_the_same_step():
    tx = amp_core.with_loss_scaling(optax.MultiSteps(optax.sgd(0.5), 3), CONFIG)
    params = {"w": jnp.ones(2)}
    grads = [{"w": jnp.array([1.0, 2.0]) * 1024}, {"w": jnp.array([3.0, jnp.inf])}]
    opt_state = tx.init(params)
    for g in grads:
        _, opt_state = tx.update(g, opt_state, params)
    leaves, treedef = jax.tree.flatten(opt_state)
    restored = jax.tree.unflatten(treedef, [np.asarray(leaf) for leaf in leaves])  # "saved"
    last = {"w": jnp.array([1.0, 1.0]) * 1024}
    updates, after = tx.update(last, restored, params)
    expected_updates, expected = tx.update(last, opt_state, params)
    assert_trees_bitwise_equal(updates, expected_updates)
    assert_trees_bitwise_equal(after, expected)
    assert not bool(amp_core.step_applied(after))  # the inf from before the checkpoint counts
    assert int(amp_core.loss_scale_state(after).num_skipped_steps) == 1


@pytest.mark.parametrize(
    "make",
    [
        lambda tx: optax.MultiSteps(tx, 4),
        lambda tx: optax.MultiSteps(tx, 4).gradient_transformation(),
        lambda tx: optax.MultiSteps(optax.chain(tx, optax.scale(0.5)), 4),
    ],
    ids=["MultiSteps", "gradient_transformation", "inside a chain"],
)
def test_the_scaler_inside_multi_steps_is_refused_naming_the_order_that_works(make):
    tx = make(amp_core.with_loss_scaling(optax.sgd(0.1), CONFIG))
    with pytest.raises(
        ValueError, match=r"with_loss_scaling\(optax\.MultiSteps\(tx, k\), config\)"
    ):
        tx.init({"w": jnp.ones(2)})


def test_multi_steps_that_drops_overflowed_micro_batches_is_refused():
    multi_steps = optax.MultiSteps(optax.sgd(0.1), 4, should_skip_update_fn=optax.skip_not_finite)
    with pytest.raises(ValueError, match="should_skip_update_fn"):
        amp_core.with_loss_scaling(multi_steps, CONFIG)


def test_apply_scaled_gradients_refuses_multi_steps_naming_what_works():
    multi_steps = optax.MultiSteps(optax.sgd(0.1), 4)
    opt_state = amp_core.with_loss_scaling(optax.sgd(0.1), CONFIG).init({"w": jnp.ones(2)})
    grads = params = {"w": jnp.ones(2)}
    with pytest.raises(TypeError, match=r"with_loss_scaling\(optax\.MultiSteps\(inner, k\)"):
        amp_core.apply_scaled_gradients(multi_steps, CONFIG, grads, opt_state, params)


def test_the_accumulating_wrapper_rejects_a_foreign_state():
    tx = amp_core.with_loss_scaling(optax.MultiSteps(optax.sgd(0.1), 2), CONFIG)
    plain_state = amp_core.with_loss_scaling(optax.sgd(0.1), CONFIG).init({"w": jnp.ones(2)})
    with pytest.raises(TypeError, match="MultiStepsState"):
        tx.update({"w": jnp.ones(2)}, plain_state)
