"""Four JAX training runs in lock-step that checkpoint every ``EVERY`` steps, as their users do.

For ``test_kill_and_resume.py``. One small float16 model per stack trains ``STEPS`` steps with
AdamW under one dynamic loss scale config with a ratio ``overflow_tolerance``; the loss is
multiplied by inf on the steps in ``POISONED``. Every ``EVERY`` steps each stack is saved as
its users save it, into ``DIR/ckpt_<step>/``, and ``DIR/latest`` (renamed into place once every
save is committed) names that step:

* optax: orbax over ``{"params": params, "opt_state": opt_state}``, restored with a target;
* flax NNX: orbax over ``nnx.state(model)`` and ``nnx.state(optimizer)`` (the optimizer's state
  does not hold the model's weights), restored into ``nnx.eval_shape`` targets;
* flax linen: ``flax.serialization.to_bytes`` of the ``LossScaledTrainState``;
* equinox: ``eqx.tree_serialise_leaves`` of ``(model, opt_state)``.

After each step it appends the step and the four loss scales to ``progress.txt``; on ``STOP_AT``
it then waits to be killed. Usage: ``python _jax_resume_worker.py DIR STOP_AT`` (-1: to the end); it
resumes from ``DIR/latest`` when that exists and pickles every stack's final leaves (as bytes)
into ``DIR/final.pkl``.
"""

from __future__ import annotations

import os
import pickle
import sys
import time
from pathlib import Path
from typing import Any

import equinox as eqx
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp
from flax import nnx, serialization

import amp_core
from amp_core.flax_linen import LossScaledTrainState
from amp_core.flax_nnx import LossScaledOptimizer

STEPS = 20
EVERY = 5
POISONED = frozenset({3, 7, 8, 13, 16})  # tolerated, halves, halves, tolerated, halves
CONFIG = amp_core.DynamicLossScale(
    init_scale=2.0**8, steps_per_increase=5, overflow_tolerance=0.3, max_loss_scale=2.0**15
)
X = jax.random.normal(jax.random.key(0), (16, 4), jnp.float32)
Y = jax.random.normal(jax.random.key(1), (16, 1), jnp.float32)
TX = optax.adamw(1e-2)


def mse(pred: jax.Array, poison: jax.Array) -> jax.Array:
    loss = jnp.mean((pred.astype(jnp.float32) - Y) ** 2)
    return loss * jnp.where(poison, jnp.inf, 1.0)


# optax
OPTAX_TX = amp_core.with_loss_scaling(TX, CONFIG)


def fresh_optax() -> dict[str, Any]:
    params = {"w": jax.random.normal(jax.random.key(2), (4, 1)) * 0.5, "b": jnp.zeros((1,))}
    return {"params": params, "opt_state": OPTAX_TX.init(params)}


@jax.jit
def optax_step(state: dict[str, Any], poison: jax.Array) -> dict[str, Any]:
    scaler = amp_core.loss_scale_state(state["opt_state"])

    def loss(p: dict[str, Any]) -> jax.Array:
        half = jax.tree_util.tree_map(lambda v: v.astype(jnp.float16), p)
        return amp_core.scale_loss(
            scaler, mse(X.astype(jnp.float16) @ half["w"] + half["b"], poison)
        )

    updates, opt_state = OPTAX_TX.update(
        jax.grad(loss)(state["params"]), state["opt_state"], state["params"]
    )
    return {"params": optax.apply_updates(state["params"], updates), "opt_state": opt_state}


# flax NNX
def fresh_nnx() -> tuple[nnx.Linear, LossScaledOptimizer]:
    model = nnx.Linear(4, 1, dtype=jnp.float16, rngs=nnx.Rngs(3))
    return model, LossScaledOptimizer(model, TX, CONFIG, wrt=nnx.Param)


@nnx.jit
def nnx_step(model: nnx.Linear, optimizer: LossScaledOptimizer, poison: jax.Array) -> None:
    optimizer.update(model, nnx.grad(lambda m: optimizer.scale_loss(mse(m(X), poison)))(model))


# flax linen
LINEN = nn.Dense(1, dtype=jnp.float16)


def fresh_linen() -> LossScaledTrainState:
    params = LINEN.init(jax.random.key(4), X)["params"]
    return LossScaledTrainState.create(apply_fn=LINEN.apply, params=params, tx=TX, config=CONFIG)


@jax.jit
def linen_step(state: LossScaledTrainState, poison: jax.Array) -> LossScaledTrainState:
    def loss(params: Any) -> jax.Array:
        return state.scale_loss(mse(state.apply_fn({"params": params}, X), poison))

    return state.apply_gradients(grads=jax.grad(loss)(state.params))


# equinox
EQX_TX = amp_core.with_loss_scaling(TX, CONFIG)


def fresh_eqx() -> tuple[eqx.nn.Linear, Any]:
    model = eqx.nn.Linear(4, 1, key=jax.random.key(5))
    return model, EQX_TX.init(eqx.filter(model, eqx.is_inexact_array))


@eqx.filter_jit
def eqx_step(model: eqx.nn.Linear, opt_state: Any, poison: jax.Array) -> tuple[Any, Any]:
    scaler = amp_core.loss_scale_state(opt_state)

    def loss(m: eqx.nn.Linear) -> jax.Array:
        pred = jax.vmap(lambda x: m(x.astype(jnp.float16)))(X)
        return amp_core.scale_loss(scaler, mse(pred, poison))

    grads = eqx.filter_grad(loss)(model)
    updates, opt_state = EQX_TX.update(grads, opt_state, eqx.filter(model, eqx.is_inexact_array))
    return eqx.apply_updates(model, updates), opt_state


def scale(state: Any) -> float:
    return amp_core.scaler_metrics(state)["loss_scale"]


def leaves(tree: Any) -> list[bytes]:
    return [np.asarray(leaf).tobytes() for leaf in jax.tree_util.tree_leaves(tree)]


def run(directory: Path, stop_at: int) -> None:
    optax_state = fresh_optax()
    nnx_model, nnx_optimizer = fresh_nnx()
    linen_state = fresh_linen()
    eqx_model, eqx_opt_state = fresh_eqx()
    checkpointer = ocp.StandardCheckpointer()
    start = 0
    if (directory / "latest").exists():  # a fresh process resumes from the last checkpoint
        start = int((directory / "latest").read_text())
        ckpt = directory / f"ckpt_{start}"
        optax_state = checkpointer.restore(ckpt / "optax", fresh_optax())
        abstract_model, abstract_optimizer = nnx.eval_shape(fresh_nnx)
        nnx.update(nnx_model, checkpointer.restore(ckpt / "nnx_model", nnx.state(abstract_model)))
        nnx.update(
            nnx_optimizer,
            checkpointer.restore(ckpt / "nnx_optimizer", nnx.state(abstract_optimizer)),
        )
        linen_state = serialization.from_bytes(fresh_linen(), (ckpt / "linen.msgpack").read_bytes())
        eqx_model, eqx_opt_state = eqx.tree_deserialise_leaves(ckpt / "eqx.eqx", fresh_eqx())
    with open(directory / "progress.txt", "a") as progress:
        for step in range(start, STEPS):
            poison = jnp.asarray(step in POISONED)
            optax_state = optax_step(optax_state, poison)
            nnx_step(nnx_model, nnx_optimizer, poison)
            linen_state = linen_step(linen_state, poison)
            eqx_model, eqx_opt_state = eqx_step(eqx_model, eqx_opt_state, poison)
            if (step + 1) % EVERY == 0:
                ckpt = directory / f"ckpt_{step + 1}"
                checkpointer.save(ckpt / "optax", optax_state)
                checkpointer.save(ckpt / "nnx_model", nnx.state(nnx_model))
                checkpointer.save(ckpt / "nnx_optimizer", nnx.state(nnx_optimizer))
                checkpointer.wait_until_finished()  # committed before it is named latest
                (ckpt / "linen.msgpack").write_bytes(serialization.to_bytes(linen_state))
                eqx.tree_serialise_leaves(ckpt / "eqx.eqx", (eqx_model, eqx_opt_state))
                (directory / "latest.tmp").write_text(str(step + 1))
                os.replace(directory / "latest.tmp", directory / "latest")
            scales = [optax_state["opt_state"], nnx_optimizer.scaler, linen_state, eqx_opt_state]
            progress.write(" ".join([str(step), *(str(scale(s)) for s in scales)]) + "\n")
            progress.flush()
            if step == stop_at:
                while True:  # the parent kills this process here
                    time.sleep(1)
    final = {
        "optax": leaves(optax_state),
        "nnx": leaves((nnx.state(nnx_model), nnx.state(nnx_optimizer))),
        "linen": leaves(linen_state),
        "equinox": leaves((eqx_model, eqx_opt_state)),
        "scalers": {
            "optax": amp_core.to_state_dict(CONFIG, amp_core.loss_scale_state(optax_state)),
            "nnx": amp_core.to_state_dict(CONFIG, nnx_optimizer.scaler),
            "linen": amp_core.to_state_dict(CONFIG, amp_core.loss_scale_state(linen_state)),
            "equinox": amp_core.to_state_dict(CONFIG, amp_core.loss_scale_state(eqx_opt_state)),
        },
    }
    (directory / "final.pkl").write_bytes(pickle.dumps(final))


if __name__ == "__main__":
    run(Path(sys.argv[1]), int(sys.argv[2]))
