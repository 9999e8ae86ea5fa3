"""optax integration and a ``value_and_grad`` helper: loss scaling in a few lines of a train step."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from amp_core.config import LossScaleConfig
from amp_core.scaling import apply_multiplier, check_and_update, scale_loss, unscale_and_check
from amp_core.state import LossScaleState, init


class LossScaledState(NamedTuple):
    """Optimizer state of :func:`with_loss_scaling`.

    Attributes:
        loss_scale: the scaler state (read the skip signal from ``loss_scale.isfinite``).
        inner_state: the wrapped transformation's state.
    """

    loss_scale: LossScaleState
    inner_state: optax.OptState


def with_loss_scaling(
    inner: optax.GradientTransformation, config: LossScaleConfig
) -> optax.GradientTransformation:
    """Wraps an optax transformation so that it consumes gradients of the *scaled* loss.

    ``update`` unscales the gradients (clipping them with DLS + GCC) and checks them for overflow
    in one read, then runs ``inner.update`` under ``lax.cond``: on overflow the inner update is not
    computed at all, the inner state is returned untouched, and the updates are ``-0.0``, so that
    ``optax.apply_updates`` leaves every parameter bit-identical (``x + -0.0 == x`` for every
    ``x``, signed zeros included). The scaler state advances on every step either way.

    Args:
        inner: any gradient transformation, e.g. ``optax.adamw(1e-3)``.
        config: the loss-scaling configuration.

    Returns:
        A transformation whose state is a :class:`LossScaledState`.

    Example:
        >>> import amp_core, jax, jax.numpy as jnp, optax
        >>> cfg = amp_core.DynamicLossScale(init_scale=2.0**10)
        >>> tx = amp_core.with_loss_scaling(optax.sgd(0.1), cfg)
        >>> params = {"w": jnp.ones(3)}
        >>> opt_state = tx.init(params)
        >>> def loss_fn(p):
        ...     return jnp.sum(p["w"] ** 2)
        >>> @jax.jit
        ... def train_step(params, opt_state):
        ...     scaler = amp_core.loss_scale_state(opt_state)
        ...     grads = jax.grad(lambda p: amp_core.scale_loss(scaler, loss_fn(p)))(params)
        ...     updates, opt_state = tx.update(grads, opt_state, params)
        ...     return optax.apply_updates(params, updates), opt_state
        >>> params, opt_state = train_step(params, opt_state)
        >>> params["w"]
        Array([0.8, 0.8, 0.8], dtype=float32)
    """
    if not isinstance(inner, optax.GradientTransformation):
        raise TypeError(
            f"inner must be an optax.GradientTransformation; got {type(inner).__name__}"
        )

    def init_fn(params: optax.Params) -> LossScaledState:
        return LossScaledState(loss_scale=init(config), inner_state=inner.init(params))

    def update_fn(
        updates: optax.Updates,
        state: LossScaledState,
        params: optax.Params | None = None,
        **extra_args: Any,
    ) -> tuple[optax.Updates, LossScaledState]:
        check = check_and_update(config, state.loss_scale, updates)
        scaler = check.next_state

        def apply(_: None) -> tuple[optax.Updates, optax.OptState]:
            # Unscaling inside the branch lets XLA fuse the multiply into the optimizer's
            # element-wise work instead of writing the unscaled gradients out first.
            grads = apply_multiplier(updates, check.multiplier)
            return inner.update(grads, state.inner_state, params, **extra_args)

        if not config.is_dynamic:  # static scaling never skips
            new_updates, inner_state = apply(None)
            return new_updates, LossScaledState(scaler, inner_state)

        shapes = jax.eval_shape(apply, None)[0]

        def skip(_: None) -> tuple[optax.Updates, optax.OptState]:
            # -0.0 is the exact additive identity: params + (-0.0) keeps -0.0, +0.0 and NaN.
            identity = jax.tree_util.tree_map(lambda s: jnp.full(s.shape, -0.0, s.dtype), shapes)
            return identity, state.inner_state

        # lax.cond, not a select: on overflow the optimizer's arithmetic is not done at all, and
        # XLA does not have to keep two copies of every parameter and moment alive.
        new_updates, inner_state = jax.lax.cond(check.isfinite, apply, skip, None)
        return new_updates, LossScaledState(scaler, inner_state)

    return optax.GradientTransformation(init_fn, update_fn)


def apply_scaled_gradients(
    inner: optax.GradientTransformation,
    config: LossScaleConfig,
    grads: optax.Updates,
    opt_state: LossScaledState,
    params: optax.Params,
) -> tuple[optax.Params, LossScaledState]:
    """One whole optimizer step from gradients of the scaled loss: the fast path.

    Does what ``tx = with_loss_scaling(inner, config)``, ``tx.update`` and
    ``optax.apply_updates`` do together, with the same state (``tx.init(params)``), but puts the
    unscaling, the inner update and the parameter update all inside the ``lax.cond``. XLA then
    fuses them into the optimizer's own passes, and a skipped step simply returns the
    parameters and inner state it was given (bit-identical by construction). Under ``jax.jit``
    with the parameters and state donated this costs little more than the plain optimizer step
    (see the README's Performance section), where the composable wrapper must materialise the
    updates between the branch and ``apply_updates``.

    Args:
        inner: the optimizer, e.g. ``optax.adamw(1e-3)`` (the same one given to
            :func:`with_loss_scaling` to make ``opt_state``).
        config: the loss-scaling configuration.
        grads: gradients of the scaled loss.
        opt_state: a :class:`LossScaledState`, from ``with_loss_scaling(inner, config).init``.
        params: the parameters.

    Returns:
        ``(new_params, new_opt_state)``.

    Example:
        >>> import amp_core, jax, jax.numpy as jnp, optax
        >>> cfg, inner = amp_core.DynamicLossScale(init_scale=2.0**10), optax.sgd(0.1)
        >>> params = {"w": jnp.ones(3)}
        >>> opt_state = amp_core.with_loss_scaling(inner, cfg).init(params)
        >>> @jax.jit
        ... def train_step(params, opt_state):
        ...     scaler = amp_core.loss_scale_state(opt_state)
        ...     loss = lambda p: amp_core.scale_loss(scaler, jnp.sum(p["w"] ** 2))
        ...     grads = jax.grad(loss)(params)
        ...     return amp_core.apply_scaled_gradients(inner, cfg, grads, opt_state, params)
        >>> params, opt_state = train_step(params, opt_state)
        >>> params["w"]
        Array([0.8, 0.8, 0.8], dtype=float32)
    """
    if not isinstance(opt_state, LossScaledState):
        raise TypeError(
            "opt_state must be the LossScaledState made by with_loss_scaling(inner, config).init; "
            f"got {type(opt_state).__name__}"
        )
    check = check_and_update(config, opt_state.loss_scale, grads)
    scaler = check.next_state

    def apply(operand: tuple[optax.Params, optax.OptState]) -> tuple[optax.Params, optax.OptState]:
        old_params, inner_state = operand
        unscaled = apply_multiplier(grads, check.multiplier)
        updates, inner_state = inner.update(unscaled, inner_state, old_params)
        return optax.apply_updates(old_params, updates), inner_state

    operand = (params, opt_state.inner_state)
    if config.is_dynamic:
        new_params, inner_state = jax.lax.cond(check.isfinite, apply, lambda op: op, operand)
    else:  # static scaling never skips
        new_params, inner_state = apply(operand)
    return new_params, LossScaledState(scaler, inner_state)


def loss_scale_state(opt_state: Any) -> LossScaleState:
    """Finds the scaler state inside an optimizer state built with :func:`with_loss_scaling`.

    Works on the wrapper's own state and on states that nest it (``optax.chain``, ...).

    Raises:
        ValueError: there is no, or more than one, loss-scaled state inside ``opt_state``.

    Example:
        >>> import amp_core, jax.numpy as jnp, optax
        >>> scaled = amp_core.with_loss_scaling(optax.sgd(0.1), amp_core.DynamicLossScale())
        >>> tx = optax.chain(scaled, optax.scale(0.5))  # loss scaling first: it unscales
        >>> float(amp_core.loss_scale_state(tx.init(jnp.zeros(2))).loss_scale)
        32768.0
    """
    found = [
        node
        for node in jax.tree_util.tree_leaves(
            opt_state, is_leaf=lambda node: isinstance(node, LossScaledState)
        )
        if isinstance(node, LossScaledState)
    ]
    if len(found) != 1:
        raise ValueError(
            "opt_state must contain exactly one state made by amp_core.with_loss_scaling; "
            f"found {len(found)}"
        )
    return found[0].loss_scale


def value_and_grad(
    fun: Callable[..., Any],
    config: LossScaleConfig,
    *,
    argnums: int | Sequence[int] = 0,
    has_aux: bool = False,
) -> Callable[..., tuple[Any, Any, jax.Array, jax.Array]]:
    """Like ``jax.value_and_grad``, with the loss scaled before and the gradients unscaled after.

    The returned function takes the scaler state first, then ``fun``'s arguments, and returns
    ``(value, grads, isfinite, global_norm)``: ``value`` is ``fun``'s own (unscaled) output
    (``(loss, aux)`` with ``has_aux``), ``grads`` are unscaled (and clipped with DLS + GCC).
    Apply them only if ``isfinite`` (for example with ``jax.lax.cond``), then advance the scaler
    with :func:`amp_core.update`.

    Args:
        fun: the loss function; returns a scalar (or ``(scalar, aux)`` with ``has_aux``).
        config: the loss-scaling configuration.
        argnums: which arguments of ``fun`` to differentiate.
        has_aux: whether ``fun`` returns ``(loss, aux)``.

    Returns:
        ``grad_fn(state, *args, **kwargs) -> (value, grads, isfinite, global_norm)``.

    Example:
        >>> import amp_core, jax.numpy as jnp
        >>> cfg = amp_core.DynamicLossScale(init_scale=2.0**12)
        >>> grad_fn = amp_core.value_and_grad(lambda w: jnp.sum(w**2), cfg)
        >>> loss, grads, isfinite, norm = grad_fn(amp_core.init(cfg), jnp.array([1.0, 2.0]))
        >>> float(loss), grads, bool(isfinite)
        (5.0, Array([2., 4.], dtype=float32), True)
    """

    def scaled(state: LossScaleState, *args: Any, **kwargs: Any) -> tuple[jax.Array, Any]:
        out = fun(*args, **kwargs)
        loss = out[0] if has_aux else out
        return scale_loss(state, loss), out

    shifted = (argnums + 1) if isinstance(argnums, int) else tuple(a + 1 for a in argnums)
    grad_of_scaled = jax.grad(scaled, argnums=shifted, has_aux=True)

    def grad_fn(
        state: LossScaleState, *args: Any, **kwargs: Any
    ) -> tuple[Any, Any, jax.Array, jax.Array]:
        scaled_grads, value = grad_of_scaled(state, *args, **kwargs)
        grads, isfinite, global_norm = unscale_and_check(config, state, scaled_grads)
        return value, grads, isfinite, global_norm

    return grad_fn
