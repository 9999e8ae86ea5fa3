"""optax integration and a ``value_and_grad`` helper: loss scaling in a few lines of a train step."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.extend.core import ClosedJaxpr, DropVar, Jaxpr, JaxprEqn, Literal, Var
from jax.extend.core.primitives import jit_p

from amp_core.config import DynamicLossScale, LossScaleConfig, StaticLossScale
from amp_core.scaling import apply_multiplier, check_and_update, scale_loss, unscale_and_check
from amp_core.state import LossScaleState, init


class LossScaledState(NamedTuple):
    """Optimizer state of :func:`with_loss_scaling`.

    Attributes:
        scaler: the scaler state (read the skip signal from ``scaler.isfinite``). Named so
            that no name is taken twice: ``optax.tree_utils.tree_get(opt_state,
            "loss_scale")`` finds the current scale.
        inner_state: the wrapped transformation's state.

    Example:
        >>> import amp_core, jax.numpy as jnp, optax
        >>> tx = amp_core.with_loss_scaling(optax.sgd(0.1), amp_core.DynamicLossScale())
        >>> opt_state = tx.init({"w": jnp.zeros(2)})
        >>> type(opt_state).__name__, opt_state._fields
        ('LossScaledState', ('scaler', 'inner_state'))
        >>> float(optax.tree_utils.tree_get(opt_state, "loss_scale"))
        32768.0
    """

    scaler: LossScaleState
    inner_state: optax.OptState


def with_loss_scaling(
    inner: optax.GradientTransformation, config: LossScaleConfig
) -> optax.GradientTransformation:
    """Wraps an optax transformation so that it consumes gradients of the *scaled* loss.

    ``update`` unscales the gradients (clipping them with DLS + GCC) and checks them for overflow
    in one read, then runs ``inner.update``. On overflow the inner state comes back untouched
    (bit for bit) and the updates are ``-0.0``, so that ``optax.apply_updates`` leaves every
    parameter bit-identical (``x + -0.0 == x`` for every ``x``, signed zeros and NaN included).
    The scaler state advances on every step either way; static scaling never skips.

    The skip is branch-free: the inner update is computed on every step and each new state leaf
    is selected against the old one where it is defined, before the rest of the update reads
    it. Under ``jax.jit`` with the parameters and optimizer state donated, XLA then fuses
    unscaling, the optimizer and ``optax.apply_updates`` into in-place passes, as for the plain
    optimizer (see the docs' Performance page, docs/performance.md).

    Args:
        inner: any gradient transformation, e.g. ``optax.adamw(1e-3)``.
        config: the loss-scaling configuration.

    Returns:
        A transformation whose state is a :class:`LossScaledState`.

    Raises:
        TypeError: ``inner`` is not an optax transformation, or ``config`` not a loss-scaling
            configuration.

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
    if not isinstance(config, (DynamicLossScale, StaticLossScale)):
        raise TypeError(
            "config must be an amp_core.DynamicLossScale or StaticLossScale; "
            f"got {type(config).__name__}"
        )

    def init_fn(params: optax.Params) -> LossScaledState:
        return LossScaledState(scaler=init(config), inner_state=inner.init(params))

    def update_fn(
        updates: optax.Updates,
        state: LossScaledState,
        params: optax.Params | None = None,
        **extra_args: Any,
    ) -> tuple[optax.Updates, LossScaledState]:
        _check_opt_state("state", state)
        check = check_and_update(config, state.scaler, updates)
        grads = apply_multiplier(updates, check.multiplier)

        def inner_update(
            grads: optax.Updates, inner_state: optax.OptState
        ) -> tuple[optax.Updates, optax.OptState]:
            return inner.update(grads, inner_state, params, **extra_args)

        if config.is_dynamic:
            new_updates, inner_state = _update_or_keep(
                inner_update, check.isfinite, grads, state.inner_state
            )
        else:  # static scaling never skips
            new_updates, inner_state = inner_update(grads, state.inner_state)
        return new_updates, LossScaledState(check.next_state, inner_state)

    return optax.GradientTransformation(init_fn, update_fn)


def _update_or_keep(
    inner_update: Callable[[Any, Any], tuple[Any, Any]],
    isfinite: jax.Array,
    grads: Any,
    inner_state: Any,
) -> tuple[Any, Any]:
    """``inner_update(grads, inner_state)`` if ``isfinite``, else ``(-0.0 updates, inner_state)``.

    Why not ``lax.cond``: a branch must hand its updates out as a whole new array, which
    ``optax.apply_updates`` then reads; under ``jit`` that array is an XLA temporary, fresh (and
    page-faulted) memory on every call. At 28M parameters (``python -m benchmarks``, size M) the
    step cost 2.2x plain AdamW that way. Why not a select at the end: the updates are computed
    from the *unselected* new moments, which XLA recomputes from the old ones after writing the
    selected ones in place, so it copies every state leaf first (3.5x).

    Instead the inner update is traced to a jaxpr and replayed, and every value that becomes a
    leaf of the new state is replaced, where it is defined, by ``select(isfinite, new, old)``.
    Whatever the update computes from it afterwards reads the selected value, which equals the
    new one whenever the step is applied, and the dataflow is that of the plain optimizer: each
    state leaf is written once, in place, and read back by the updates. On overflow the state
    leaves are the old ones, bit for bit, and the updates (computed from garbage) are replaced
    by ``-0.0``.

    Values defined inside a nested ``jit`` are selected inside its body (replayed inline);
    values defined inside other control flow are selected after it (correct, but XLA may then
    copy them).
    """
    closed, shapes = jax.make_jaxpr(inner_update, return_shape=True)(grads, inner_state)
    new_updates_shape, new_state_shape = shapes
    # Annotated: jax's own annotation of tree_structure does not resolve for mypy.
    state_def: jax.tree_util.PyTreeDef = jax.tree_util.tree_structure(inner_state)
    if jax.tree_util.tree_structure(new_state_shape) != state_def:
        raise TypeError(
            "inner.update must return a state of the structure it was given; got "
            f"{jax.tree_util.tree_structure(new_state_shape)} for {state_def}"
        )
    updates_def: jax.tree_util.PyTreeDef = jax.tree_util.tree_structure(new_updates_shape)
    jaxpr = closed.jaxpr
    old_leaves = jax.tree_util.tree_leaves(inner_state)
    state_in = jaxpr.invars[len(jaxpr.invars) - len(old_leaves) :]
    state_out = jaxpr.outvars[updates_def.num_leaves :]

    keep = _unique_slots(state_out, old_leaves, _defined_vars(jaxpr))
    outs = _replay(closed, jax.tree_util.tree_leaves((grads, inner_state)), keep, isfinite)

    # -0.0 is the exact additive identity: params + (-0.0) keeps -0.0, +0.0 and NaN.
    new_updates = [
        jax.lax.select(isfinite, u, jax.lax.full_like(u, -0.0))
        for u in outs[: updates_def.num_leaves]
    ]
    new_state = []
    for out_var, in_var, value, old in zip(
        state_out, state_in, outs[updates_def.num_leaves :], old_leaves, strict=True
    ):
        already_kept = out_var is in_var or _is_in(out_var, keep)
        new_state.append(value if already_kept else jax.lax.select(isfinite, value, old))
    return (
        jax.tree_util.tree_unflatten(updates_def, new_updates),
        jax.tree_util.tree_unflatten(state_def, new_state),
    )


def _defined_vars(jaxpr: Jaxpr) -> set[Var]:
    """The variables that ``jaxpr``'s equations define (not its inputs or constants)."""
    return {v for eqn in jaxpr.eqns for v in eqn.outvars if not isinstance(v, DropVar)}


def _unique_slots(
    out_vars: Sequence[Any], olds: Sequence[Any], defined: set[Var]
) -> dict[Var, Any]:
    """Maps each defined variable that is exactly one state leaf to that leaf's old value.

    A variable that is returned as two leaves has two old values to fall back on; it is selected
    per leaf at the output instead.
    """
    slots: dict[Var, list[Any]] = {}
    for var, old in zip(out_vars, olds, strict=True):
        if _is_in(var, defined):
            slots.setdefault(var, []).append(old)
    return {var: found[0] for var, found in slots.items() if len(found) == 1}


def _replay(
    closed: ClosedJaxpr, args: Sequence[Any], keep: dict[Var, Any], isfinite: jax.Array
) -> list[Any]:
    """Evaluates ``closed`` on ``args``; each variable in ``keep`` is selected where defined."""
    jaxpr = closed.jaxpr
    env: dict[Var, Any] = dict(zip(jaxpr.constvars, closed.consts, strict=True))
    env.update(zip(jaxpr.invars, args, strict=True))

    def read(atom: Any) -> Any:
        return atom.val if isinstance(atom, Literal) else env[atom]

    for eqn in jaxpr.eqns:
        inputs = [read(atom) for atom in eqn.invars]
        body_keep, done = _kept_in_body(eqn, keep)
        if body_keep:  # a nested jit defines kept values: replay its body, selecting inside
            outputs = _replay(eqn.params["jaxpr"], inputs, body_keep, isfinite)
        else:  # as jax.core.eval_jaxpr binds an equation
            with eqn.ctx.manager:
                outputs = eqn.primitive.bind(*inputs, **eqn.primitive.get_bind_params(eqn.params))
            if not eqn.primitive.multiple_results:
                outputs = [outputs]
        for var, value in zip(eqn.outvars, outputs, strict=True):
            if isinstance(var, DropVar):
                continue
            if var in keep and var not in done:
                value = jax.lax.select(isfinite, value, keep[var])
            env[var] = value
    return [read(atom) for atom in jaxpr.outvars]


def _kept_in_body(eqn: JaxprEqn, keep: dict[Var, Any]) -> tuple[dict[Var, Any], set[Var]]:
    """For a ``jit`` equation that defines kept variables: the kept map of its body.

    Returns:
        ``(body_keep, done)``: the body's variables to select, with their old values, and the
        equation's output variables whose values are thereby already selected.
    """
    if eqn.primitive is not jit_p or not any(var in keep for var in eqn.outvars):
        return {}, set()
    body = eqn.params["jaxpr"].jaxpr
    pairs = [(inner, outer) for inner, outer in zip(body.outvars, eqn.outvars, strict=True)]
    kept = [(inner, keep[outer]) for inner, outer in pairs if outer in keep]
    body_keep = _unique_slots([v for v, _ in kept], [old for _, old in kept], _defined_vars(body))
    done = {outer for inner, outer in pairs if outer in keep and _is_in(inner, body_keep)}
    return body_keep, done


def _is_in(atom: Any, variables: dict[Var, Any] | set[Var]) -> bool:
    """``atom in variables`` for a jaxpr atom (literals are not hashable)."""
    return isinstance(atom, Var) and atom in variables


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
    unscaling, the inner update and the parameter update all inside a ``lax.cond``: XLA fuses
    them into the optimizer's own passes, and a skipped step returns the parameters and inner
    state it was given (bit-identical by construction) without doing the optimizer's arithmetic
    at all. Under ``jax.jit`` with the parameters and state donated a step costs about what the
    wrapper's does, a little more than the plain optimizer's (see docs/performance.md); the
    wrapper computes the inner update on skipped steps too and discards it.

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
    _check_opt_state("opt_state", opt_state)
    check = check_and_update(config, opt_state.scaler, grads)
    scaler = check.next_state

    def apply(operand: tuple[optax.Params, optax.OptState]) -> tuple[optax.Params, optax.OptState]:
        old_params, inner_state = operand
        unscaled = apply_multiplier(grads, check.multiplier)
        updates, inner_state = inner.update(unscaled, inner_state, old_params)
        return optax.apply_updates(old_params, updates), inner_state

    operand = (_params_with_gradients(grads, params), opt_state.inner_state)
    if config.is_dynamic:
        new_params, inner_state = jax.lax.cond(check.isfinite, apply, lambda op: op, operand)
    else:  # static scaling never skips
        new_params, inner_state = apply(operand)
    return _merge_params(new_params, params), LossScaledState(scaler, inner_state)


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
        return LossScaleState(*(_plain_field(n, restored[0][n]) for n in _FIELDS))
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


def _is_scaler_mapping(node: Any) -> bool:
    return isinstance(node, Mapping) and set(node.keys()) == set(_FIELDS)


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
        grads, isfinite, global_norm = unscale_and_check(config, state, scaled_grads)
        return value, grads, isfinite, global_norm

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
