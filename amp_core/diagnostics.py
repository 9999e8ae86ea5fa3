"""Which gradients overflowed: a per-leaf report, computed only when asked (never on the hot path)."""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from amp_core.scaling import apply_multiplier, sum_of_unscaled_squares


class LeafReport(NamedTuple):
    """What one gradient leaf contributed to an overflow.

    Attributes:
        overflows: whether this leaf alone makes the global norm non-finite (0-d bool): it holds
            an inf or NaN once unscaled, or values so large that their squares overflow float32.
        nonfinite_count: how many of its elements are inf or NaN once unscaled (0-d int32).
    """

    overflows: jax.Array
    nonfinite_count: jax.Array


def nonfinite_report(grads: Any, inv_scale: jax.typing.ArrayLike = 1.0) -> Any:
    """Per leaf of ``grads``, whether it overflows and how many elements are inf or NaN.

    Read-only and jittable; meant for diagnosing a skipped step, not for every step. The values
    are unscaled (multiplied by ``inv_scale`` and rounded to each leaf's dtype) before they are
    checked, exactly as :func:`amp_core.check_grads` sees them. Non-floating leaves report no
    overflow.

    Args:
        grads: any pytree of gradients.
        inv_scale: what the gradients are multiplied by to unscale them (``1 / loss_scale``, or
            1 for gradients that are already unscaled).

    Returns:
        A pytree of ``grads``' structure with a :class:`LeafReport` in place of every leaf.

    Example:
        >>> import amp_core, jax.numpy as jnp
        >>> grads = {"a": jnp.array([1.0, jnp.inf, jnp.nan]), "b": jnp.ones(2)}
        >>> report = amp_core.nonfinite_report(grads)
        >>> bool(report["a"].overflows), int(report["a"].nonfinite_count)
        (True, 2)
        >>> bool(report["b"].overflows)
        False
    """
    inv = jnp.asarray(inv_scale, jnp.float32)

    def leaf_report(leaf: Any) -> LeafReport:
        leaf = jnp.asarray(leaf)
        if not jnp.issubdtype(leaf.dtype, jnp.floating):
            return LeafReport(jnp.asarray(False), jnp.zeros((), jnp.int32))
        unscaled = apply_multiplier(leaf, inv)
        count = jnp.sum(jnp.logical_not(jnp.isfinite(unscaled)), dtype=jnp.int32)
        overflows = jnp.logical_not(jnp.isfinite(sum_of_unscaled_squares([leaf], inv)))
        return LeafReport(overflows, count)

    return jax.tree_util.tree_map(leaf_report, grads)
