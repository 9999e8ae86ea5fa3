"""What a training loop logs and asks when steps are skipped: metrics and a per-leaf report.

The report is computed only when asked (never on the hot path).
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from amp_core.scaling import apply_multiplier, sum_of_unscaled_squares
from amp_core.transforms import loss_scale_state

METRIC_NAMES = ("loss_scale", "num_skipped_steps", "global_norm", "isfinite")
"""The keys of :func:`scaler_metrics`, in order (those of ``cstorch.amp.scaler_metrics``)."""


class LeafReport(NamedTuple):
    """What one gradient leaf contributed to an overflow.

    Attributes:
        overflows: whether this leaf alone makes the global norm non-finite (0-d bool): it holds
            an inf or NaN once unscaled, or values so large that their squares overflow float32.
        nonfinite_count: how many of its elements are inf or NaN once unscaled (0-d int32).

    Example:
        >>> import amp_core, jax.numpy as jnp
        >>> report = amp_core.nonfinite_report({"w": jnp.array([1.0, jnp.nan, 3e38])}, 0.5)
        >>> report["w"]._fields, bool(report["w"].overflows), int(report["w"].nonfinite_count)
        (('overflows', 'nonfinite_count'), True, 1)
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


def scaler_metrics(source: Any, *, as_arrays: bool = False) -> dict[str, Any]:
    """The scaler's numbers for a logger, as ``cstorch.amp.scaler_metrics`` gives them.

    ``loss_scale`` (the scale the next step will use), ``num_skipped_steps``, ``global_norm``
    (of the last step's unscaled gradients) and ``isfinite`` (whether the last step was
    applied), from any state :func:`amp_core.loss_scale_state` reads: a
    :class:`~amp_core.LossScaleState`, the state of :func:`amp_core.with_loss_scaling` or a tree
    that nests it, an ``nnx.Optimizer``, :class:`amp_core.flax_nnx.LossScaledOptimizer`,
    a linen ``TrainState``, a tree restored without a target.

    Args:
        source: where the scaler state is.
        as_arrays: return the 0-d arrays themselves (jittable, no host synchronisation)
            instead of Python numbers.

    Returns:
        ``{"loss_scale": float, "num_skipped_steps": int, "global_norm": float,
        "isfinite": bool}`` (one host transfer), or the same keys with 0-d arrays.

    Raises:
        ValueError: ``source`` holds no scaler state (see :func:`amp_core.loss_scale_state`).
        TypeError: Python numbers asked for inside ``jax.jit`` (pass ``as_arrays=True``).

    Example:
        >>> import amp_core, jax.numpy as jnp, optax
        >>> tx = amp_core.with_loss_scaling(optax.sgd(0.1), amp_core.DynamicLossScale())
        >>> amp_core.scaler_metrics(tx.init({"w": jnp.zeros(2)}))
        {'loss_scale': 32768.0, 'num_skipped_steps': 0, 'global_norm': 0.0, 'isfinite': True}
    """
    state = loss_scale_state(source)
    values = {name: getattr(state, name) for name in METRIC_NAMES}
    if as_arrays:
        return values
    host = jax.device_get(values)  # one transfer, not one per number
    if not all(isinstance(value, (np.ndarray, np.generic)) for value in host.values()):
        raise TypeError(
            "scaler_metrics(source) reads the numbers on the host, which it cannot do inside "
            "jax.jit (the scaler holds tracers); there, pass as_arrays=True"
        )
    return {
        "loss_scale": float(host["loss_scale"]),
        "num_skipped_steps": int(host["num_skipped_steps"]),
        "global_norm": float(host["global_norm"]),
        "isfinite": bool(host["isfinite"]),
    }
