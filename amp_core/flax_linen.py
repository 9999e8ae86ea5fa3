"""flax linen: a ``TrainState`` with loss scaling, whose ``step`` counts applied steps.

Importing this module imports flax; ``import amp_core`` alone does not.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import optax
from flax import struct
from flax.training import train_state

from amp_core.config import LossScaleConfig
from amp_core.scaling import scale_loss
from amp_core.state import LossScaleState
from amp_core.transforms import loss_scale_state, step_applied, with_loss_scaling


class LossScaledTrainState(train_state.TrainState):
    """``flax.training.train_state.TrainState`` over ``with_loss_scaling(tx, config)``.

    ``apply_gradients(grads=...)`` takes gradients of the *scaled* loss, unscales them and
    applies them unless they overflow (parameters and ``opt_state`` keep their bits on a
    skipped step). ``step`` counts *applied* steps only, so that step-keyed schedules,
    logging and checkpoint cadence do not drift after an overflow episode; skipped steps are
    ``scaler.num_skipped_steps``. ``step`` is an int32 array from the start, so a jitted train
    step compiles once.

    To accumulate gradients, sum the scaled micro-batch gradients and call
    :meth:`apply_gradients` once, or create it with ``tx=optax.MultiSteps(tx, k)`` and call
    :meth:`apply_gradients` per micro-batch (``step`` then grows only when an accumulated step
    is applied); an overflow in any micro-batch skips the whole accumulated step.

    Attributes:
        config: the loss-scaling configuration (static, not a pytree leaf).

    Example:
        >>> import amp_core, jax, jax.numpy as jnp, optax
        >>> import flax.linen as nn
        >>> from amp_core.flax_linen import LossScaledTrainState
        >>> model = nn.Dense(1)
        >>> params = model.init(jax.random.key(0), jnp.ones((1, 2)))["params"]
        >>> state = LossScaledTrainState.create(
        ...     apply_fn=model.apply, params=params, tx=optax.sgd(0.1),
        ...     config=amp_core.DynamicLossScale(init_scale=2.0**10))
        >>> def scaled_loss(p):
        ...     return state.scale_loss(jnp.sum(state.apply_fn({"params": p}, jnp.ones((1, 2)))))
        >>> state = state.apply_gradients(grads=jax.grad(scaled_loss)(state.params))
        >>> int(state.step), bool(state.scaler.isfinite)
        (1, True)
    """

    config: LossScaleConfig = struct.field(pytree_node=False)

    @classmethod
    def create(  # type: ignore[override]
        cls,
        *,
        apply_fn: Callable[..., Any],
        params: Any,
        tx: optax.GradientTransformation,
        config: LossScaleConfig,
        **kwargs: Any,
    ) -> LossScaledTrainState:
        """A fresh state: ``step`` 0, ``tx`` wrapped by ``with_loss_scaling(tx, config)``.

        Args:
            apply_fn: usually ``model.apply``.
            params: the parameters to train.
            tx: the optimizer, e.g. ``optax.adamw(1e-3)``.
            config: the loss-scaling configuration.
            **kwargs: further fields of a subclass, as for ``TrainState.create``.

        Returns:
            The new state.

        Raises:
            TypeError: ``config`` is not a loss-scaling configuration, or ``tx`` is not an
                optax transformation.
        """
        state = super().create(
            apply_fn=apply_fn,
            params=params,
            tx=with_loss_scaling(tx, config),
            config=config,
            **kwargs,
        )
        return state.replace(step=jnp.zeros((), jnp.int32))

    @property
    def scaler(self) -> LossScaleState:
        """The scaler state, fields as arrays (``bool``, ``float``, f-strings work)."""
        return loss_scale_state(self.opt_state)

    def scale_loss(self, loss: jax.typing.ArrayLike) -> jax.Array:
        """``float32(loss) * loss_scale``: the loss to differentiate (see :func:`amp_core.scale_loss`)."""
        return scale_loss(self.scaler, loss)

    def apply_gradients(self, *, grads: Any, **kwargs: Any) -> LossScaledTrainState:
        """Applies gradients of the scaled loss unless they overflow; ``step`` counts applied ones.

        Args:
            grads: gradients of the *scaled* loss, in the structure of ``params``.
            **kwargs: other fields to ``replace``, as for ``TrainState.apply_gradients``.

        Returns:
            The new state; ``new_state.scaler.isfinite`` says whether the step was applied.
        """
        new_state = super().apply_gradients(grads=grads, **kwargs)
        step = jnp.asarray(self.step)
        applied = step_applied(new_state.opt_state).astype(step.dtype)
        return new_state.replace(step=step + applied)
