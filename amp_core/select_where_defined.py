"""The skip of an overflowed step, branch-free: the inner update replayed, selecting state.

Internal to amp_core (:mod:`amp_core.transforms` calls it); no stability promise.

:func:`update_or_keep` returns the inner optimizer's updates and new state when the step is
finite, and ``-0.0`` updates with the old state, bit for bit, when it overflowed. Why it is not
``lax.cond(isfinite, inner_update, keep)``: a branch of a conditional hands its outputs out as
whole new arrays, so the updates leave it as an XLA temporary that ``optax.apply_updates`` then
reads back. Nothing fuses across the branch's boundary, and under ``jit`` that temporary is
fresh (page-faulted) memory on every call. Nor is it the inner update computed unconditionally
with ``select(isfinite, new, old)`` on its outputs: the updates are then computed from the
*unselected* new moments, which XLA can only recompute from the old ones after it has written
the selected ones in place, so it copies every state leaf first.

Instead the inner update is traced to a jaxpr and replayed equation by equation, and every value
that becomes a leaf of the new state is replaced, where it is defined, by
``select(isfinite, new, old)``. Whatever the update computes from it afterwards reads the
selected value, which equals the new one whenever the step is applied, so the dataflow is that
of the plain optimizer: each state leaf is written once, in place, and read back by the updates,
and XLA fuses unscaling, the optimizer and ``optax.apply_updates`` into the same passes. The
price is that an overflowed step computes the optimizer's arithmetic too, and discards it. What
each way cost when it was measured is on the docs' performance notes page
(docs/performance-notes.md, "Figures from amp_core's docstrings").
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import jax
from jax.extend.core import ClosedJaxpr, DropVar, Jaxpr, JaxprEqn, Literal, Var
from jax.extend.core.primitives import jit_p


def update_or_keep(
    inner_update: Callable[[Any, Any], tuple[Any, Any]],
    isfinite: jax.Array,
    grads: Any,
    inner_state: Any,
) -> tuple[Any, Any]:
    """``inner_update(grads, inner_state)`` if ``isfinite``, else ``(-0.0 updates, inner_state)``.

    ``inner_update`` is replayed with each new state leaf selected where it is defined (see the
    module docstring). On overflow the state leaves are the old ones, bit for bit, and the
    updates (computed from garbage) are replaced by ``-0.0``.

    Values defined inside a nested ``jit`` are selected inside its body (replayed inline);
    values defined inside other control flow are selected after it (correct, but XLA may then
    copy them).

    Raises:
        TypeError: ``inner_update`` returns a state of another structure than ``inner_state``.
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
