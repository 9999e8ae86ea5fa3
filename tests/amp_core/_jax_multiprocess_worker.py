"""One process of the data-parallel job driven by ``test_multiprocess.py``.

Run as a script, never imported for its side effects::

    python _jax_multiprocess_worker.py OUT_FILE                      # one process, all devices
    python _jax_multiprocess_worker.py OUT_FILE PORT PROCESS_ID N    # process PROCESS_ID of N

The parent sets ``XLA_FLAGS`` (the host device count) before this process imports JAX. Every
process builds the same global batches; each feeds only its own rows to
``jax.make_array_from_process_local_data``. The train steps are ordinary jitted functions over
a 1-D ``"data"`` mesh of all global devices: params replicated, batch sharded. Nothing in them
knows about processes. The results (scaler state after every step, parameters after every step,
final optimizer state) go to ``OUT_FILE`` (``.npz``), facts about the job to ``OUT_FILE.json``.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Callable
from typing import Any

import numpy as np

BATCH, FEATURES, HIDDEN = 16, 8, 32
STEPS = 10
NAN_STEP, NAN_ROW = 3, 12  # a NaN input in the second half of the batch (process 1's rows)
BIG_STEP, BIG_ROW = 7, 3  # a target that overflows float16 in backward (process 0's rows)
BIG_TARGET = 1.0e6
INIT_SCALE, STEPS_PER_INCREASE, MAX_GRADIENT_NORM = 2.0**8, 2, 1.0
VARIANTS = ("apply_scaled_gradients", "with_loss_scaling")


def global_batches() -> list[tuple[np.ndarray, np.ndarray]]:
    """The full batch of every step, faults included: the same in every process."""
    rng = np.random.default_rng(0)
    batches = []
    for step in range(STEPS):
        x = rng.standard_normal((BATCH, FEATURES)).astype(np.float32)
        y = rng.standard_normal((BATCH, 1)).astype(np.float32)
        if step == NAN_STEP:
            x[NAN_ROW, 0] = np.nan
        if step == BIG_STEP:
            y[BIG_ROW, 0] = BIG_TARGET
        batches.append((x, y))
    return batches


def initial_params() -> dict[str, np.ndarray]:
    """A 2-layer MLP in float32 (the master weights)."""
    rng = np.random.default_rng(1)
    return {
        "w1": (rng.standard_normal((FEATURES, HIDDEN)) / np.sqrt(FEATURES)).astype(np.float32),
        "b1": np.zeros((HIDDEN,), np.float32),
        "w2": (rng.standard_normal((HIDDEN, 1)) / np.sqrt(HIDDEN)).astype(np.float32),
        "b2": np.zeros((1,), np.float32),
    }


def loss_fn(params: Any, x: Any, y: Any) -> Any:
    """Mean squared error of the MLP computed in float16, the loss in float32."""
    import jax.numpy as jnp

    half = {k: v.astype(jnp.float16) for k, v in params.items()}
    hidden = jnp.tanh(x.astype(jnp.float16) @ half["w1"] + half["b1"])
    pred = (hidden @ half["w2"] + half["b2"]).astype(jnp.float32)
    return jnp.mean((pred - y) ** 2)


def make_train_steps(config: Any, inner: Any, out_shardings: Any) -> dict[str, Callable[..., Any]]:
    """The two jitted train steps, one per amp_core entry point, each returning
    ``(params, opt_state, loss)`` placed by ``out_shardings`` (one sharding, or one per output).
    """
    import jax
    import optax

    import amp_core

    tx = amp_core.with_loss_scaling(inner, config)

    def scaled_grads(params: Any, opt_state: Any, x: Any, y: Any) -> tuple[Any, Any]:
        scaler = amp_core.loss_scale_state(opt_state)
        loss, grads = jax.value_and_grad(lambda p: amp_core.scale_loss(scaler, loss_fn(p, x, y)))(
            params
        )
        return loss / scaler.loss_scale, grads

    def fast_step(params: Any, opt_state: Any, x: Any, y: Any) -> tuple[Any, Any, Any]:
        loss, grads = scaled_grads(params, opt_state, x, y)
        params, opt_state = amp_core.apply_scaled_gradients(inner, config, grads, opt_state, params)
        return params, opt_state, loss

    def wrapper_step(params: Any, opt_state: Any, x: Any, y: Any) -> tuple[Any, Any, Any]:
        loss, grads = scaled_grads(params, opt_state, x, y)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    return {
        "apply_scaled_gradients": jax.jit(fast_step, out_shardings=out_shardings),
        "with_loss_scaling": jax.jit(wrapper_step, out_shardings=out_shardings),
    }


def host_value(array: Any) -> np.ndarray:
    """A replicated global array as numpy, read from this process's first shard."""
    assert array.sharding.is_fully_replicated, array.sharding
    return np.asarray(array.addressable_shards[0].data)


def run(out_file: str) -> None:
    """Trains every variant for ``STEPS`` steps and writes what happened to ``out_file``."""
    import jax
    import optax
    from jax.sharding import Mesh, NamedSharding, PartitionSpec

    import amp_core

    mesh = Mesh(np.array(jax.devices()), ("data",))
    replicated = NamedSharding(mesh, PartitionSpec())
    batch_sharding = NamedSharding(mesh, PartitionSpec("data"))
    rows = BATCH // jax.process_count()
    mine = slice(jax.process_index() * rows, (jax.process_index() + 1) * rows)

    config = amp_core.DynamicLossScale(
        half_dtype="float16",
        init_scale=INIT_SCALE,
        steps_per_increase=STEPS_PER_INCREASE,
        max_gradient_norm=MAX_GRADIENT_NORM,
    )
    inner = optax.adam(1e-2)
    tx = amp_core.with_loss_scaling(inner, config)
    # Outputs pinned replicated, so that every process holds the whole result.
    train_steps = make_train_steps(config, inner, replicated)

    results: dict[str, np.ndarray] = {}
    facts: dict[str, Any] = {
        "process_index": jax.process_index(),
        "process_count": jax.process_count(),
        "device_count": jax.device_count(),
        "local_device_count": jax.local_device_count(),
        "local_rows": [mine.start, mine.stop],
        "local_x_finite": [],
        "local_y_max": [],
        "shard_rows": [],
    }
    batches = global_batches()
    for x, y in batches:
        facts["local_x_finite"].append(bool(np.isfinite(x[mine]).all()))
        facts["local_y_max"].append(float(np.abs(y[mine]).max()))

    for variant in VARIANTS:
        params = jax.tree_util.tree_map(
            lambda a: jax.make_array_from_process_local_data(replicated, a), initial_params()
        )
        opt_state = jax.jit(tx.init, out_shardings=replicated)(params)
        history: dict[str, list[np.ndarray]] = {}

        def record(name: str, value: Any, history: dict[str, list[np.ndarray]] = history) -> None:
            history.setdefault(name, []).append(host_value(value))

        for name, leaf in params.items():
            record(f"params.{name}", leaf)
        for x, y in batches:
            global_x = jax.make_array_from_process_local_data(batch_sharding, x[mine], x.shape)
            global_y = jax.make_array_from_process_local_data(batch_sharding, y[mine], y.shape)
            if variant == VARIANTS[0]:
                facts["shard_rows"].append(
                    sorted([s.index[0].start, s.index[0].stop] for s in global_x.addressable_shards)
                )
            params, opt_state, loss = train_steps[variant](params, opt_state, global_x, global_y)
            record("loss", loss)
            for field, value in amp_core.loss_scale_state(opt_state)._asdict().items():
                record(f"scaler.{field}", value)
            for name, leaf in params.items():
                record(f"params.{name}", leaf)
        for key, values in history.items():
            results[f"{variant}/{key}"] = np.stack(values)
        for index, leaf in enumerate(jax.tree_util.tree_leaves(opt_state)):
            results[f"{variant}/opt_state.{index}"] = host_value(leaf)

    np.savez(out_file, **results)
    with open(f"{out_file}.json", "w") as f:
        json.dump(facts, f)


def main(argv: list[str]) -> None:
    """Parses ``argv``, joins the distributed job if asked to, and runs."""
    import jax

    jax.config.update("jax_platforms", "cpu")
    out_file = argv[0]
    if len(argv) > 1:
        port, process_id, num_processes = (int(a) for a in argv[1:4])
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
        jax.distributed.initialize(
            coordinator_address=f"127.0.0.1:{port}",
            num_processes=num_processes,
            process_id=process_id,
            coordinator_bind_address=f"127.0.0.1:{port}",  # JAX's default: every interface
            initialization_timeout=60,
            heartbeat_timeout_seconds=30,
            shutdown_timeout_seconds=30,
        )
    run(out_file)
    if len(argv) > 1:
        jax.distributed.shutdown()


if __name__ == "__main__":
    main(sys.argv[1:])
