"""flax NNX: an ``nnx.Optimizer`` with loss scaling, whose ``step`` counts applied steps.

Importing this module imports flax; ``import amp_core`` alone does not.
"""

from __future__ import annotations

from typing import Any

import jax
import optax
from flax import nnx

from amp_core.config import LossScaleConfig
from amp_core.scaling import scale_loss
from amp_core.state import LossScaleState
from amp_core.transforms import loss_scale_state, step_applied, with_loss_scaling


class LossScaledOptimizer(nnx.Optimizer):
    """``nnx.Optimizer`` over ``amp_core.with_loss_scaling(tx, config)``.

    Everything ``nnx.Optimizer`` does, with three differences:

    * :meth:`update` returns ``isfinite`` (0-d bool: whether the step was applied) rather than
      the updates. On a skipped step the model's parameters and ``opt_state`` keep their
      bits; the scaler advances.
    * ``step`` counts *applied* steps, so that step-keyed schedules, logging and checkpoint
      cadence do not drift after an overflow episode. Skipped steps are
      ``scaler.num_skipped_steps``; iterations are their sum.
    * :attr:`scaler` is the scaler state as plain arrays, and :meth:`scale_loss` scales a loss
      with it.

    Train it as ``nnx.Optimizer``, differentiating the *scaled* loss::

        grads = nnx.grad(lambda m: optimizer.scale_loss(loss_fn(m)))(model)
        isfinite = optimizer.update(model, grads)

    To accumulate gradients, sum the scaled micro-batch gradients and call :meth:`update` once
    (one decision per accumulated step), or pass ``optax.MultiSteps(tx, k)`` as ``tx`` and call
    :meth:`update` per micro-batch; either way an overflow in any micro-batch skips the whole
    accumulated step (see :func:`amp_core.with_loss_scaling`).

    ``nnx.state(optimizer)`` holds the scaler with the rest (``opt_state.scaler``), so a
    checkpoint of it saves and restores the scaler too.

    Attributes:
        config: the loss-scaling configuration (static).
        step: the number of applied steps (an ``nnx.OptState`` holding a uint32).
        tx: the loss-scaled transformation, ``with_loss_scaling(tx, config)``.
        opt_state: its state; ``opt_state.scaler`` holds the scaler's variables.

    Example:
        >>> import amp_core, jax.numpy as jnp, optax
        >>> from amp_core.flax_nnx import LossScaledOptimizer
        >>> from flax import nnx
        >>> model = nnx.Linear(2, 1, rngs=nnx.Rngs(0))
        >>> config = amp_core.DynamicLossScale(init_scale=2.0**10)
        >>> optimizer = LossScaledOptimizer(model, optax.sgd(0.1), config, wrt=nnx.Param)
        >>> def scaled_loss(m):
        ...     return optimizer.scale_loss(jnp.sum(m(jnp.ones((1, 2))) ** 2))
        >>> isfinite = optimizer.update(model, nnx.grad(scaled_loss)(model))
        >>> bool(isfinite), int(optimizer.step), f"{optimizer.scaler.loss_scale:.0f}"
        (True, 1, '1024')
    """

    def __init__(
        self,
        model: Any,
        tx: optax.GradientTransformation,
        config: LossScaleConfig,
        *,
        wrt: Any,
        **kwargs: Any,
    ) -> None:
        """Builds the optimizer state of ``with_loss_scaling(tx, config)`` for ``model``.

        Args:
            model: the NNX module to train.
            tx: the optimizer, e.g. ``optax.adamw(1e-3)``.
            config: the loss-scaling configuration.
            wrt: which variables to train, as for ``nnx.Optimizer`` (e.g. ``nnx.Param``).
            **kwargs: passed on to ``nnx.Optimizer`` (e.g. ``graph=``).

        Raises:
            TypeError: ``config`` is not a loss-scaling configuration, or ``tx`` is not an
                optax transformation.
        """
        super().__init__(model, with_loss_scaling(tx, config), wrt=wrt, **kwargs)
        self.config = config

    @property
    def scaler(self) -> LossScaleState:
        """The scaler state, fields as plain arrays (``bool``, ``float``, f-strings work)."""
        return loss_scale_state(self.opt_state)

    def scale_loss(self, loss: jax.typing.ArrayLike) -> jax.Array:
        """``float32(loss) * loss_scale``: the loss to differentiate (see :func:`amp_core.scale_loss`)."""
        return scale_loss(self.scaler, loss)

    def update(self, model: Any, grads: Any, /, **kwargs: Any) -> jax.Array:
        """Unscales ``grads`` (gradients of the scaled loss) and applies them unless they overflow.

        Args:
            model: the module whose ``wrt`` variables are trained.
            grads: gradients of the *scaled* loss, from ``nnx.grad``.
            **kwargs: extra arguments of ``tx.update``, as for ``nnx.Optimizer.update``.

        Returns:
            0-d bool: whether an optimizer step was applied (``isfinite``; always ``True`` for
            static scaling). ``step`` grows by it. With an ``optax.MultiSteps`` as ``tx`` each
            call takes one micro-batch and only the call that ends an accumulated step can
            apply one (see :func:`amp_core.step_applied`).
        """
        step = self.step[...]
        super().update(model, grads, **kwargs)
        applied = step_applied(self.opt_state)
        self.step[...] = step + applied.astype(step.dtype)
        return applied
