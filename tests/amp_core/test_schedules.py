"""optax schedules under ``with_loss_scaling`` count only the steps that were applied.

A schedule in optax reads a ``count`` kept in the inner optimizer's state (``ScaleByScheduleState``
for ``optax.adamw(schedule)``, ``InjectHyperparamsState`` for ``optax.inject_hyperparams``).
``with_loss_scaling`` returns the inner state unchanged, bit for bit, on a skipped step, so the
count, and with it the learning rate, advances only on applied steps: the torch door needs
``cstorch.amp.skip_aware`` for the same, the JAX door has it by construction.

The oracle is the same inner transformation, without loss scaling, updated by hand only with the
gradients of the applied steps. Scales are powers of two, so unscaling is exact and the applied
steps see the oracle's gradients exactly. Every case runs under ``jax.jit``; SGD's unaccumulated case also eagerly.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import amp_core

STEPS = 5
FAULTS = frozenset({0, 2, 3})  # steps whose gradients get an inf
K = 2  # micro-batches per accumulated step (MultiSteps)
DTYPE_PROMOTION = "standard"  # optax's adamw and schedules (see test_optax.py)
CONFIG = amp_core.DynamicLossScale(init_scale=2.0**4, steps_per_increase=1000)
SCHEDULE = optax.exponential_decay(0.1, transition_steps=1, decay_rate=0.5)  # 0.1 * 0.5**count

INNERS: dict[str, Callable[[], optax.GradientTransformation]] = {
    "sgd(schedule)": lambda: optax.sgd(SCHEDULE),
    "adamw(schedule)": lambda: optax.adamw(SCHEDULE, weight_decay=0.01),
    "inject_hyperparams(adamw)": lambda: optax.inject_hyperparams(optax.adamw)(
        learning_rate=SCHEDULE, weight_decay=0.01
    ),
}

PARAMS = {"w": jnp.array([0.5, -1.0, 2.0]), "b": jnp.array(0.25)}


def gradient(step: int, micro: int = 0) -> dict[str, jax.Array]:
    """A deterministic unscaled gradient for ``step`` (and micro-batch ``micro``)."""
    rng = np.random.default_rng(100 * step + micro)
    return {
        "w": jnp.asarray(rng.standard_normal(3), jnp.float32),
        "b": jnp.asarray(rng.standard_normal(()), jnp.float32),
    }


def poisoned(grads: dict[str, jax.Array]) -> dict[str, jax.Array]:
    return {**grads, "w": grads["w"].at[0].set(jnp.inf)}


# Every case under jit; eagerly (op by op, slow on a shared CPU) the cheapest inner, unaccumulated.
JITTED = [(name, True) for name in sorted(INNERS)]
CASES = [*JITTED, ("sgd(schedule)", False)]
CASE_IDS = [f"{name}-{'jit' if jit else 'eager'}" for name, jit in CASES]


def maybe_jit(fn: Callable[..., Any], jit: bool) -> Callable[..., Any]:
    return jax.jit(fn) if jit else fn


def scale_of(opt_state: Any) -> jax.Array:
    return amp_core.loss_scale_state(opt_state).loss_scale


def counts_of(state: Any) -> list[int]:
    """Every ``count`` leaf in ``state`` (the schedules' and Adam's step counters)."""
    found: list[int] = []

    def visit(node: Any) -> None:
        if hasattr(node, "_fields"):
            for name in node._fields:
                value = getattr(node, name)
                if name == "count":
                    found.append(int(value))
                else:
                    visit(value)
        elif isinstance(node, (tuple, list)):
            for item in node:
                visit(item)
        elif isinstance(node, dict):
            for item in node.values():
                visit(item)

    visit(state)
    return found


def assert_trees_close(actual: Any, expected: Any) -> None:
    for a, e in zip(jax.tree.leaves(actual), jax.tree.leaves(expected), strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(e), rtol=1e-6, atol=0)


def learning_rate_of(inner_state: Any) -> float | None:
    hyperparams = getattr(inner_state, "hyperparams", None)
    return None if hyperparams is None else float(hyperparams["learning_rate"])


@pytest.mark.parametrize(("name", "jit"), CASES, ids=CASE_IDS)
def test_schedules_count_only_applied_steps(name: str, jit: bool):
    tx = amp_core.with_loss_scaling(INNERS[name](), CONFIG)
    oracle = INNERS[name]()
    update, oracle_update = maybe_jit(tx.update, jit), maybe_jit(oracle.update, jit)
    state, oracle_state = tx.init(PARAMS), oracle.init(PARAMS)
    params, oracle_params = PARAMS, PARAMS
    applied = 0
    for step in range(STEPS):
        grads = gradient(step)
        scale = scale_of(state)
        scaled = jax.tree.map(lambda g, s=scale: g * s, grads)
        updates, state = update(poisoned(scaled) if step in FAULTS else scaled, state, params)
        params = optax.apply_updates(params, updates)
        if step not in FAULTS:
            oracle_updates, oracle_state = oracle_update(grads, oracle_state, oracle_params)
            oracle_params = optax.apply_updates(oracle_params, oracle_updates)
            applied += 1
        assert bool(amp_core.step_applied(state)) == (step not in FAULTS)
        inner = state.inner_state
        assert counts_of(inner) == counts_of(oracle_state)
        assert set(counts_of(inner)) == {applied}
        assert learning_rate_of(inner) == learning_rate_of(oracle_state)
        assert_trees_close(params, oracle_params)
    if name == "inject_hyperparams(adamw)":
        # The rate of the last applied step: the schedule at the applied count before it.
        assert learning_rate_of(state.inner_state) == pytest.approx(0.1 * 0.5 ** (applied - 1))


@pytest.mark.parametrize(("name", "jit"), JITTED, ids=CASE_IDS[:-1])
def test_schedules_inside_multi_steps_count_only_applied_accumulated_steps(name: str, jit: bool):
    """``with_loss_scaling(optax.MultiSteps(inner, K))``: a fault in one micro-batch skips the
    accumulated step; the inner schedule counts applied accumulated steps only."""
    tx = amp_core.with_loss_scaling(optax.MultiSteps(INNERS[name](), K), CONFIG)
    oracle = optax.MultiSteps(INNERS[name](), K)
    update, oracle_update = maybe_jit(tx.update, jit), maybe_jit(oracle.update, jit)
    state, oracle_state = tx.init(PARAMS), oracle.init(PARAMS)
    params, oracle_params = PARAMS, PARAMS
    applied = 0
    for step in range(STEPS):
        scale = scale_of(state)  # read at the accumulated step's start
        for micro in range(K):
            grads = gradient(step, micro)
            scaled = jax.tree.map(lambda g, s=scale: g * s, grads)
            fault = step in FAULTS and micro == 1
            updates, state = update(poisoned(scaled) if fault else scaled, state, params)
            params = optax.apply_updates(params, updates)
            if step not in FAULTS:
                oracle_updates, oracle_state = oracle_update(grads, oracle_state, oracle_params)
                oracle_params = optax.apply_updates(oracle_params, oracle_updates)
        applied += step not in FAULTS
        assert int(amp_core.loss_scale_state(state).num_skipped_steps) == len(
            FAULTS & set(range(step + 1))
        )
        inner = state.inner_opt_state.inner_state
        assert counts_of(inner) == counts_of(oracle_state.inner_opt_state)
        assert set(counts_of(inner)) == {applied}
        assert learning_rate_of(inner) == learning_rate_of(oracle_state.inner_opt_state)
        assert_trees_close(params, oracle_params)
