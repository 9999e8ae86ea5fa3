"""One process of the sharded jobs driven by ``test_multiprocess_sharded.py``.

Run as a script, never imported for its side effects::

    python _jax_sharded_worker.py MODE OUT_FILE CHECKPOINTS                  # one process
    python _jax_sharded_worker.py MODE OUT_FILE CHECKPOINTS explicit PORT ID N
    python _jax_sharded_worker.py MODE OUT_FILE CHECKPOINTS slurm            # from SLURM_* only

``MODE`` is ``train`` (steps ``0 .. STEPS - 1``), ``save`` (steps ``0 .. SAVE_AT - 1``, then
orbax's ``CheckpointManager`` saves every stack as step ``SAVE_AT`` into ``CHECKPOINTS``; the
process writes ``OUT_FILE``, then ``OUT_FILE.saved``, and waits to be killed) or ``resume``
(restores step ``SAVE_AT`` from ``CHECKPOINTS`` onto this job's mesh, target shardings given as
abstract arrays, then steps ``SAVE_AT .. STEPS - 1``). The parent sets ``XLA_FLAGS`` (the host
device count) before this process imports JAX.

Two stacks train side by side on the same global batches (``_jax_multiprocess_worker``'s, with
its NaN input in one process's rows and its float16-overflowing target in the other's) over a
``("data", "fsdp")`` mesh of the 4 global devices, whatever the processes: plain optax
(``with_loss_scaling`` + ``optax.apply_updates``, parameters placed by ``PARAM_SPECS``) and flax
NNX (``LossScaledOptimizer``, parameters annotated with ``nnx.with_partitioning``). Parameters
and Adam moments are sharded over ``"fsdp"``, the batch over both axes. After every step every
leaf of both stacks (parameters, optimizer state, scaler) is gathered and written to
``OUT_FILE`` (``.npz``, keys ``STACK/WHAT@STEP``: ``state`` and the leaf's path, ``scaler.`` and the
field, ``loss``; ``@0`` is the state before the first step); facts about the job (who holds which rows and
which parameter slices) go to ``OUT_FILE.json``.
"""

from __future__ import annotations

import json
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import _jax_multiprocess_worker as shared
import jax
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp
from flax import nnx
from jax.experimental import multihost_utils
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import amp_core
from amp_core.flax_nnx import LossScaledOptimizer

STEPS = shared.STEPS
SAVE_AT = 6  # the checkpoint's step: after NAN_STEP (3), before BIG_STEP (7)
DEVICES = 4  # a 2 x 2 ("data", "fsdp") mesh in every job
STACKS = ("optax", "nnx")
TIMEOUTS = {  # every rendezvous, heartbeat and shutdown of the job is bounded
    "initialization_timeout": 60,
    "heartbeat_timeout_seconds": 30,
    "shutdown_timeout_seconds": 30,
}
CHECKPOINT_TIMEOUT_S = 60


def param_specs() -> dict[str, Any]:
    """How the optax stack's parameters are placed: the hidden dimension split over "fsdp"."""
    return {"w1": P(None, "fsdp"), "b1": P("fsdp"), "w2": P("fsdp", None), "b2": P()}


def make_mesh() -> Any:
    """The ("data", "fsdp") mesh of the 4 global devices, the same logical layout in every job.

    ``jax.devices()`` lists the devices process by process, so the transpose puts one
    process's devices along "data" and spreads "fsdp" over the processes: with 2 processes
    each holds half of every sharded parameter; with 1 process of 4 devices the same positions
    hold the same slices.
    """
    devices = jax.devices()
    assert len(devices) == DEVICES, devices
    return Mesh(np.array(devices).reshape(2, 2).T, ("data", "fsdp"))


def global_value(array: Any) -> np.ndarray:
    """A global array's whole value as numpy, in every process (a collective when sharded)."""
    if array.is_fully_replicated:
        return np.asarray(array.addressable_shards[0].data)
    if array.is_fully_addressable:
        return np.asarray(array)
    return np.asarray(multihost_utils.process_allgather(array, tiled=True))


def place(host: np.ndarray, sharding: Any) -> Any:
    """A global array of the value ``host`` (the same in every process): each process places
    only the slices that its devices hold."""
    return jax.make_array_from_callback(host.shape, sharding, host.__getitem__)


def placement(array: Any) -> dict[str, Any]:
    """The array's partition spec and the slices of it that this process holds."""
    held = sorted(
        {
            tuple(
                (s.start or 0, s.stop or dim)
                for s, dim in zip(shard.index, array.shape, strict=True)
            )
            for shard in array.addressable_shards
        }
    )
    return {"spec": str(array.sharding.spec), "held": [list(map(list, h)) for h in held]}


# --- the two stacks -----------------------------------------------------------------------------


def make_optax_stack(mesh: Any, config: Any, inner: Any) -> dict[str, Any]:
    """Plain optax: parameters placed by ``param_specs``, Adam moments placed like them."""
    tx = amp_core.with_loss_scaling(inner, config)
    replicated = NamedSharding(mesh, P())
    param_shardings = {name: NamedSharding(mesh, spec) for name, spec in param_specs().items()}
    abstract_params = {
        name: jax.ShapeDtypeStruct(value.shape, value.dtype, sharding=param_shardings[name])
        for name, value in shared.initial_params().items()
    }
    opt_shapes = jax.eval_shape(tx.init, abstract_params)
    opt_shardings = optax.tree_map_params(  # Adam's moments like their parameters
        tx,
        lambda _, sharding: sharding,
        opt_shapes,
        param_shardings,
        transform_non_params=lambda _: replicated,
    )
    out_shardings = (param_shardings, opt_shardings, replicated)
    step = shared.make_train_steps(config, inner, out_shardings)["with_loss_scaling"]
    abstract_opt_state = jax.tree.map(
        lambda leaf, sharding: jax.ShapeDtypeStruct(leaf.shape, leaf.dtype, sharding=sharding),
        opt_shapes,
        opt_shardings,
    )
    return {
        "step": step,
        "init": jax.jit(tx.init, out_shardings=opt_shardings),
        "shardings": param_shardings,
        # the restore target: shapes, dtypes and this job's shardings, no values
        "abstract": {"params": abstract_params, "opt_state": abstract_opt_state},
    }


def fresh_optax(stack: dict[str, Any]) -> dict[str, Any]:
    """The optax stack's first state, each process placing only the slices it holds."""
    params = {
        name: place(value, stack["shardings"][name])
        for name, value in shared.initial_params().items()
    }
    return {"params": params, "opt_state": stack["init"](params)}


def optax_train_step(stack: dict[str, Any], state: dict[str, Any], x: Any, y: Any) -> Any:
    """One step of the optax stack; returns the loss (unscaled)."""
    state["params"], state["opt_state"], loss = stack["step"](
        state["params"], state["opt_state"], x, y
    )
    return loss


class MLP(nnx.Module):
    """A float16 MLP whose float32 parameters carry their partitioning (``nnx.with_partitioning``)."""

    def __init__(self, rngs: nnx.Rngs) -> None:
        kernel, zeros = nnx.initializers.lecun_normal(), nnx.initializers.zeros_init()
        self.hidden = nnx.Linear(
            shared.FEATURES,
            shared.HIDDEN,
            dtype=jnp.float16,
            kernel_init=nnx.with_partitioning(kernel, (None, "fsdp")),
            bias_init=nnx.with_partitioning(zeros, ("fsdp",)),
            rngs=rngs,
        )
        self.out = nnx.Linear(
            shared.HIDDEN,
            1,
            dtype=jnp.float16,
            kernel_init=nnx.with_partitioning(kernel, ("fsdp", None)),
            rngs=rngs,
        )

    def __call__(self, x: Any) -> Any:
        return self.out(jnp.tanh(self.hidden(x)))


def make_nnx_stack(mesh: Any, config: Any, inner: Any) -> dict[str, Any]:
    """flax NNX: the model and its ``LossScaledOptimizer``, sharded as the annotations say."""

    def fresh() -> tuple[Any, Any]:
        model = MLP(nnx.Rngs(0))
        return model, LossScaledOptimizer(model, inner, config, wrt=nnx.Param)

    @nnx.jit
    def step(model: Any, optimizer: Any, x: Any, y: Any) -> Any:
        scale = optimizer.scaler.loss_scale

        def scaled_loss(m: Any) -> Any:
            pred = m(x).astype(jnp.float32)
            return optimizer.scale_loss(jnp.mean((pred - y) ** 2))

        loss, grads = nnx.value_and_grad(scaled_loss)(model)
        optimizer.update(model, grads)
        return loss / scale

    def abstract() -> tuple[Any, Any]:
        """Graph definitions and abstract states (this job's shardings) of model and optimizer."""
        with jax.set_mesh(mesh):
            abstract_model, abstract_optimizer = nnx.eval_shape(fresh)
        parts = []
        for module in (abstract_model, abstract_optimizer):
            graphdef, state = nnx.split(module)
            targets = jax.tree.map(
                lambda leaf, sharding: jax.ShapeDtypeStruct(
                    leaf.shape, leaf.dtype, sharding=sharding
                ),
                state,
                nnx.get_named_sharding(state, mesh),
            )
            parts.append((graphdef, targets))
        return tuple(parts)

    def create() -> tuple[Any, Any]:
        with jax.set_mesh(mesh):
            return nnx.jit(fresh)()

    return {"create": create, "abstract": abstract, "step": step}


# --- one job ------------------------------------------------------------------------------------


def job_facts() -> dict[str, Any]:
    """Who this process is in which job, for the test to check."""
    facts: dict[str, Any] = {
        "process_index": jax.process_index(),
        "process_count": jax.process_count(),
        "device_count": jax.device_count(),
        "local_device_count": jax.local_device_count(),
        "mesh_processes": [[d.process_index for d in row] for row in make_mesh().devices],
        "slurm": {k: v for k, v in os.environ.items() if k.startswith("SLURM_")},
        "rows": {},
        "local_x_finite": {},
        "local_y_max": {},
    }
    if jax.process_count() > 1:
        from jax._src import distributed  # the address the job was formed at

        facts["coordinator_address"] = distributed.global_state.coordinator_address
    return facts


def checkpoint_manager(checkpoints: str, *, read_only: bool) -> ocp.CheckpointManager:
    """orbax's manager over ``checkpoints``, its waits for the other processes bounded."""
    options = ocp.CheckpointManagerOptions(
        read_only=read_only, async_options=ocp.AsyncOptions(timeout_secs=CHECKPOINT_TIMEOUT_S)
    )
    return ocp.CheckpointManager(Path(checkpoints).resolve(), options=options)


def save(checkpoints: str, optax_state: dict[str, Any], model: Any, optimizer: Any) -> list[int]:
    """Every stack as step ``SAVE_AT``, committed in every process; returns the saved steps."""
    manager = checkpoint_manager(checkpoints, read_only=False)
    manager.save(
        SAVE_AT,
        args=ocp.args.Composite(
            optax=ocp.args.StandardSave(optax_state),
            nnx_model=ocp.args.StandardSave(nnx.state(model)),
            nnx_optimizer=ocp.args.StandardSave(nnx.state(optimizer)),
        ),
    )
    manager.wait_until_finished()  # committed everywhere before anyone says so
    return list(manager.all_steps())


def restore(
    checkpoints: str, optax_stack: dict[str, Any], nnx_stack: dict[str, Any]
) -> tuple[list[int], dict[str, Any], Any, Any]:
    """Step ``SAVE_AT`` of every stack, placed as this job's abstract targets say.

    Returns:
        The steps the checkpoint directory holds, the optax state, the NNX model and optimizer.
    """
    manager = checkpoint_manager(checkpoints, read_only=True)
    (model_def, model_target), (optimizer_def, optimizer_target) = nnx_stack["abstract"]()
    restored = manager.restore(
        SAVE_AT,
        args=ocp.args.Composite(
            optax=ocp.args.StandardRestore(optax_stack["abstract"]),
            nnx_model=ocp.args.StandardRestore(model_target),
            nnx_optimizer=ocp.args.StandardRestore(optimizer_target),
        ),
    )
    steps = list(manager.all_steps())
    manager.close()
    model = nnx.merge(model_def, restored["nnx_model"])
    optimizer = nnx.merge(optimizer_def, restored["nnx_optimizer"])
    return steps, dict(restored["optax"]), model, optimizer


def run(mode: str, out_file: str, checkpoints: str) -> None:
    """Trains both stacks as ``mode`` says and writes what happened to ``out_file``."""
    mesh = make_mesh()
    batch_sharding = NamedSharding(mesh, P(("data", "fsdp")))
    config = amp_core.DynamicLossScale(
        half_dtype="float16",
        init_scale=shared.INIT_SCALE,
        steps_per_increase=shared.STEPS_PER_INCREASE,
        max_gradient_norm=shared.MAX_GRADIENT_NORM,
    )
    inner = optax.adam(1e-2)
    optax_stack = make_optax_stack(mesh, config, inner)
    nnx_stack = make_nnx_stack(mesh, config, inner)
    facts = job_facts()
    if mode == "resume":
        first = SAVE_AT
        facts["checkpoint_steps"], optax_state, model, optimizer = restore(
            checkpoints, optax_stack, nnx_stack
        )
    else:
        first = 0
        optax_state = fresh_optax(optax_stack)
        model, optimizer = nnx_stack["create"]()
    last = SAVE_AT if mode == "save" else STEPS

    results: dict[str, np.ndarray] = {}
    trees: dict[str, Callable[[], Any]] = {
        "optax": lambda: optax_state,
        "nnx": lambda: (nnx.state(model), nnx.state(optimizer)),
    }
    scalers: dict[str, Callable[[], Any]] = {
        "optax": lambda: amp_core.loss_scale_state(optax_state["opt_state"]),
        "nnx": lambda: optimizer.scaler,
    }

    def record(step: int, losses: dict[str, Any] | None) -> None:
        for stack in STACKS:
            for path, leaf in jax.tree_util.tree_leaves_with_path(trees[stack]()):
                results[f"{stack}/state{jax.tree_util.keystr(path)}@{step}"] = global_value(leaf)
            for field, value in scalers[stack]()._asdict().items():
                results[f"{stack}/scaler.{field}@{step}"] = global_value(value)
            if losses is not None:
                results[f"{stack}/loss@{step}"] = global_value(losses[stack])

    record(first, None)  # the state the first step starts from
    batches = shared.global_batches()
    for step in range(first, last):
        x_host, y_host = batches[step]
        x, y = place(x_host, batch_sharding), place(y_host, batch_sharding)
        facts["rows"][step] = sorted(
            [s.index[0].start, s.index[0].stop] for s in x.addressable_shards
        )
        facts["local_x_finite"][step] = all(
            bool(np.isfinite(s.data).all()) for s in x.addressable_shards
        )
        facts["local_y_max"][step] = max(float(np.abs(s.data).max()) for s in y.addressable_shards)
        losses = {
            "optax": optax_train_step(optax_stack, optax_state, x, y),
            "nnx": nnx_stack["step"](model, optimizer, x, y),
        }
        record(step + 1, losses)

    facts["placement"] = {
        stack: {
            jax.tree_util.keystr(path): placement(leaf)
            for path, leaf in jax.tree_util.tree_leaves_with_path(trees[stack]())
        }
        for stack in STACKS
    }
    if mode == "save":
        facts["checkpoint_steps"] = save(checkpoints, optax_state, model, optimizer)
    np.savez(out_file, **results)
    Path(f"{out_file}.json").write_text(json.dumps(facts))
    if mode == "save":
        Path(f"{out_file}.saved").write_text(str(SAVE_AT))
        while True:  # the parent kills this process here, as a preempted job is killed
            time.sleep(1)


def join(how: list[str]) -> None:
    """Joins the distributed job ``how`` says, before any other JAX call."""
    jax.config.update("jax_platforms", "cpu")
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    if how == ["slurm"]:
        # Where the coordinator is, how many processes and which one this is: all from the
        # SLURM_* variables and JAX_COORDINATOR_PORT. Only the timeouts are given here.
        jax.distributed.initialize(**TIMEOUTS)
    elif how and how[0] == "explicit":
        port, process_id, num_processes = (int(a) for a in how[1:4])
        jax.distributed.initialize(
            coordinator_address=f"127.0.0.1:{port}",
            num_processes=num_processes,
            process_id=process_id,
            coordinator_bind_address=f"127.0.0.1:{port}",  # JAX's default: every interface
            **TIMEOUTS,
        )
    elif how:
        raise SystemExit(f"unknown way to join: {how}")


def main(argv: list[str]) -> None:
    """``MODE OUT_FILE CHECKPOINTS [explicit PORT ID N | slurm]``."""
    mode, out_file, checkpoints, *how = argv
    if mode not in ("train", "save", "resume"):
        raise SystemExit(f"unknown mode {mode!r}")
    join(how)
    run(mode, out_file, checkpoints)
    if how:
        jax.distributed.shutdown()


if __name__ == "__main__":
    main(sys.argv[1:])
