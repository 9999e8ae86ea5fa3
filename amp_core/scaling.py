"""The pure loss-scaling functions: scale, unscale + check (+ clip), update, select.

Every function is jittable and free of host synchronisation; ``config`` is static (hashable),
``state`` and the gradients are data. Reductions accumulate in float32; element-wise results keep
each gradient's dtype.

The names that are not in ``amp_core.__all__`` and carry no leading underscore
(:func:`in_step_sum_of_unscaled_squares`, :func:`check_and_update_in_step`) are internal to
the package: shared between its modules, with no stability promise.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, NamedTuple, cast

import jax
import jax.numpy as jnp

from amp_core.config import DynamicLossScale, LossScaleConfig
from amp_core.state import COUNTER_DTYPE, LossScaleState

CLIP_EPSILON = 1e-6
"""Added to the global norm before dividing, as ``torch.nn.utils.clip_grad_norm_`` does.

Example:
    >>> import amp_core, numpy as np
    >>> amp_core.CLIP_EPSILON
    1e-06
    >>> coefficient = amp_core.clip_coefficient(np.float32(4.0), 2.0)  # the norm 4, clipped to 2
    >>> bool(coefficient == np.float32(2.0) / np.float32(4.0 + amp_core.CLIP_EPSILON))
    True
"""


class GradCheck(NamedTuple):
    """The result of reading a gradient tree once (:func:`check_grads`).

    Attributes:
        multiplier: what every gradient must be multiplied by: ``1 / loss_scale``, times the
            clip coefficient when GCC is configured and the gradients are finite (float32,
            0-d, always finite).
        isfinite: whether the step may be applied (bool, 0-d; always ``True`` for static
            scaling, which never checks).
        global_norm: the global L2 norm of the unscaled, unclipped gradients (float32, 0-d).

    Example:
        >>> import amp_core, jax.numpy as jnp
        >>> config = amp_core.DynamicLossScale(init_scale=4.0)
        >>> check = amp_core.check_grads(config, amp_core.init(config), [jnp.array([12.0, 16.0])])
        >>> float(check.multiplier), bool(check.isfinite), float(check.global_norm)
        (0.25, True, 5.0)
    """

    multiplier: jax.Array
    isfinite: jax.Array
    global_norm: jax.Array


def scale_loss(state: LossScaleState, loss: jax.typing.ArrayLike) -> jax.Array:
    """Returns ``float32(loss) * loss_scale``, the loss to differentiate.

    Example:
        >>> import amp_core, jax.numpy as jnp
        >>> state = amp_core.init(amp_core.DynamicLossScale(init_scale=8.0))
        >>> float(amp_core.scale_loss(state, jnp.float16(0.5)))
        4.0
    """
    return jnp.asarray(loss).astype(jnp.float32) * state.loss_scale


def inverse_scale(state: LossScaleState) -> jax.Array:
    """``1 / loss_scale`` in float32: what unscaling multiplies every gradient by.

    Example:
        >>> import amp_core
        >>> float(amp_core.inverse_scale(amp_core.init(amp_core.StaticLossScale(loss_scale=4.0))))
        0.25
    """
    return jnp.float32(1.0) / state.loss_scale


def _float_leaves(grads: Any) -> list[jax.Array]:
    return [g for g in jax.tree_util.tree_leaves(grads) if _is_float(g)]


def _is_float(leaf: Any) -> bool:
    return jnp.issubdtype(jnp.result_type(leaf), jnp.floating)


def _unscaled(grad: jax.Array, inv_scale: jax.Array) -> jax.Array:
    # Multiply in float32 and round once to the gradient's dtype, as torch's ``g.mul_(inv)`` does:
    # the reciprocal of a large scale (2**-31) is not representable in float16.
    # A float64 leaf (with 64-bit JAX disabled) is computed and returned in float32.
    return (grad.astype(jnp.float32) * inv_scale).astype(jax.dtypes.canonicalize_dtype(grad.dtype))


def sum_of_unscaled_squares(
    grads: Any, inv_scale: jax.typing.ArrayLike, *, branch_free: bool = False
) -> jax.Array:
    """``sum((g * inv_scale)**2)`` in float32 over all floating leaves, read-only.

    The squared global norm of the unscaled gradients, before the square root: the part of the
    overflow check that can be computed per shard and added up (see :func:`combine_partials`
    for distributed jobs). The unscaled values are rounded to each leaf's dtype before squaring
    (they are what the optimizer would see), and squared and summed in float32. A finite value
    whose square overflows float32 (``|g| >= ~1.8e19``) gives ``inf``. An empty tree gives 0.

    float32 leaves are read once, as ``inv_scale**2 * sum(g * g)``: for a power-of-two scale
    (every dynamic scale is one, unless ``init_scale`` is not) that is exactly
    ``sum((g * inv_scale)**2)``, since scaling by a power of two commutes with rounding; for
    other scales it differs by rounding only. Only when the raw squares overflow (an inf or NaN
    gradient, or a finite scaled one of ~1.8e19 or more) are the unscaled squares summed
    instead, in a second read under ``lax.cond``, so that the result is that of the *unscaled*
    gradients in every case.

    ``branch_free=True`` sums ``(g * inv_scale)**2`` directly instead, with no ``lax.cond``: on
    GPUs and TPUs XLA fuses the multiply into the reduction, so that is one read too, and a
    conditional there would make the device wait for the host (XLA evaluates its predicate on
    the host). For a power-of-two scale both give the same bits while the squares stay in
    float32's normal range; on XLA:CPU, which does not fuse an element-wise op into a
    reduction, the default is the faster.

    Example:
        >>> import amp_core, jax.numpy as jnp
        >>> float(amp_core.sum_of_unscaled_squares([jnp.array([6.0, 8.0])], 0.5))
        25.0
        >>> float(amp_core.sum_of_unscaled_squares([jnp.array([6.0, 8.0])], 0.5, branch_free=True))
        25.0
    """
    inv = jnp.asarray(inv_scale, jnp.float32)
    leaves = _float_leaves(grads)
    total = jnp.zeros((), jnp.float32)
    for grad in leaves:
        if grad.dtype != jnp.float32:
            total = total + jnp.sum(jnp.square(_unscaled(grad, inv).astype(jnp.float32)))
    float32_leaves = [g for g in leaves if g.dtype == jnp.float32]
    if float32_leaves and branch_free:
        total = total + _sum_of_squares([g * inv for g in float32_leaves])
    elif float32_leaves:
        total = total + _sum_of_unscaled_squares(float32_leaves, inv)
    return total


def in_step_sum_of_unscaled_squares(grads: Any, inv_scale: jax.typing.ArrayLike) -> jax.Array:
    """``sum((g * inv_scale)**2)`` inside a jitted step, each leaf read as its source allows.

    On the CPU, where a gradient comes from decides how it is best read:

    * **In memory** (a jit input, a concrete array, or a ``lax.scan``/``while_loop`` output, such
      as gradients summed over micro-batches): :func:`sum_of_unscaled_squares`, one read of each
      leaf and nothing written.
    * **Computed by the same XLA program** (the backward pass): XLA:CPU never fuses an
      element-wise producer into a reduction, so every such gradient is written out before it is
      summed, and its default scheduler runs all the writes before the first sum, so they are
      alive together: temporary memory the size of all the gradients, fresh (page-faulted) on
      every call (the figures: docs/performance-notes.md). So each leaf's unscaled values go
      through ``where(isnan(total_so_far), nan, g * inv)`` before they are squared and summed,
      ``total_so_far`` being the sum over the leaves before it. A select is not fused into the
      reduction, so the write of leaf ``i`` waits for the sum of leaf ``i - 1``, one leaf is
      alive at a time (memory the allocator reuses), and the unscale multiply rides in the write
      that happens anyway. The result is bit-identical to the branch-free sum: the running total
      only becomes NaN where the plain sum is NaN from then on, and ``inf`` is kept as ``inf``.

    The source is read from the tracer at trace time (JAX's jaxpr tracer records the equation
    that made a value; an input has none); a leaf whose source cannot be told counts as computed.
    For a power-of-two scale (every dynamic scale, unless ``init_scale`` is not one) both reads
    give the bits of ``branch_free=True``. Elsewhere (GPUs, TPUs), where XLA fuses the multiply
    into the reduction and a conditional would wait for the host, it is the branch-free sum.
    """
    inv = jnp.asarray(inv_scale, jnp.float32)
    leaves = _float_leaves(grads)
    if not leaves:
        return jnp.zeros((), jnp.float32)
    in_memory = [_in_memory(g) for g in leaves]
    cpu: Callable[[list[jax.Array], jax.Array], jax.Array]
    if all(in_memory):
        cpu = sum_of_unscaled_squares
    elif any(in_memory):
        cpu = functools.partial(_mixed_squares, in_memory=tuple(in_memory))
    else:
        cpu = _chained_squares
    return jax.lax.platform_dependent(leaves, inv, cpu=cpu, default=_fused_squares)


_WRITTEN_TO_MEMORY = frozenset({"scan", "while"})
"""Primitives whose outputs XLA:CPU writes to memory (loop carries), not fusible producers."""


def _in_memory(leaf: Any) -> bool:
    """Whether ``leaf`` is in memory before the step reads it (see the caller's docstring)."""
    if not isinstance(leaf, jax.core.Tracer):
        return True
    if not hasattr(leaf, "parent"):  # not a jaxpr tracer (grad, vmap): assume computed
        return False
    parent = leaf.parent
    return parent is None or getattr(parent.primitive, "name", None) in _WRITTEN_TO_MEMORY


def _mixed_squares(
    leaves: list[jax.Array], inv: jax.Array, *, in_memory: tuple[bool, ...]
) -> jax.Array:
    # The leaves in memory read once, the computed ones chained.
    stored = [g for g, m in zip(leaves, in_memory, strict=True) if m]
    computed = [g for g, m in zip(leaves, in_memory, strict=True) if not m]
    return sum_of_unscaled_squares(stored, inv) + _chained_squares(computed, inv)


def _unscaled_f32(grad: jax.Array, inv: jax.Array) -> jax.Array:
    """The unscaled values of ``grad`` as the optimizer sees them, in float32 for squaring."""
    if grad.dtype == jnp.float32:
        return grad * inv
    return _unscaled(grad, inv).astype(jnp.float32)


def _fused_squares(leaves: list[jax.Array], inv: jax.Array) -> jax.Array:
    # Off the CPU the multiply fuses into the reduction: the branch-free sum, as it is.
    return sum_of_unscaled_squares(leaves, inv, branch_free=True)


def _chained_squares(leaves: list[jax.Array], inv: jax.Array) -> jax.Array:
    # The order and association of sum_of_unscaled_squares: the other dtypes' leaves first, then
    # the float32 leaves' own sum added to theirs.
    gate = inv  # a traced, non-NaN value: the first leaf waits for nothing
    totals: list[jax.Array] = []
    for group in (
        [g for g in leaves if g.dtype != jnp.float32],
        [g for g in leaves if g.dtype == jnp.float32],
    ):
        total = jnp.zeros((), jnp.float32)
        for grad in group:
            unscaled = jnp.where(jnp.isnan(gate), jnp.float32(jnp.nan), _unscaled_f32(grad, inv))
            total = total + jnp.sum(jnp.square(unscaled))
            gate = total if not totals else totals[0] + total
        totals.append(total)
    return totals[0] + totals[1]


def global_norm_of_unscaled(grads: Any, inv_scale: jax.typing.ArrayLike) -> jax.Array:
    """The float32 L2 norm of ``grads * inv_scale``: ``sqrt(sum_of_unscaled_squares(...))``.

    Example:
        >>> import amp_core, jax.numpy as jnp
        >>> float(amp_core.global_norm_of_unscaled([jnp.array([6.0, 8.0])], 0.5))
        5.0
    """
    return jnp.sqrt(sum_of_unscaled_squares(grads, inv_scale))


def combine_partials(partials: jax.typing.ArrayLike, *, replicas: int = 1) -> jax.Array:
    """The global sum of squares from every rank's two partial sums (a distributed job).

    Each rank computes :func:`sum_of_unscaled_squares` twice over its local gradients: once over
    the *sharded* ones (each rank holds a different part, as FSDP2's local shards) and once over
    the *replicated* ones (every rank holds a copy, as after DDP's all-reduce). Gathered into a
    ``[ranks, 2]`` array, the global value is the sum of the sharded column plus the largest
    replicated value: identical replicas give that value, and a fault on one rank's copy (inf or
    NaN, which propagates through ``max``) reaches every rank's decision. Every rank combines
    the same gathered array in the same order, so all ranks get the same bits.

    With ``replicas > 1`` the ranks form that many replica groups, each holding every shard once
    (HSDP: a 2-D device mesh, the shards replicated over its first dimension); the rows are then
    in replica-major order (the mesh's ranks, row by row). The sharded sums add up within each
    replica group only, and the largest group total counts: identical replicas give the sum over
    one copy of the shards (summing every row would count each shard ``replicas`` times), and a
    fault in one group's copy still reaches every rank's decision.

    Args:
        partials: float32 ``[ranks, 2]``: per rank, the sharded and the replicated sum.
        replicas: how many replica groups the rows form (a positive integer dividing ``ranks``;
            static under ``jit``).

    Returns:
        The float32 global sum of squares, 0-d.

    Raises:
        ValueError: ``partials`` is not ``[ranks, 2]``, or ``replicas`` is not a positive
            integer that divides ``ranks``.

    Example:
        >>> import amp_core, jax.numpy as jnp
        >>> float(amp_core.combine_partials(jnp.array([[1.0, 4.0], [2.0, 4.0]])))
        7.0
        >>> hsdp = jnp.array([[1.0, 0.0], [2.0, 0.0], [1.0, 0.0], [2.0, 0.0]])  # 2 x 2 mesh
        >>> float(amp_core.combine_partials(hsdp, replicas=2))
        3.0
    """
    partials = jnp.asarray(partials, jnp.float32)
    if partials.ndim != 2 or partials.shape[1] != 2 or partials.shape[0] < 1:
        raise ValueError(
            f"partials must have shape [ranks, 2] (sharded, replicated); got {partials.shape}"
        )
    ranks = partials.shape[0]
    if isinstance(replicas, bool) or not isinstance(replicas, int) or replicas < 1:
        raise ValueError(f"replicas must be a positive integer; got {replicas!r}")
    if ranks % replicas:
        raise ValueError(
            f"replicas must divide the number of ranks (rows of partials, {ranks}); "
            f"got replicas={replicas}"
        )
    replicated = jnp.max(partials[:, 1])
    if replicas == 1:
        return jnp.sum(partials[:, 0]) + replicated
    per_replica = jnp.sum(partials[:, 0].reshape(replicas, ranks // replicas), axis=1)
    return jnp.max(per_replica) + replicated


def _sum_of_unscaled_squares(leaves: list[jax.Array], inv: jax.Array) -> jax.Array:
    """``sum((g * inv)**2)`` over float32 leaves, from one read of the scaled values."""
    raw = _sum_of_squares(leaves)

    def unscaled_squares() -> jax.Array:
        return _sum_of_squares([g * inv for g in leaves])

    return jax.lax.cond(jnp.isfinite(raw), lambda: raw * (inv * inv), unscaled_squares)


def _sum_of_squares(leaves: list[jax.Array]) -> jax.Array:
    total = jnp.zeros((), jnp.float32)
    for leaf in leaves:
        total = total + jnp.sum(jnp.square(leaf))
    return total


def clip_coefficient(global_norm: jax.Array, max_gradient_norm: float) -> jax.Array:
    """``min(max_gradient_norm / (global_norm + 1e-6), 1)`` in float32, as ``clip_grad_norm_``.

    Example:
        >>> import amp_core, jax.numpy as jnp
        >>> float(amp_core.clip_coefficient(jnp.float32(0.5), 1.0))
        1.0
    """
    coef = jnp.float32(max_gradient_norm) / (global_norm + jnp.float32(CLIP_EPSILON))
    return jnp.minimum(coef, jnp.float32(1.0))


def check_sum_of_squares(
    config: LossScaleConfig,
    state: LossScaleState,
    sum_of_squares: jax.typing.ArrayLike,
    *,
    unscaled: bool = False,
) -> GradCheck:
    """The overflow decision from the unscaled gradients' sum of squares.

    This is the finishing half of :func:`check_grads`, for callers that computed
    :func:`sum_of_unscaled_squares` themselves (per shard, then :func:`combine_partials`).

    Args:
        config: the loss-scaling configuration.
        state: the current state (its ``loss_scale`` scaled the gradients).
        sum_of_squares: float32 0-d, the global sum of squares of the unscaled gradients.
        unscaled: the gradients were already multiplied by ``1 / loss_scale``; the multiplier is
            then only the clip coefficient.

    Returns:
        A :class:`GradCheck`.

    Example:
        >>> import amp_core
        >>> cfg = amp_core.DynamicLossScale(init_scale=4.0, max_gradient_norm=1.0)
        >>> check = amp_core.check_sum_of_squares(cfg, amp_core.init(cfg), 25.0)
        >>> float(check.global_norm), round(float(check.multiplier), 4)
        (5.0, 0.05)
    """
    inv_scale = jnp.float32(1.0) if unscaled else inverse_scale(state)
    norm = jnp.sqrt(_scalar("sum_of_squares", sum_of_squares))
    if not isinstance(config, DynamicLossScale):
        return GradCheck(inv_scale, jnp.asarray(True), norm)
    isfinite = norm < jnp.float32(jnp.inf)
    multiplier = inv_scale
    if config.max_gradient_norm is not None:
        # On overflow the step is skipped; keep the multiplier finite (no clipping) so that
        # zeros stay zeros (a NaN norm would otherwise make every gradient NaN).
        coef = clip_coefficient(norm, config.max_gradient_norm)
        multiplier = inv_scale * jnp.where(isfinite, coef, jnp.float32(1.0))
    return GradCheck(multiplier, isfinite, norm)


def check_grads(
    config: LossScaleConfig, state: LossScaleState, grads: Any, *, unscaled: bool = False
) -> GradCheck:
    """Reads scaled gradients once: global norm, overflow flag and the multiplier to apply.

    This is the read-only half of :func:`unscale_and_check`: it never writes a gradient, so a
    caller that owns the gradient memory (the torch facade) applies ``multiplier`` in place. With
    DLS + GCC the multiplier already folds in the clip coefficient, so unscaling and clipping
    are one multiply.

    Args:
        config: the loss-scaling configuration.
        state: the current state (its ``loss_scale`` scaled these gradients).
        grads: any pytree; non-floating leaves and ``None`` are ignored.
        unscaled: the gradients were already multiplied by ``1 / loss_scale``; the multiplier is
            then only the clip coefficient.

    Returns:
        A :class:`GradCheck`.

    Example:
        >>> import amp_core, jax.numpy as jnp
        >>> cfg = amp_core.DynamicLossScale(init_scale=4.0, max_gradient_norm=1.0)
        >>> check = amp_core.check_grads(cfg, amp_core.init(cfg), {"w": jnp.array([12.0, 16.0])})
        >>> float(check.global_norm), bool(check.isfinite), round(float(check.multiplier), 4)
        (5.0, True, 0.05)
    """
    inv_scale = jnp.float32(1.0) if unscaled else inverse_scale(state)
    total = sum_of_unscaled_squares(grads, inv_scale)
    return check_sum_of_squares(config, state, total, unscaled=unscaled)


def apply_multiplier(grads: Any, multiplier: jax.typing.ArrayLike) -> Any:
    """Multiplies every floating leaf by ``multiplier`` in float32, keeping each leaf's dtype.

    Example:
        >>> import amp_core, jax.numpy as jnp
        >>> amp_core.apply_multiplier({"w": jnp.ones(2, jnp.float16)}, 0.25)["w"].dtype
        dtype('float16')
    """
    m = jnp.asarray(multiplier, jnp.float32)
    return jax.tree_util.tree_map(lambda g: _unscaled(g, m) if _is_float(g) else g, grads)


def unscale_and_check(
    config: LossScaleConfig, state: LossScaleState, grads: Any
) -> tuple[Any, jax.Array, jax.Array]:
    """Unscales (and with GCC clips) a gradient tree and checks it for overflow.

    Args:
        config: the loss-scaling configuration.
        state: the current state.
        grads: gradients of the scaled loss; any pytree.

    Returns:
        ``(grads, isfinite, global_norm)``: the unscaled (and clipped) gradients in their own
        dtypes, whether they are all finite (always ``True`` for static scaling), and the
        global norm of the unscaled gradients before clipping.

    Example:
        >>> import amp_core, jax.numpy as jnp
        >>> cfg = amp_core.DynamicLossScale(init_scale=4.0)
        >>> g, ok, norm = amp_core.unscale_and_check(cfg, amp_core.init(cfg), [jnp.array([4.0, jnp.inf])])
        >>> bool(ok), float(g[0][0])
        (False, 1.0)
    """
    check = check_grads(config, state, grads)
    return apply_multiplier(grads, check.multiplier), check.isfinite, check.global_norm


def update(
    config: LossScaleConfig,
    state: LossScaleState,
    isfinite: jax.typing.ArrayLike,
    global_norm: jax.typing.ArrayLike | None = None,
    *,
    optimizer_steps: jax.typing.ArrayLike = 1,
) -> LossScaleState:
    """Applies the SPEC section 2 update once, for a step whose overflow flag is ``isfinite``.

    Static scaling changes nothing but the recorded ``global_norm``. Dynamic scaling (all
    branch-free, so one XLA computation)::

        steps += 1; overflows += 1 - isfinite
        over = overflow_tolerance < overflows / steps     # float32, strict
        strike = over and absorbed < hysteresis - 1       # hysteresis absorbs it
        dec = over and not strike
        scale /= 1 + dec;  if over: steps = overflows = 0;  absorbed += strike
        if isfinite and consecutive_hysteresis: absorbed = 0
        inc = steps_per_increase < steps                  # strict
        scale *= 1 + inc
        if inc: steps = steps_per_increase + 1 - growth_interval; overflows = absorbed = 0
        scale = min(scale, max_loss_scale); non_clamped = scale
        scale = max(scale, min_loss_scale)
        num_skipped_steps += (1 - isfinite) * optimizer_steps
        overflows_at_min_scale = (overflows_at_min_scale + 1 if the step overflowed at
                                  min_loss_scale and was not absorbed; unchanged if it was
                                  absorbed; else 0)

    With the default ``hysteresis=1`` and ``growth_interval`` this is SPEC section 2.

    Args:
        config: the loss-scaling configuration.
        state: the state before the update.
        isfinite: 0-d bool, the step's overflow flag.
        global_norm: optional 0-d norm of the step, recorded in the state for inspection.
        optimizer_steps: how many optimizer steps this iteration took (or skipped): the
            reference counts every skipped optimizer step. An integer or a 0-d integer array.

    Returns:
        The new state.

    Raises:
        ValueError: ``isfinite``, ``global_norm`` or ``optimizer_steps`` is not 0-d.

    Example:
        >>> import amp_core
        >>> cfg = amp_core.DynamicLossScale(init_scale=1024.0)
        >>> float(amp_core.update(cfg, amp_core.init(cfg), False).loss_scale)
        512.0
    """
    isfinite = _scalar("isfinite", isfinite, jnp.bool_)
    norm = state.global_norm if global_norm is None else _scalar("global_norm", global_norm)
    steps_taken = _scalar("optimizer_steps", optimizer_steps, COUNTER_DTYPE)
    if not isinstance(config, DynamicLossScale):
        return state._replace(isfinite=jnp.asarray(True), global_norm=norm)
    overflow = jnp.logical_not(isfinite).astype(COUNTER_DTYPE)
    zero = jnp.zeros((), COUNTER_DTYPE)

    steps_per_increase = cast(int, config.steps_per_increase)  # resolved: never None
    # Resolved in __post_init__; None only in a configuration pickled before the field existed.
    growth_interval = (
        steps_per_increase + 1 if config.growth_interval is None else config.growth_interval
    )

    steps = state.steps_since_rescale + 1
    overflows = state.overflows_since_rescale + overflow
    ratio = overflows.astype(jnp.float32) / steps.astype(jnp.float32)
    over = jnp.float32(config.overflow_tolerance) < ratio
    absorbed = state.absorbed_overflows
    strike = jnp.logical_and(over, absorbed < config.hysteresis - 1)
    decrease = jnp.logical_and(over, jnp.logical_not(strike))
    scale = jnp.where(decrease, state.loss_scale / 2, state.loss_scale)
    steps = jnp.where(over, zero, steps)
    overflows = jnp.where(over, zero, overflows)
    absorbed = absorbed + strike.astype(COUNTER_DTYPE)
    if config.consecutive_hysteresis:
        absorbed = jnp.where(isfinite, zero, absorbed)

    increase = steps_per_increase < steps
    scale = jnp.where(increase, scale * 2, scale)
    restart = jnp.asarray(steps_per_increase + 1 - growth_interval, COUNTER_DTYPE)
    steps = jnp.where(increase, restart, steps)
    overflows = jnp.where(increase, zero, overflows)
    absorbed = jnp.where(increase, zero, absorbed)

    scale = jnp.minimum(scale, jnp.float32(config.max_loss_scale))
    non_clamped = scale
    scale = jnp.maximum(scale, jnp.float32(config.min_loss_scale))
    at_min = state.loss_scale <= jnp.float32(config.min_loss_scale)
    stalled_overflow = jnp.logical_and(jnp.logical_not(isfinite), at_min)
    at_min_count = jnp.where(stalled_overflow, state.overflows_at_min_scale + 1, zero)
    # An overflow that hysteresis absorbs does not try to lower the scale: not a stall, and
    # not the end of one either.
    at_min_count = jnp.where(strike, state.overflows_at_min_scale, at_min_count)
    return LossScaleState(
        loss_scale=scale,
        non_clamped_scale=non_clamped,
        steps_since_rescale=steps,
        overflows_since_rescale=overflows,
        num_skipped_steps=state.num_skipped_steps + overflow * steps_taken,
        isfinite=isfinite,
        global_norm=norm,
        overflows_at_min_scale=at_min_count,
        absorbed_overflows=absorbed,
    )


def recount_skipped_steps(
    previous: LossScaleState,
    state: LossScaleState,
    optimizer_steps: jax.typing.ArrayLike,
) -> LossScaleState:
    """``state`` (from :func:`update` of ``previous``) with its skip count for another step count.

    For a caller that updated before it knew how many optimizers would step (the torch facade
    takes its decision at the first ``unscale_``/``step`` of an iteration): ``num_skipped_steps``
    becomes ``previous.num_skipped_steps + (1 - state.isfinite) * optimizer_steps``.

    Example:
        >>> import amp_core
        >>> cfg = amp_core.DynamicLossScale()
        >>> before = amp_core.init(cfg)
        >>> after = amp_core.update(cfg, before, False)
        >>> int(amp_core.recount_skipped_steps(before, after, 2).num_skipped_steps)
        2
    """
    overflow = jnp.logical_not(state.isfinite).astype(COUNTER_DTYPE)
    steps_taken = _scalar("optimizer_steps", optimizer_steps, COUNTER_DTYPE)
    return state._replace(num_skipped_steps=previous.num_skipped_steps + overflow * steps_taken)


def is_stalled(config: LossScaleConfig, state: LossScaleState) -> jax.Array:
    """Whether the run can no longer progress: ``config.stall_steps`` consecutive overflows at
    ``min_loss_scale`` (0-d bool; always ``False`` for static scaling). Jittable.

    Example:
        >>> import amp_core
        >>> cfg = amp_core.DynamicLossScale(init_scale=1.0, min_loss_scale=1.0, stall_steps=2)
        >>> state = amp_core.init(cfg)
        >>> for _ in range(2):
        ...     state = amp_core.update(cfg, state, False)
        >>> bool(amp_core.is_stalled(cfg, state))
        True
    """
    if not isinstance(config, DynamicLossScale):
        return jnp.asarray(False)
    return state.overflows_at_min_scale >= cast(int, config.stall_steps)  # resolved: never None


class StepResult(NamedTuple):
    """The result of :func:`check_and_update`.

    Attributes:
        multiplier: what the gradients must be multiplied by this step (from the old scale).
        isfinite: whether the step may be applied.
        global_norm: the global norm of the unscaled gradients.
        next_state: the state after this step's update.

    Example:
        >>> import amp_core, jax.numpy as jnp
        >>> config = amp_core.DynamicLossScale(init_scale=4.0)
        >>> grads = [jnp.array([jnp.inf])]
        >>> result = amp_core.check_and_update(config, amp_core.init(config), grads)
        >>> bool(result.isfinite), float(result.multiplier), float(result.next_state.loss_scale)
        (False, 0.25, 2.0)
    """

    multiplier: jax.Array
    isfinite: jax.Array
    global_norm: jax.Array
    next_state: LossScaleState


def check_and_update(
    config: LossScaleConfig,
    state: LossScaleState,
    grads: Any,
    *,
    unscaled: bool = False,
    optimizer_steps: jax.typing.ArrayLike = 1,
) -> StepResult:
    """:func:`check_grads` and :func:`update` in one computation (one dispatch per step).

    ``unscaled`` is passed on to :func:`check_grads`, ``optimizer_steps`` to :func:`update`.

    Example:
        >>> import amp_core, jax.numpy as jnp
        >>> cfg = amp_core.DynamicLossScale(init_scale=8.0)
        >>> r = amp_core.check_and_update(cfg, amp_core.init(cfg), [jnp.array([jnp.nan])])
        >>> bool(r.isfinite), float(r.next_state.loss_scale)
        (False, 4.0)
    """
    inv_scale = jnp.float32(1.0) if unscaled else inverse_scale(state)
    total = sum_of_unscaled_squares(grads, inv_scale)
    return check_sum_and_update(
        config, state, total, unscaled=unscaled, optimizer_steps=optimizer_steps
    )


def check_and_update_in_step(
    config: LossScaleConfig, state: LossScaleState, grads: Any
) -> StepResult:
    """:func:`check_and_update` for gradients computed in the same jitted step (the optax
    wrapper, the fused apply, :func:`amp_core.value_and_grad`): the sum of squares is
    :func:`in_step_sum_of_unscaled_squares`."""
    total = in_step_sum_of_unscaled_squares(grads, inverse_scale(state))
    return check_sum_and_update(config, state, total)


def check_sum_and_update(
    config: LossScaleConfig,
    state: LossScaleState,
    sum_of_squares: jax.typing.ArrayLike,
    *,
    unscaled: bool = False,
    optimizer_steps: jax.typing.ArrayLike = 1,
) -> StepResult:
    """:func:`check_sum_of_squares` and :func:`update` in one computation.

    The finishing half of :func:`check_and_update`, for a sum of squares that was computed per
    shard and combined across ranks (:func:`combine_partials`).

    Example:
        >>> import amp_core
        >>> cfg = amp_core.DynamicLossScale(init_scale=8.0)
        >>> r = amp_core.check_sum_and_update(cfg, amp_core.init(cfg), float("inf"))
        >>> bool(r.isfinite), float(r.next_state.loss_scale)
        (False, 4.0)
    """
    check = check_sum_of_squares(config, state, sum_of_squares, unscaled=unscaled)
    next_state = update(
        config, state, check.isfinite, check.global_norm, optimizer_steps=optimizer_steps
    )
    return StepResult(check.multiplier, check.isfinite, check.global_norm, next_state)


def fused_optimizer_args(check: GradCheck | StepResult) -> tuple[jax.Array, jax.Array]:
    """``(grad_scale, found_inf)`` for optimizers with a fused unscale-and-skip kernel.

    Fused torch optimizers (``Adam(fused=True)``, ...) divide every gradient by ``grad_scale``
    and leave parameters and state untouched where ``found_inf`` is nonzero: handing them these
    two float32 scalars replaces the gradient write pass and the host synchronisation.

    Example:
        >>> import amp_core, jax.numpy as jnp
        >>> cfg = amp_core.DynamicLossScale(init_scale=8.0)
        >>> check = amp_core.check_grads(cfg, amp_core.init(cfg), [jnp.array([jnp.inf])])
        >>> [float(x) for x in amp_core.fused_optimizer_args(check)]
        [8.0, 1.0]
    """
    grad_scale = jnp.float32(1.0) / check.multiplier
    found_inf = jnp.logical_not(check.isfinite).astype(jnp.float32)
    return grad_scale, found_inf


def select_if_finite(isfinite: jax.typing.ArrayLike, new_tree: Any, old_tree: Any) -> Any:
    """Leaf-wise ``new if isfinite else old``, for small trees such as the scaler state.

    For whole parameter and optimizer-state trees prefer :func:`with_loss_scaling` or
    :func:`apply_scaled_gradients` (both place a select where each new leaf is defined): a
    select at the end reads and writes every leaf twice.

    Raises:
        ValueError: the two trees differ in structure.

    Example:
        >>> import amp_core, jax.numpy as jnp
        >>> amp_core.select_if_finite(False, {"w": jnp.ones(2)}, {"w": jnp.zeros(2)})["w"]
        Array([0., 0.], dtype=float32)
    """
    isfinite = _scalar("isfinite", isfinite, jnp.bool_)
    # Annotated: jax's own annotation of tree_structure does not resolve for mypy.
    new_def: jax.tree_util.PyTreeDef = jax.tree_util.tree_structure(new_tree)
    old_def: jax.tree_util.PyTreeDef = jax.tree_util.tree_structure(old_tree)
    if new_def != old_def:
        raise ValueError(
            f"select_if_finite needs new_tree and old_tree of the same structure; "
            f"got {new_def} and {old_def}"
        )
    return jax.tree_util.tree_map(lambda n, o: jnp.where(isfinite, n, o), new_tree, old_tree)


def _scalar(name: str, value: Any, dtype: Any = jnp.float32) -> jax.Array:
    array = jnp.asarray(value)
    if array.shape != ():
        raise ValueError(f"{name} must be a 0-d (scalar) array; got shape {array.shape}")
    return array.astype(dtype)
