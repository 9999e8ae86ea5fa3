"""One planted bad batch, with and without spike skipping: the held-out loss of both runs.

A small MLP regression computed in bfloat16 and trained with Adam under dynamic loss scaling
(``amp_core.with_loss_scaling``). At ``--bad-step`` the batch's targets are multiplied by
``--factor``, so that its gradients are hundreds of times the usual (finite: no overflow, the
loss scaler applies it). The default run applies that step; the run with
``SpikeSkip(metric="grad_norm")`` skips it. Printed: the held-out loss just before the bad
step, just after it, 10 steps after it and at the end, for each run (docs/jax/spike-skip.md quotes them).

    PYTHONPATH=. python tests/amp_core/spike_skip_demo.py --steps 400 --bad-step 300
"""

from __future__ import annotations

import argparse
import functools

import jax
import jax.numpy as jnp
import optax

import amp_core

IN, HIDDEN = 16, 64


def data(key: jax.Array, n: int) -> tuple[jax.Array, jax.Array]:
    x = jax.random.normal(key, (n, IN))
    teacher = jax.random.normal(jax.random.key(123), (IN,)) / IN**0.5
    return x, jnp.tanh(x @ teacher)[:, None] + 0.05 * jnp.sin(3 * x[:, :1])


def init_params(key: jax.Array) -> dict[str, jax.Array]:
    k1, k2 = jax.random.split(key)
    return {
        "w1": jax.random.normal(k1, (IN, HIDDEN)) / IN**0.5,
        "b1": jnp.zeros(HIDDEN),
        "w2": jax.random.normal(k2, (HIDDEN, 1)) / HIDDEN**0.5,
    }


def loss_fn(params: dict[str, jax.Array], x: jax.Array, y: jax.Array) -> jax.Array:
    half = jax.tree_util.tree_map(lambda p: p.astype(jnp.bfloat16), params)
    hidden = jnp.tanh(x.astype(jnp.bfloat16) @ half["w1"] + half["b1"])
    pred = (hidden @ half["w2"]).astype(jnp.float32)
    return jnp.mean((pred - y) ** 2)


def train(
    config: amp_core.DynamicLossScale, steps: int, bad_step: int, factor: float
) -> dict[str, float]:
    tx = amp_core.with_loss_scaling(optax.adam(3e-3), config)
    params = init_params(jax.random.key(0))
    opt_state = tx.init(params)
    x_test, y_test = data(jax.random.key(1), 512)

    @jax.jit
    def step(params, opt_state, x, y):
        scaler = amp_core.loss_scale_state(opt_state)
        loss, grads = jax.value_and_grad(lambda p: amp_core.scale_loss(scaler, loss_fn(p, x, y)))(
            params
        )
        updates, opt_state = tx.update(grads, opt_state, params, loss=loss / scaler.loss_scale)
        return optax.apply_updates(params, updates), opt_state

    held_out = jax.jit(functools.partial(loss_fn, x=x_test, y=y_test))
    result = {}
    for i in range(steps):
        x, y = data(jax.random.fold_in(jax.random.key(2), i), 32)
        if i == bad_step:
            result["before"] = float(held_out(params))
            y = y * factor
        params, opt_state = step(params, opt_state, x, y)
        if i == bad_step:
            result["after"] = float(held_out(params))
        if i == bad_step + 10:
            result["after10"] = float(held_out(params))
    result["end"] = float(held_out(params))
    metrics = amp_core.scaler_metrics(opt_state)
    result["spike_skips"] = metrics.get("num_spike_skips", 0)
    result["overflow_skips"] = metrics["num_skipped_steps"]
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=400)
    parser.add_argument("--bad-step", type=int, default=300)
    parser.add_argument("--factor", type=float, default=300.0)
    args = parser.parse_args()
    base = {"init_scale": 2.0**10, "steps_per_increase": 100}
    runs = {
        "default": amp_core.DynamicLossScale(**base),
        "SpikeSkip(grad_norm)": amp_core.DynamicLossScale(
            **base, spike_skip=amp_core.SpikeSkip(metric="grad_norm")
        ),
        "SpikeSkip(loss)": amp_core.DynamicLossScale(
            **base, spike_skip=amp_core.SpikeSkip(metric="loss")
        ),
    }
    print(
        "| run | held-out loss before the bad step | just after | 10 steps after | at the end "
        "| spike skips | overflow skips |"
    )
    print("|---|---|---|---|---|---|---|")
    for name, config in runs.items():
        r = train(config, args.steps, args.bad_step, args.factor)
        print(
            f"| {name} | {r['before']:.5f} | {r['after']:.5f} | {r['after10']:.5f} | {r['end']:.5f} | "
            f"{r['spike_skips']} | {r['overflow_skips']} |"
        )


if __name__ == "__main__":
    main()
