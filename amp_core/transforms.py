"""optax integration and a ``value_and_grad`` helper: loss scaling in a few lines of a train step.

The transformation is here; how it skips an overflowed step without ``lax.cond`` is in
:mod:`amp_core.select_where_defined`, and the guards on its composition with ``optax.MultiSteps``
and ``optax.chain`` are in :mod:`amp_core.composition_guards`.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Mapping, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

from amp_core.composition_guards import (
    is_default_skip_fn,
    multi_steps_of,
    refuse_inside_multi_steps,
    warn_if_chained_after_others,
)
from amp_core.config import DynamicLossScale, LossScaleConfig, StaticLossScale
from amp_core.scaling import (
    apply_multiplier,
    check_and_update_in_step,
    check_sum_of_squares,
    in_step_sum_of_unscaled_squares,
    inverse_scale,
    scale_loss,
)
from amp_core.select_where_defined import update_or_keep
from amp_core.spike_skip import SpikeState, check_spike, init_spikes
from amp_core.state import LossScaleState, init


class LossScaledState(NamedTuple):
    """Optimizer state of :func:`with_loss_scaling`.

    Attributes:
        scaler: the scaler state (read the skip signal from ``scaler.isfinite``). Named so
            that no name is taken twice: ``optax.tree_utils.tree_get(opt_state,
            "loss_scale")`` finds the current scale.
        inner_state: the wrapped transformation's state.
        spikes: the window of :class:`amp_core.SpikeSkip` (``None`` without spike skipping).

    Example:
        >>> import amp_core, jax.numpy as jnp, optax
        >>> tx = amp_core.with_loss_scaling(optax.sgd(0.1), amp_core.DynamicLossScale())
        >>> opt_state = tx.init({"w": jnp.zeros(2)})
        >>> type(opt_state).__name__, opt_state._fields
        ('LossScaledState', ('scaler', 'inner_state', 'spikes'))
        >>> float(optax.tree_utils.tree_get(opt_state, "loss_scale"))
        32768.0
    """

    scaler: LossScaleState
    inner_state: optax.OptState
    spikes: SpikeState | None = None


def with_loss_scaling(
    inner: optax.GradientTransformation | optax.MultiSteps, config: LossScaleConfig
) -> optax.GradientTransformation:
    """Wraps an optax transformation so that it consumes gradients of the *scaled* loss.

    ``update`` checks the gradients for overflow (their global norm, summed one leaf after the
    other), then unscales them (clipping them with DLS + GCC) inside ``inner.update``'s own
    passes. The check reads each gradient as its source allows: gradients computed in the same
    jitted step cost one write and two reads each, one alive at a time (the least XLA:CPU
    allows); gradients already in memory (jit inputs, the output of a ``lax.scan`` that
    accumulated them) are read once. On overflow the inner state comes back untouched
    (bit for bit) and the updates are ``-0.0``, so that ``optax.apply_updates`` leaves every
    parameter bit-identical (``x + -0.0 == x`` for every ``x``, signed zeros and NaN included).
    The scaler state advances on every step either way; static scaling never skips.

    The skip is branch-free: the inner update is computed on every step and each new state leaf
    is selected against the old one where it is defined, before the rest of the update reads
    it. Under ``jax.jit`` with the parameters and optimizer state donated, XLA then fuses
    unscaling, the optimizer and ``optax.apply_updates`` into in-place passes, as for the plain
    optimizer (see the docs' Performance page, docs/performance.md).

    **Composition.** The loss scaler wraps everything that reads gradient values: whatever runs
    before it sees the *scaled* gradients. ``optax.chain(optax.clip_by_global_norm(1.0),
    with_loss_scaling(tx, config))`` clips gradients that are ``loss_scale`` times too large
    (at a scale of ``2**10`` an update ~1000 times too small, silently); write
    ``with_loss_scaling(optax.chain(optax.clip_by_global_norm(1.0), tx), config)``, or set
    ``max_gradient_norm`` in ``config`` to clip in the check's own pass. ``init`` warns
    (``UserWarning``) when the scaler is not the first element of an ``optax.chain``; it cannot
    tell more (a chain's elements are closures, and one linear in the gradients, such as
    ``optax.scale``, is harmless there), so it does not raise.

    **Gradient accumulation.** An accumulated step is one step of the scaler: an inf or NaN in
    any micro-batch skips the whole accumulated step, the scale changes once per accumulated
    step, and the next accumulated step starts from a clean accumulator (torch's rule). Sum the
    scaled micro-batch gradients (``lax.scan`` or a loop, every micro-batch scaled by the scale
    read at the step's start) and call ``update`` once; or pass an ``optax.MultiSteps`` (the
    object or its ``gradient_transformation()``) as ``inner``: then every ``update`` call takes
    one micro-batch, the check runs on the accumulated gradients at every ``k``-th call, and
    the accumulator is reset by a select, so that an overflowed accumulated step leaves no inf
    or NaN behind (MultiSteps' own reset multiplies by zero, and ``0 * inf`` is NaN). The state
    is then MultiSteps' own, with the :class:`LossScaledState` as its ``inner_opt_state``.
    The other order, ``optax.MultiSteps(with_loss_scaling(tx, config), k)``, cannot hold the
    rule: the wrapped transformation never reaches MultiSteps' accumulator, so one overflowed
    step would leave NaN in it and skip every step after it. ``init`` raises ``ValueError``
    when it finds itself inside ``optax.MultiSteps.init``. A MultiSteps with a
    ``should_skip_update_fn`` is refused too: it would drop overflowed micro-batches before the
    scaler sees them, so the scale would never come down.

    Args:
        inner: any gradient transformation, e.g. ``optax.adamw(1e-3)``, or an
            ``optax.MultiSteps``.
        config: the loss-scaling configuration.

    Returns:
        A transformation whose state is a :class:`LossScaledState` (an
        ``optax.MultiStepsState`` holding one when ``inner`` is a MultiSteps).

    Raises:
        TypeError: ``inner`` is not an optax transformation, or ``config`` not a loss-scaling
            configuration.
        ValueError: ``inner`` is a MultiSteps with a ``should_skip_update_fn``; or (from
            ``init``) the transformation is inside ``optax.MultiSteps``.

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

        Accumulating two micro-batches with ``optax.MultiSteps``; the second overflows, so the
        accumulated step is skipped and the scale halves once:

        >>> acc_tx = amp_core.with_loss_scaling(optax.MultiSteps(optax.sgd(0.1), 2), cfg)
        >>> acc_state = acc_tx.init(params)
        >>> for micro_batch in (jnp.ones(3), jnp.full(3, jnp.inf)):
        ...     updates, acc_state = acc_tx.update({"w": micro_batch}, acc_state, params)
        >>> scaler = amp_core.loss_scale_state(acc_state)
        >>> float(scaler.loss_scale), int(scaler.num_skipped_steps), acc_state.acc_grads["w"]
        (512.0, 1, Array([0., 0., 0.], dtype=float32))
    """
    multi_steps = multi_steps_of(inner)
    if multi_steps is None and not isinstance(inner, optax.GradientTransformation):
        raise TypeError(
            "inner must be an optax.GradientTransformation or an optax.MultiSteps; "
            f"got {type(inner).__name__}"
        )
    if not isinstance(config, (DynamicLossScale, StaticLossScale)):
        raise TypeError(
            "config must be an amp_core.DynamicLossScale or StaticLossScale; "
            f"got {type(config).__name__}"
        )
    if multi_steps is not None:
        return _accumulating(multi_steps, config)
    assert isinstance(inner, optax.GradientTransformation)  # for mypy: checked above
    return _loss_scaled(inner, config, inside_multi_steps=False)


def _loss_scaled(
    inner: optax.GradientTransformation, config: LossScaleConfig, *, inside_multi_steps: bool
) -> optax.GradientTransformationExtraArgs:
    """The transformation of :func:`with_loss_scaling` for an ``inner`` that is not MultiSteps.

    ``inside_multi_steps``: made by :func:`_accumulating` to run inside its own MultiSteps,
    whose accumulator it resets cleanly; every other instance refuses to be initialized inside
    ``optax.MultiSteps``.
    """

    def init_fn(params: optax.Params) -> LossScaledState:
        if not inside_multi_steps:
            refuse_inside_multi_steps()
            warn_if_chained_after_others()
        spike_skip = getattr(config, "spike_skip", None)
        spikes = None if spike_skip is None else init_spikes(spike_skip)
        return LossScaledState(init(config), inner.init(params), spikes)

    def update_fn(
        updates: optax.Updates,
        state: LossScaledState,
        params: optax.Params | None = None,
        **extra_args: Any,
    ) -> tuple[optax.Updates, LossScaledState]:
        _check_opt_state("state", state)
        return _scaled_update(inner, config, updates, state, params, extra_args)

    return optax.GradientTransformationExtraArgs(init_fn, update_fn)


def _accumulating(
    multi_steps: optax.MultiSteps, config: LossScaleConfig
) -> optax.GradientTransformationExtraArgs:
    """``with_loss_scaling(multi_steps, config)``: MultiSteps over the loss-scaled inner.

    MultiSteps accumulates the scaled micro-batch gradients and calls its inner transformation
    (here the loss-scaled one) on the accumulated gradients, keeping the inner state (the
    scaler's included) only at every ``k``-th call: the check and the scaler's update take
    effect once per accumulated step. Its accumulator reset, ``(1 - emit) * acc``, is replaced
    by ``where(emitted, 0, acc)``, so that the NaN of an overflowed step does not carry over.
    """
    if not is_default_skip_fn(getattr(multi_steps, "_should_skip_update_fn", None)):
        raise ValueError(
            "with_loss_scaling takes the skip decision itself: an optax.MultiSteps with a "
            "should_skip_update_fn would drop overflowed micro-batches before the loss scaler "
            "sees them, and the scale would never come down; build the MultiSteps without "
            "should_skip_update_fn"
        )
    spike_skip = getattr(config, "spike_skip", None)
    if spike_skip is not None and spike_skip.metric == "loss":
        raise ValueError(
            'SpikeSkip(metric="loss") cannot watch an accumulated step through optax.MultiSteps: '
            'each update call sees one micro-batch\'s loss. Use metric="grad_norm" (the norm of '
            "the accumulated gradients), or sum the micro-batches in the step and pass their "
            "mean loss to with_loss_scaling(inner, config).update(..., loss=loss)"
        )
    scaled = _loss_scaled(multi_steps.inner_opt, config, inside_multi_steps=True)
    # The same MultiSteps (schedule, mean or sum, accumulator dtype) over the loss-scaled inner.
    accumulator = copy.copy(multi_steps)
    accumulator._opt = scaled  # optax.MultiSteps keeps its inner transformation in ``_opt``

    def init_fn(params: optax.Params) -> optax.MultiStepsState:
        refuse_inside_multi_steps()
        warn_if_chained_after_others()
        return accumulator.init(params)

    def update_fn(
        updates: optax.Updates,
        state: optax.MultiStepsState,
        params: optax.Params | None = None,
        **extra_args: Any,
    ) -> tuple[optax.Updates, optax.MultiStepsState]:
        if not isinstance(state, optax.MultiStepsState):
            raise TypeError(
                "state must be the optax.MultiStepsState made by with_loss_scaling(MultiSteps, "
                f"config).init; got {type(state).__name__}"
            )
        new_updates, new_state = accumulator.update(updates, state, params, **extra_args)
        emitted = new_state.mini_step == 0
        clean = jax.tree_util.tree_map(
            lambda acc: jnp.where(emitted, jnp.zeros_like(acc), acc), new_state.acc_grads
        )
        return new_updates, new_state._replace(acc_grads=clean)

    return optax.GradientTransformationExtraArgs(init_fn, update_fn)


def step_applied(opt_state: Any) -> jax.Array:
    """Whether the last ``update`` applied an optimizer step (0-d bool; jittable).

    ``loss_scale_state(opt_state).isfinite``, and, for the state of
    ``with_loss_scaling(optax.MultiSteps(...), config)``, only at the end of an accumulated
    step (MultiSteps' ``mini_step`` back to 0): a micro-batch that only accumulates applies
    nothing. Static scaling applies every step it ends.

    Example:
        >>> import amp_core, jax.numpy as jnp, optax
        >>> cfg = amp_core.DynamicLossScale()
        >>> tx = amp_core.with_loss_scaling(optax.MultiSteps(optax.sgd(0.1), 2), cfg)
        >>> state = tx.init(jnp.zeros(2))
        >>> _, state = tx.update(jnp.ones(2), state)
        >>> bool(amp_core.step_applied(state))
        False
        >>> _, state = tx.update(jnp.ones(2), state)
        >>> bool(amp_core.step_applied(state))
        True
    """
    tree = opt_state
    if not isinstance(opt_state, (tuple, list, Mapping)) and hasattr(opt_state, "opt_state"):
        tree = opt_state.opt_state
    applied = loss_scale_state(tree).isfinite
    nodes = jax.tree_util.tree_leaves(tree, is_leaf=_is_multi_steps_state)
    for node in jax.tree_util.tree_leaves(tree, is_leaf=_is_loss_scaled_state):
        if isinstance(node, LossScaledState) and node.spikes is not None:
            spiked = _plain_field("spiked", node.spikes.spiked)
            applied = jnp.logical_and(applied, jnp.logical_not(spiked))
    for node in nodes:
        if isinstance(node, optax.MultiStepsState):
            mini_step = _plain_field("mini_step", node.mini_step)
            applied = jnp.logical_and(applied, mini_step == 0)
    return applied


def _is_loss_scaled_state(node: Any) -> bool:
    return isinstance(node, LossScaledState)


def spike_state(source: Any) -> SpikeState | None:
    """The :class:`amp_core.SpikeState` in an optimizer state (``None`` without spike skipping).

    ``source`` as for :func:`loss_scale_state`: the state of :func:`with_loss_scaling`, a tree
    that nests it, or an object with an ``opt_state``. Jittable.

    Example:
        >>> import amp_core, jax.numpy as jnp, optax
        >>> cfg = amp_core.DynamicLossScale(spike_skip=amp_core.SpikeSkip(window=8))
        >>> state = amp_core.with_loss_scaling(optax.sgd(0.1), cfg).init(jnp.zeros(2))
        >>> int(amp_core.spike_state(state).num_spike_skips)
        0
    """
    tree = source
    if not isinstance(source, (tuple, list, Mapping)) and hasattr(source, "opt_state"):
        tree = source.opt_state
    found = [
        node.spikes
        for node in jax.tree_util.tree_leaves(tree, is_leaf=_is_loss_scaled_state)
        if isinstance(node, LossScaledState) and node.spikes is not None
    ]
    if len(found) > 1:
        raise ValueError(f"the state holds {len(found)} spike windows; expected at most one")
    if not found:
        return None
    spikes = found[0]
    return SpikeState(
        *(_plain_field(n, v) for n, v in zip(SpikeState._fields, spikes, strict=True))
    )


def _is_multi_steps_state(node: Any) -> bool:
    return isinstance(node, optax.MultiStepsState)


def _scaled_update(
    inner: optax.GradientTransformation,
    config: LossScaleConfig,
    grads: optax.Updates,
    state: LossScaledState,
    params: optax.Params | None,
    extra_args: Mapping[str, Any],
) -> tuple[optax.Updates, LossScaledState]:
    """The update of :func:`with_loss_scaling` (and of :func:`apply_scaled_gradients`).

    The check reads each gradient as its source allows
    (:func:`amp_core.scaling.in_step_sum_of_unscaled_squares`), the unscale multiply (and the
    clip coefficient) then fuse into the inner update's passes, and on overflow
    :func:`amp_core.select_where_defined.update_or_keep` keeps the old state and returns
    ``-0.0`` updates.
    """
    check = check_and_update_in_step(config, state.scaler, grads)
    unscaled = apply_multiplier(grads, check.multiplier)
    loss = extra_args.get("loss")
    extra_args = {k: v for k, v in extra_args.items() if k != "loss"}
    applied, next_scaler, spikes = check.isfinite, check.next_state, state.spikes
    spike_skip = getattr(config, "spike_skip", None)
    if spike_skip is not None:
        if not isinstance(spikes, SpikeState):
            raise TypeError(
                "the state has no spike window: make it with the init of a transformation "
                "whose config has spike_skip"
            )
        metric = check.global_norm if spike_skip.metric == "grad_norm" else _loss(loss)
        spike, spikes = check_spike(spike_skip, spikes, metric, check.isfinite)
        applied = jnp.logical_and(check.isfinite, jnp.logical_not(spike))
        # A spike is not an overflow: the scale and its counters stay as they were.
        kept = state.scaler._replace(isfinite=check.isfinite, global_norm=check.global_norm)
        next_scaler = jax.tree_util.tree_map(
            lambda old, new: jnp.where(spike, old, new), kept, check.next_state
        )

    def inner_update(
        grads: optax.Updates, inner_state: optax.OptState
    ) -> tuple[optax.Updates, optax.OptState]:
        return inner.update(grads, inner_state, params, **extra_args)

    if config.is_dynamic:
        new_updates, inner_state = update_or_keep(
            inner_update, applied, unscaled, state.inner_state
        )
    else:  # static scaling never skips
        new_updates, inner_state = inner_update(unscaled, state.inner_state)
    return new_updates, LossScaledState(next_scaler, inner_state, spikes)


def _loss(loss: Any) -> jax.Array:
    if loss is None:
        raise TypeError(
            'SpikeSkip(metric="loss") needs the step\'s loss: pass it to the update, '
            "tx.update(grads, opt_state, params, loss=loss) (the unscaled loss)"
        )
    value = jnp.asarray(loss, jnp.float32)
    if value.shape != ():
        raise ValueError(f"loss must be a 0-d (scalar) value; got shape {value.shape}")
    return value


def apply_scaled_gradients(
    inner: optax.GradientTransformation,
    config: LossScaleConfig,
    grads: optax.Updates,
    opt_state: LossScaledState,
    params: optax.Params,
    *,
    loss: jax.typing.ArrayLike | None = None,
) -> tuple[optax.Params, LossScaledState]:
    """One whole optimizer step from gradients of the scaled loss.

    Does what ``tx = with_loss_scaling(inner, config)``, ``tx.update`` and
    ``optax.apply_updates`` do together, with the same state (``tx.init(params)``) and the same
    dataflow: the check reads each gradient as its source allows, and the unscaling, the
    inner update and the parameter update fuse into the optimizer's own passes, each new state
    leaf selected against the old one where it is defined. A skipped step leaves the
    parameters and the inner state bit-identical (the optimizer's arithmetic is done and
    discarded). Under ``jax.jit`` with the parameters and state donated a step costs a little
    more than the plain optimizer's (see docs/performance.md).

    Args:
        inner: the optimizer, e.g. ``optax.adamw(1e-3)`` (the same one given to
            :func:`with_loss_scaling` to make ``opt_state``).
        config: the loss-scaling configuration.
        grads: gradients of the scaled loss.
        opt_state: a :class:`LossScaledState`, from ``with_loss_scaling(inner, config).init``.
        params: the parameters. Leaves whose gradient is ``None`` (an equinox model's
            activation functions and other non-array leaves, as ``eqx.filter_grad`` and
            :func:`value_and_grad` give them) pass through unchanged, as with
            ``eqx.apply_updates``; the inner optimizer sees the parameters that have gradients.
        loss: the step's unscaled loss, for ``SpikeSkip(metric="loss")`` (else unused).

    Returns:
        ``(new_params, new_opt_state)``.

    Raises:
        TypeError: ``inner`` is an ``optax.MultiSteps`` (one call is one whole step: sum the
            micro-batch gradients first), or ``opt_state`` is not a :class:`LossScaledState`.

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
    if multi_steps_of(inner) is not None:
        raise TypeError(
            "apply_scaled_gradients takes one whole step and cannot accumulate over calls; got "
            "an optax.MultiSteps as inner. Sum the scaled micro-batch gradients and call "
            "apply_scaled_gradients once per accumulated step, or use "
            "tx = amp_core.with_loss_scaling(optax.MultiSteps(inner, k), config) with "
            "tx.update and optax.apply_updates"
        )
    _check_opt_state("opt_state", opt_state)
    with_grads = _params_with_gradients(grads, params)
    extra = {} if loss is None else {"loss": loss}
    updates, state = _scaled_update(inner, config, grads, opt_state, with_grads, extra)
    return _merge_params(optax.apply_updates(with_grads, updates), params), state


def _is_none(node: Any) -> bool:
    return node is None


def _params_with_gradients(grads: Any, params: Any) -> Any:
    """``params`` in the structure of ``grads``: ``None`` wherever a gradient is ``None``."""
    try:
        return jax.tree_util.tree_map(
            lambda g, p: None if g is None else p, grads, params, is_leaf=_is_none
        )
    except ValueError as err:
        raise ValueError(
            "params must have the structure of grads, with any leaf (an activation function, "
            "a static field) wherever the gradient is None; got grads "
            f"{jax.tree_util.tree_structure(grads)} and params "
            f"{jax.tree_util.tree_structure(params)}"
        ) from err


def _merge_params(new_params: Any, params: Any) -> Any:
    """The updated leaves of ``new_params``, and ``params``' own wherever ``new_params`` is None."""
    return jax.tree_util.tree_map(
        lambda new, old: old if new is None else new, new_params, params, is_leaf=_is_none
    )


def _check_opt_state(name: str, opt_state: Any) -> None:
    if isinstance(opt_state, LossScaledState):
        return
    hint = ""
    if isinstance(opt_state, Mapping) or (
        isinstance(opt_state, (list, tuple)) and not hasattr(opt_state, "_fields")
    ):
        hint = f" ({_RESTORE_HINT})"
    raise TypeError(
        f"{name} must be the LossScaledState made by with_loss_scaling(inner, config).init; "
        f"got {type(opt_state).__name__}{hint}"
    )


_RESTORE_HINT = (
    "a checkpoint restored without a target gives plain dicts and lists: restore it with a "
    "target of the right structure (orbax's restore(path, target), nnx.state of a fresh "
    "optimizer, eqx.tree_deserialise_leaves(path, like)), or keep the scaler in the checkpoint "
    "as amp_core.to_state_dict(config, scaler) and load it with amp_core.from_state_dict"
)


def loss_scale_state(source: Any) -> LossScaleState:
    """Finds the scaler state in an optimizer state, a train state or an optimizer.

    ``source`` may be the state of :func:`with_loss_scaling` or any tree that nests it
    (``optax.chain``, ``optax.multi_steps``, ...); an object with an ``opt_state`` attribute
    (flax NNX's ``nnx.Optimizer``, flax linen's ``TrainState``, ...); a
    :class:`LossScaleState` itself; or a tree restored from a checkpoint without a target, in
    which the scaler is the one mapping whose keys are :class:`LossScaleState`'s fields.
    Wrapped leaves (NNX's ``OptArray`` variables) are unwrapped: every field comes back a plain
    array, so ``bool(state.isfinite)``, ``float(state.loss_scale)``, f-strings and
    :func:`amp_core.is_stalled` work on it outside ``jit``. Jittable.

    Args:
        source: where to look.

    Returns:
        The :class:`LossScaleState`, fields as arrays.

    Raises:
        ValueError: ``source`` holds no scaler state, or more than one; the message says how
            to restore a checkpoint so that it holds one.

    Example:
        >>> import amp_core, jax.numpy as jnp, optax
        >>> scaled = amp_core.with_loss_scaling(optax.sgd(0.1), amp_core.DynamicLossScale())
        >>> tx = optax.chain(scaled, optax.scale(0.5))  # loss scaling first: it unscales
        >>> scaler = amp_core.loss_scale_state(tx.init(jnp.zeros(2)))
        >>> f"{scaler.loss_scale:.1f}", bool(scaler.isfinite)
        ('32768.0', True)
    """
    tree = source
    if not isinstance(source, (tuple, list, Mapping)) and hasattr(source, "opt_state"):
        tree = source.opt_state
    nodes = jax.tree_util.tree_leaves(tree, is_leaf=_is_scaler_node)
    typed = [node for node in nodes if isinstance(node, (LossScaledState, LossScaleState))]
    if len(typed) == 1:
        found = typed[0]
        fields = found.scaler if isinstance(found, LossScaledState) else found
        if all(isinstance(field, jax.Array) for field in fields):
            return fields
        return LossScaleState(*(_plain_field(n, v) for n, v in zip(_FIELDS, fields, strict=True)))
    restored = [node for node in nodes if _is_scaler_mapping(node)]
    if not typed and len(restored) == 1:
        mapping = restored[0]
        return LossScaleState(*(_plain_field(n, mapping[n]) for n in _FIELDS if n in mapping))
    if typed:
        raise ValueError(
            "the state must contain exactly one state made by amp_core.with_loss_scaling; "
            f"found {len(typed)} in {type(source).__name__}"
        )
    raise ValueError(
        f"found 0 states made by amp_core.with_loss_scaling in {type(source).__name__}, and "
        f"{len(restored)} mappings with the keys {list(_FIELDS)} in their place; if it comes "
        f"from a checkpoint, {_RESTORE_HINT}"
    )


_FIELDS = LossScaleState._fields


_FIELDS_BEFORE_HYSTERESIS = frozenset(_FIELDS) - {"absorbed_overflows"}
"""The fields of a checkpoint saved before ``absorbed_overflows`` existed (it defaults to 0)."""


def _is_scaler_mapping(node: Any) -> bool:
    return isinstance(node, Mapping) and set(node.keys()) in (
        set(_FIELDS),
        _FIELDS_BEFORE_HYSTERESIS,
    )


def _is_scaler_node(node: Any) -> bool:
    return isinstance(node, (LossScaledState, LossScaleState)) or _is_scaler_mapping(node)


def _plain_field(name: str, value: Any) -> Any:
    """The one array inside ``value`` (an array, or a wrapper such as an NNX Variable)."""
    leaves = jax.tree_util.tree_leaves(value)
    if len(leaves) != 1:
        raise ValueError(
            f"the scaler field {name!r} must hold one array; got {type(value).__name__} "
            f"with {len(leaves)} leaves"
        )
    leaf = leaves[0]
    return leaf if isinstance(leaf, (jax.Array, np.ndarray, np.generic)) else jnp.asarray(leaf)


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

    As with ``eqx.filter_value_and_grad``, the gradient is taken with respect to the floating
    point JAX and NumPy arrays in the differentiated arguments; every other leaf (an equinox
    model's activation functions, Python numbers, integer arrays) passes through to ``fun``
    unchanged and gets a ``None`` gradient. An argument that is one such leaf gets ``None``.

    Args:
        fun: the loss function; returns a scalar (or ``(scalar, aux)`` with ``has_aux``).
        config: the loss-scaling configuration.
        argnums: which positional arguments of ``fun`` to differentiate.
        has_aux: whether ``fun`` returns ``(loss, aux)``.

    Returns:
        ``grad_fn(state, *args, **kwargs) -> (value, grads, isfinite, global_norm)``.

    Raises:
        ValueError: (when ``grad_fn`` is called) ``argnums`` names a missing argument.

    Example:
        >>> import amp_core, jax.numpy as jnp
        >>> cfg = amp_core.DynamicLossScale(init_scale=2.0**12)
        >>> grad_fn = amp_core.value_and_grad(lambda w: jnp.sum(w**2), cfg)
        >>> loss, grads, isfinite, norm = grad_fn(amp_core.init(cfg), jnp.array([1.0, 2.0]))
        >>> float(loss), grads, bool(isfinite)
        (5.0, Array([2., 4.], dtype=float32), True)
        >>> model = {"w": jnp.array([3.0]), "activation": jnp.tanh}  # a non-array leaf
        >>> fn = amp_core.value_and_grad(lambda m: jnp.sum(m["activation"](m["w"])), cfg)
        >>> fn(amp_core.init(cfg), model)[1]["activation"] is None
        True
    """
    positions = (argnums,) if isinstance(argnums, int) else tuple(argnums)

    def grad_fn(
        state: LossScaleState, *args: Any, **kwargs: Any
    ) -> tuple[Any, Any, jax.Array, jax.Array]:
        for position in positions:
            if not 0 <= position < len(args):
                raise ValueError(
                    f"argnums={argnums!r} names positional argument {position}; "
                    f"fun was given {len(args)}"
                )
        splits = [_split_differentiable(args[position]) for position in positions]

        def scaled(state: LossScaleState, *diff_leaves: list[Any]) -> tuple[jax.Array, Any]:
            full = list(args)
            for position, split, leaves in zip(positions, splits, diff_leaves, strict=True):
                full[position] = split.combine(leaves)
            out = fun(*full, **kwargs)
            loss = out[0] if has_aux else out
            return scale_loss(state, loss), out

        grad_of_scaled = jax.grad(scaled, argnums=tuple(range(1, len(positions) + 1)), has_aux=True)
        leaf_grads, value = grad_of_scaled(state, *(split.diff for split in splits))
        scaled_grads = tuple(
            split.unflatten(leaves) for split, leaves in zip(splits, leaf_grads, strict=True)
        )
        if isinstance(argnums, int):
            scaled_grads = scaled_grads[0]
        total = in_step_sum_of_unscaled_squares(scaled_grads, inverse_scale(state))
        check = check_sum_of_squares(config, state, total)
        grads = apply_multiplier(scaled_grads, check.multiplier)
        return value, grads, check.isfinite, check.global_norm

    return grad_fn


class _Split(NamedTuple):
    """One argument's leaves, split into those to differentiate and the rest."""

    treedef: Any
    is_diff: tuple[bool, ...]
    diff: list[Any]
    rest: list[Any]

    def combine(self, diff_leaves: list[Any]) -> Any:
        leaves = [
            d if m else r for d, r, m in zip(diff_leaves, self.rest, self.is_diff, strict=True)
        ]
        return jax.tree_util.tree_unflatten(self.treedef, leaves)

    def unflatten(self, leaves: list[Any]) -> Any:
        return jax.tree_util.tree_unflatten(self.treedef, leaves)


def _split_differentiable(tree: Any) -> _Split:
    leaves, treedef = jax.tree_util.tree_flatten(tree)
    is_diff = tuple(_is_inexact_array(leaf) for leaf in leaves)
    diff = [leaf if m else None for leaf, m in zip(leaves, is_diff, strict=True)]
    rest = [None if m else leaf for leaf, m in zip(leaves, is_diff, strict=True)]
    return _Split(treedef, is_diff, diff, rest)


def _is_inexact_array(leaf: Any) -> bool:
    """A JAX or NumPy array (or scalar) of a floating or complex dtype, as equinox's filter."""
    return isinstance(leaf, (jax.Array, np.ndarray, np.generic)) and jnp.issubdtype(
        leaf.dtype, jnp.inexact
    )
