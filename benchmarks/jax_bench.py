"""Section 2: a jitted optax AdamW step alone and loss-scaled through ``amp_core``."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import optax

import amp_core
from benchmarks.torch_bench import BIG_NORM
from workbench.sizes import GradientSet
from workbench.timing import CompileCounter, FirstStep, Plan, Timing, Variant, measure_group
from workbench.whole_loop import LEARNING_RATE, LOSS_SCALE, NEVER

FUSED_APPLY = "+ DLS, apply_scaled_gradients"
GATED_FLOOR = "optax adamw gated by one read (floor)"
VARIANTS = ("optax adamw", "+ DLS", "+ DLS+GCC", FUSED_APPLY, GATED_FLOOR)
"""Variant names, interleaved together. The loss-scaled ones go through ``tx.update`` and
``optax.apply_updates``, or through ``amp_core.apply_scaled_gradients``. The floor is plain
AdamW whose gradients enter multiplied by ``1 + min(sum(g**2), 0)`` (exactly 1): one read of
every gradient that the update must wait for, which any step able to skip has to make, and
nothing else."""


def gate_by(total: jax.Array, grads: Any) -> Any:
    """``grads`` multiplied by ``1 + min(total, 0)``: exactly 1 for every sum of squares (NaN for
    NaN), so the update that reads them waits for ``total``, as a skip decision makes it wait.
    The floors' stand-in for a decision (here and in :mod:`benchmarks.step_bench`)."""
    gate = 1 + jnp.minimum(total, 0)
    return jax.tree_util.tree_map(lambda g: g * gate, grads)


def _config(name: str) -> amp_core.DynamicLossScale:
    return amp_core.DynamicLossScale(
        init_scale=LOSS_SCALE,
        max_loss_scale=LOSS_SCALE,
        steps_per_increase=NEVER,
        max_gradient_norm=BIG_NORM if name == "+ DLS+GCC" else None,
    )


class _OptaxVariant:
    """Holds params and optimizer state; each call is one jitted, donating update."""

    def __init__(self, name: str, grads: GradientSet) -> None:
        inner = optax.adamw(LEARNING_RATE)
        config = _config(name)
        plain = name in ("optax adamw", GATED_FLOOR)
        tx = inner if plain else amp_core.with_loss_scaling(inner, config)
        self.grads = {
            n: jnp.array(g.numpy(), copy=True)
            for n, g in zip(grads.names, grads.grads, strict=True)
        }
        self.params = {
            n: jnp.array(v.numpy(), copy=True)
            for n, v in zip(grads.names, grads.values, strict=True)
        }
        self.state = tx.init(self.params)

        def update(params: Any, state: Any, grads: Any) -> tuple[Any, Any]:
            if name == FUSED_APPLY:
                return amp_core.apply_scaled_gradients(inner, config, grads, state, params)
            if name == GATED_FLOOR:
                total = sum(jnp.sum(g * g) for g in jax.tree_util.tree_leaves(grads))
                grads = gate_by(total, grads)
            updates, state = tx.update(grads, state, params)
            return optax.apply_updates(params, updates), state

        self._update = jax.jit(update, donate_argnums=(0, 1))

    def step(self) -> None:
        self.params, self.state = self._update(self.params, self.state, self.grads)
        jax.block_until_ready((self.params, self.state))


@dataclasses.dataclass
class JaxGroup:
    """The measurements of one size: first steps and timed rounds per variant."""

    first: dict[str, FirstStep]
    timings: dict[str, Timing]


def run_group(
    grads: GradientSet,
    plan: Plan,
    counter: CompileCounter,
    on_round: Callable[[], object] = lambda: None,
) -> JaxGroup:
    """Measures optax AdamW alone, with DLS, with DLS + GCC, the fused apply and the floor,
    interleaved.

    Every variant is ``jax.jit(update, donate_argnums=(0, 1))`` over ``(params, opt_state,
    grads)``: params and optimizer state are donated, the gradients are reused on every call.

    Args:
        grads: the size's parameters and gradients.
        plan: rounds, steps per round and warm-up.
        counter: a listening compile counter.
        on_round: progress callback, once per round.
    """

    def make(name: str) -> Variant:
        return Variant(name, _OptaxVariant(name, grads).step)

    return JaxGroup(*measure_group(VARIANTS, make, plan, counter, on_round))
