"""Gradient accumulation: the facade, torch's own scaler and the JAX front door agree (SPEC 11).

One linear model trains over the same micro-batches (``_accumulation_worker``), two of them
overflowed, through torch's documented accumulation loop with the facade's ``GradScaler``, with
``torch.amp.GradScaler`` (whose rule coincides here: ``growth_interval = steps_per_increase +
1``, no overflow tolerance, scales inside the bounds), with the facade under DDP on 2 ranks
with ``no_sync()`` (gloo, CPU; the inf on one rank only), and through three JAX accumulation
patterns (``lax.scan`` in one jit, ``with_loss_scaling(optax.MultiSteps(...))``, a Python loop
and ``apply_scaled_gradients``). Oracles: the hand-computed trace of the update rule, and SGD
over the applied steps' mean gradients in float64 NumPy.
"""

from __future__ import annotations

import pickle
import time
from pathlib import Path
from typing import Any

import _accumulation_worker as worker
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from _ranks import start_ranks, wait_for_ranks

import amp_core

WORKER = Path(worker.__file__).resolve()
WORLD = 2
TIMEOUT_S = 120.0
K, STEPS = worker.K, worker.STEPS
CONFIG = amp_core.DynamicLossScale(
    init_scale=worker.INIT_SCALE, steps_per_increase=worker.STEPS_PER_INCREASE
)

# The hand-computed trace (steps_per_increase=1, overflow_tolerance=0): step 0 overflows
# (1024 -> 512, counters reset); step 1 applies (steps=1, 1 < 1 is false: no growth); step 2
# applies (steps=2 > 1: doubles to 1024, counters reset); step 3 overflows (-> 512).
APPLIED = [False, True, True, False]
SCALE_USED = [1024.0, 512.0, 512.0, 1024.0]
SCALE_AFTER = [512.0, 512.0, 1024.0, 512.0]


def oracle() -> dict[str, list[np.ndarray]]:
    """(W, b) after each accumulated step: float64 SGD on the applied steps' mean gradients."""
    w, b = worker.W0.astype(np.float64), worker.B0.astype(np.float64)
    record: dict[str, list[np.ndarray]] = {"w": [], "b": []}
    n = worker.BATCH * worker.OUT
    for step in range(STEPS):
        if APPLIED[step]:
            dw, db = np.zeros_like(w), np.zeros_like(b)
            for i in range(step * K, (step + 1) * K):
                x, y = worker.XS[i].astype(np.float64), worker.YS[i].astype(np.float64)
                r = x @ w + b - y
                dw += 2 * x.T @ r / n / K
                db += 2 * r.sum(axis=0) / n / K
            w, b = w - worker.LR * dw, b - worker.LR * db
        record["w"].append(w)
        record["b"].append(b)
    return record


def micro_loss(scaler, params, x, y, poison):
    loss = jnp.mean((x @ params["w"] + params["b"] - y) ** 2)
    return amp_core.scale_loss(scaler, loss * poison / K)


def jax_scan() -> dict[str, list[Any]]:
    tx = amp_core.with_loss_scaling(optax.sgd(worker.LR), CONFIG)

    @jax.jit
    def accumulated_step(params, opt_state, xs, ys, poisons):
        scaler = amp_core.loss_scale_state(opt_state)

        def body(acc, batch):
            grads = jax.grad(micro_loss, argnums=1)(scaler, params, *batch)
            return jax.tree.map(jnp.add, acc, grads), None

        zeros = jax.tree.map(jnp.zeros_like, params)
        grads = jax.lax.scan(body, zeros, (xs, ys, poisons))[0]
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state

    return run_jax(tx, lambda p, s, xs, ys, ps: accumulated_step(p, s, xs, ys, ps))


def jax_loop_apply_scaled_gradients() -> dict[str, list[Any]]:
    inner = optax.sgd(worker.LR)

    @jax.jit
    def accumulated_step(params, opt_state, xs, ys, poisons):
        scaler = amp_core.loss_scale_state(opt_state)
        grads = jax.grad(micro_loss, argnums=1)(scaler, params, xs[0], ys[0], poisons[0])
        for i in range(1, K):
            more = jax.grad(micro_loss, argnums=1)(scaler, params, xs[i], ys[i], poisons[i])
            grads = jax.tree.map(jnp.add, grads, more)
        return amp_core.apply_scaled_gradients(inner, CONFIG, grads, opt_state, params)

    tx = amp_core.with_loss_scaling(inner, CONFIG)
    return run_jax(tx, accumulated_step)


def jax_multi_steps() -> dict[str, list[Any]]:
    tx = amp_core.with_loss_scaling(optax.MultiSteps(optax.sgd(worker.LR), K), CONFIG)

    @jax.jit
    def micro_step(params, opt_state, x, y, poison):
        scaler = amp_core.loss_scale_state(opt_state)
        # MultiSteps averages the micro-batch gradients itself: the loss is not divided by K.
        grads = jax.grad(micro_loss, argnums=1)(scaler, params, x, y, poison * K)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state

    def accumulated_step(params, opt_state, xs, ys, poisons):
        for i in range(K):
            params, opt_state = micro_step(params, opt_state, xs[i], ys[i], poisons[i])
        return params, opt_state

    return run_jax(tx, accumulated_step)


def run_jax(tx: optax.GradientTransformation, accumulated_step: Any) -> dict[str, list[Any]]:
    params = {"w": jnp.asarray(worker.W0), "b": jnp.asarray(worker.B0)}
    opt_state = tx.init(params)
    record: dict[str, list[Any]] = {"scale_used": [], "scale_after": [], "w": [], "b": []}
    for step in range(STEPS):
        sl = slice(step * K, (step + 1) * K)
        record["scale_used"].append(float(amp_core.loss_scale_state(opt_state).loss_scale))
        batches = (jnp.asarray(worker.XS[sl]), jnp.asarray(worker.YS[sl]), worker.POISON[sl])
        params, opt_state = accumulated_step(params, opt_state, *batches)
        scaler = amp_core.loss_scale_state(opt_state)
        record["scale_after"].append(float(scaler.loss_scale))
        record["w"].append(np.asarray(params["w"]))
        record["b"].append(np.asarray(params["b"]))
    record["num_skipped_steps"] = [int(scaler.num_skipped_steps)]
    return record


def run_ddp_no_sync(out: Path) -> list[dict[str, list[Any]]]:
    """The facade's run as a 2-rank gloo job (DDP, ``no_sync()``); each rank's record."""
    procs = start_ranks(WORKER, out, WORLD)
    wait_for_ranks(procs, out, time.monotonic() + TIMEOUT_S)
    records = []
    for rank in range(WORLD):
        with open(out / f"rank{rank}.pkl", "rb") as file:
            records.append(pickle.load(file))
    return records


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict[str, list[Any]]]:
    out = tmp_path_factory.mktemp("accumulation")
    results = {
        "facade": worker.train("facade"),
        "torch.amp.GradScaler": worker.train("torch"),
        "jax lax.scan": jax_scan(),
        "jax loop + apply_scaled_gradients": jax_loop_apply_scaled_gradients(),
        "jax with_loss_scaling(MultiSteps)": jax_multi_steps(),
    }
    for rank, record in enumerate(run_ddp_no_sync(out)):
        results[f"facade DDP no_sync rank {rank}"] = record
    return results


RUNS = [
    "facade",
    "torch.amp.GradScaler",
    "facade DDP no_sync rank 0",
    "facade DDP no_sync rank 1",
    "jax lax.scan",
    "jax loop + apply_scaled_gradients",
    "jax with_loss_scaling(MultiSteps)",
]


@pytest.mark.parametrize("name", RUNS)
def test_every_run_follows_the_hand_computed_trace(runs, name):
    record = runs[name]
    assert record["scale_used"] == SCALE_USED  # every micro-batch scaled by the step's scale
    assert record["scale_after"] == SCALE_AFTER  # one update of the scale per accumulated step
    if "num_skipped_steps" in record:
        assert record["num_skipped_steps"] == [2]  # each skipped accumulated step counted once
    expected = oracle()
    for step in range(STEPS):
        np.testing.assert_allclose(record["w"][step], expected["w"][step], rtol=2e-6, atol=2e-7)
        np.testing.assert_allclose(record["b"][step], expected["b"][step], rtol=2e-6, atol=2e-7)
    # Skipped accumulated steps leave the parameters bit-identical; applied ones move them.
    assert record["w"][0].tobytes() == worker.W0.tobytes()
    assert record["w"][3].tobytes() == record["w"][2].tobytes()
    assert record["w"][1].tobytes() != record["w"][0].tobytes()


def test_the_facade_and_torch_scaler_agree_bit_for_bit(runs):
    facade, torch_scaler = runs["facade"], runs["torch.amp.GradScaler"]
    assert facade["scale_after"] == torch_scaler["scale_after"]
    for key in ("w", "b"):
        for ours, theirs in zip(facade[key], torch_scaler[key], strict=True):
            assert ours.tobytes() == theirs.tobytes()


def test_both_ranks_of_the_ddp_job_hold_the_same_bits(runs):
    rank0, rank1 = runs["facade DDP no_sync rank 0"], runs["facade DDP no_sync rank 1"]
    assert rank0["scale_after"] == rank1["scale_after"]
    assert rank0["num_skipped_steps"] == rank1["num_skipped_steps"] == [2]
    for key in ("w", "b"):
        for a, b in zip(rank0[key], rank1[key], strict=True):
            assert a.tobytes() == b.tobytes()


@pytest.mark.parametrize("name", [n for n in RUNS if n.startswith("jax")])
def test_the_jax_front_door_agrees_with_the_facade_step_by_step(runs, name):
    facade, record = runs["facade"], runs[name]
    assert record["scale_after"] == facade["scale_after"]
    for key in ("w", "b"):
        for ours, theirs in zip(record[key], facade[key], strict=True):
            np.testing.assert_allclose(ours, theirs, rtol=1e-6, atol=1e-7)
