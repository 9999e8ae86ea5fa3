"""The JAX-native path: ``amp_core.with_loss_scaling`` around ``optax.adam``, float16 compute.

Parameters live in float32. Inside the loss they and the inputs are cast to float16, so the
forward pass and the backward pass run in float16; the loss itself is reduced in float32 and
multiplied by the loss scale (``amp_core.scale_loss``), and ``jax.grad`` of that scaled loss is
what the wrapped optimizer consumes. Nothing injects non-finite values: every overflow the run
shows is a float16 result of the backward pass that exceeded 65504.

With ``RunOptions.diagnostics`` every step also records why it overflowed (or did not):

* ``forward_finite``: the float16 forward loss was finite, so the overflow is in the backward;
* ``f32_peak``: the largest magnitude anywhere in the same step's backward pass, recomputed in
  float32 at the same loss scale: every activation cotangent and every parameter gradient. A
  float16 backward overflows when this exceeds :data:`demo.problem.FLOAT16_MAX`;
* ``f32_finite``: that float32 backward was finite (the overflow is float16's range alone);
* ``params_unchanged``: the parameters and Adam's state after the step are bit-identical to
  before it.

On the first skipped step the run also asks ``amp_core.nonfinite_report`` which gradients held
inf or NaN (recomputing that step's gradients once; :attr:`RunRecord.first_overflow`).
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
from tqdm.auto import tqdm

import amp_core
from demo.problem import Problem, RunOptions
from demo.records import RunRecord, diagnostic_extras
from demo.report import format_scale, overflow_summary

Params = list[dict[str, jax.Array]]


class StepStats(NamedTuple):
    """What one training step reports to the host (all 0-d arrays)."""

    loss: jax.Array
    scale: jax.Array
    isfinite: jax.Array
    num_skipped_steps: jax.Array
    forward_finite: jax.Array
    f32_finite: jax.Array
    f32_peak: jax.Array
    params_unchanged: jax.Array


def to_params(init_params: Sequence[tuple[np.ndarray, np.ndarray]]) -> Params:
    """Converts the problem's ``[(w, b), ...]`` into a JAX pytree of float32 arrays."""
    return [
        {"w": jnp.asarray(w, jnp.float32), "b": jnp.asarray(b, jnp.float32)} for w, b in init_params
    ]


def mlp(params: Params, x: jax.Array, taps: Sequence[jax.Array] | None = None) -> jax.Array:
    """The demo MLP in the dtype of ``params`` and ``x``.

    Args:
        params: ``[{"w", "b"}, ...]``; hidden layers use ``tanh``, the last one is linear.
        x: inputs ``(batch, in_features)``.
        taps: optional zeros added to every pre-activation and hidden activation (two per
            hidden layer, one for the output); differentiating with respect to them yields the
            cotangent of each intermediate result of the backward pass.

    Returns:
        The outputs ``(batch, 1)``.
    """
    tap_iter = iter(taps or ())
    h = x
    for i, layer in enumerate(params):
        z = h @ layer["w"] + layer["b"]
        if taps is not None:
            z = z + next(tap_iter)
        if i == len(params) - 1:
            return z
        h = jnp.tanh(z)
        if taps is not None:
            h = h + next(tap_iter)
    return h


def mse(outputs: jax.Array, targets: jax.Array) -> jax.Array:
    """Mean squared error, reduced in float32 whatever the dtype of ``outputs``."""
    return jnp.mean(jnp.square(outputs.astype(jnp.float32) - targets))


def mlp_loss(
    params: Params, x: jax.Array, y: jax.Array, taps: Sequence[jax.Array] | None = None
) -> jax.Array:
    """The training loss ``mse(mlp(params, x, taps), y)``, reduced in float32.

    The MLP computes in the dtype of ``params`` and ``x`` (float32 for the master parameters).
    """
    return mse(mlp(params, x, taps), y)


_full_loss_jit = jax.jit(mlp_loss)
"""``mlp_loss`` jitted once, for the whole-data-set loss of :func:`full_loss`."""


def loss_fp16(params: Params, x: jax.Array, y: jax.Array) -> jax.Array:
    """:func:`mlp_loss` with ``params`` and ``x`` cast to float16 (float16 forward and backward)."""
    half = jax.tree.map(lambda a: a.astype(jnp.float16), params)
    return mlp_loss(half, x.astype(jnp.float16), y)


def _tap_shapes(params: Params, batch_size: int) -> list[tuple[int, int]]:
    shapes = []
    for i, layer in enumerate(params):
        width = layer["w"].shape[1]
        shapes.append((batch_size, width))
        if i < len(params) - 1:
            shapes.append((batch_size, width))
    return shapes


def _bitwise_equal(a: Any, b: Any) -> jax.Array:
    """Whether two pytrees of arrays are bit-for-bit identical."""
    same = jnp.asarray(True)
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        if jnp.issubdtype(x.dtype, jnp.floating):
            bits = {2: jnp.uint16, 4: jnp.uint32, 8: jnp.uint64}[x.dtype.itemsize]
            x = jax.lax.bitcast_convert_type(x, bits)
            y = jax.lax.bitcast_convert_type(y, bits)
        same = same & jnp.all(x == y)
    return same


def make_fp16_step(tx: optax.GradientTransformation, diagnostics: bool = True) -> Any:
    """Builds the jitted float16 + dynamic-loss-scaling training step.

    Args:
        tx: a transformation built with ``amp_core.with_loss_scaling``.
        diagnostics: also compute the float32 reference backward and the bit-identity check.

    Returns:
        ``step(params, opt_state, x, y, batches, i) -> (params, opt_state, StepStats)``.
    """

    @jax.jit
    def step(
        params: Params,
        opt_state: optax.OptState,
        x: jax.Array,
        y: jax.Array,
        batches: jax.Array,
        i: jax.Array,
    ) -> tuple[Params, optax.OptState, StepStats]:
        index = batches[i]
        xb, yb = x[index], y[index]
        scaler = amp_core.loss_scale_state(opt_state)

        def scaled_loss(p: Params) -> tuple[jax.Array, jax.Array]:
            loss = loss_fp16(p, xb, yb)
            return amp_core.scale_loss(scaler, loss), loss

        grads, loss = jax.grad(scaled_loss, has_aux=True)(params)
        updates, new_opt_state = tx.update(grads, opt_state, params)
        new_params = optax.apply_updates(params, updates)
        new_scaler = amp_core.loss_scale_state(new_opt_state)

        if diagnostics:
            taps = [jnp.zeros(s, jnp.float32) for s in _tap_shapes(params, xb.shape[0])]

            def scaled_f32(p: Params, t: Any) -> jax.Array:
                return amp_core.scale_loss(scaler, mlp_loss(p, xb, yb, t))

            f32_grads = jax.grad(scaled_f32, argnums=(0, 1))(params, taps)
            leaves = jax.tree.leaves(f32_grads)
            f32_peak = jnp.max(jnp.stack([jnp.max(jnp.abs(g)) for g in leaves]))
            f32_finite = jnp.all(jnp.stack([jnp.all(jnp.isfinite(g)) for g in leaves]))
            unchanged = _bitwise_equal(
                (params, opt_state.inner_state), (new_params, new_opt_state.inner_state)
            )
        else:
            f32_peak, f32_finite, unchanged = jnp.float32(jnp.nan), jnp.asarray(True), False
        stats = StepStats(
            loss=loss,
            scale=scaler.loss_scale,
            isfinite=new_scaler.isfinite,
            num_skipped_steps=new_scaler.num_skipped_steps,
            forward_finite=jnp.isfinite(loss),
            f32_finite=f32_finite,
            f32_peak=f32_peak,
            params_unchanged=jnp.asarray(unchanged),
        )
        return new_params, new_opt_state, stats

    return step


@jax.jit
def _overflow_report(
    params: Params,
    scaler: amp_core.LossScaleState,
    x: jax.Array,
    y: jax.Array,
    batches: jax.Array,
    i: jax.Array,
) -> Any:
    """``amp_core.nonfinite_report`` of step ``i``'s scaled float16 gradients (recomputed)."""
    index = batches[i]
    xb, yb = x[index], y[index]
    grads = jax.grad(lambda p: amp_core.scale_loss(scaler, loss_fp16(p, xb, yb)))(params)
    return amp_core.nonfinite_report(grads, amp_core.inverse_scale(scaler))


def overflow_report(
    params: Params,
    scaler: amp_core.LossScaleState,
    x: jax.Array,
    y: jax.Array,
    batches: jax.Array,
    i: jax.Array,
) -> str:
    """Which gradients of step ``i`` (taken from ``params`` at loss scale ``scaler``) held inf
    or NaN, named ``layers.<k>.<w|b>``, as ``"2 of 6 gradients non-finite: ..."``.

    Recomputes the step's gradients: meant for a skipped step, not for every step.
    """
    report = jax.device_get(_overflow_report(params, scaler, x, y, batches, i))
    leaves = jax.tree_util.tree_flatten_with_path(
        report, is_leaf=lambda leaf: isinstance(leaf, amp_core.LeafReport)
    )[0]
    found = {}
    for path, leaf in leaves:
        if bool(leaf.overflows):
            keys = (getattr(key, "idx", getattr(key, "key", key)) for key in path)
            found["layers." + ".".join(map(str, keys))] = int(leaf.nonfinite_count)
    return overflow_summary(found, len(leaves))


def make_fp32_step(tx: optax.GradientTransformation) -> Any:
    """Builds the jitted float32 training step without loss scaling (the reference).

    Returns:
        ``step(params, opt_state, x, y, batches, i) -> (params, opt_state, loss)``.
    """

    @jax.jit
    def step(
        params: Params,
        opt_state: optax.OptState,
        x: jax.Array,
        y: jax.Array,
        batches: jax.Array,
        i: jax.Array,
    ) -> tuple[Params, optax.OptState, jax.Array]:
        index = batches[i]
        loss, grads = jax.value_and_grad(mlp_loss)(params, x[index], y[index])
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    return step


def full_loss(params: Params, problem: Problem) -> float:
    """The float32 loss of ``params`` on the whole data set."""
    return float(_full_loss_jit(params, problem.x, problem.y))


def run_fp16_dls(problem: Problem, options: RunOptions) -> RunRecord:
    """Trains with float16 compute and dynamic loss scaling through ``amp_core``.

    Args:
        problem: the shared model, data and hyperparameters.
        options: progress bar and diagnostics switches.

    Returns:
        The run's :class:`RunRecord` (named ``"jax fp16 + DLS"``).
    """
    config = amp_core.DynamicLossScale(**dataclasses.asdict(problem.scaler))
    tx = amp_core.with_loss_scaling(optax.adam(problem.learning_rate), config)
    start = time.perf_counter()
    params = to_params(problem.init_params)
    opt_state = tx.init(params)
    step = make_fp16_step(tx, options.diagnostics)
    x, y, batches = jnp.asarray(problem.x), jnp.asarray(problem.y), jnp.asarray(problem.batches)
    history: list[StepStats] = []
    first_overflow = None
    bar = tqdm(
        range(problem.steps), desc="jax fp16 + DLS", disable=not options.progress, unit="step"
    )
    for i in bar:
        before = params, amp_core.loss_scale_state(opt_state)
        params, opt_state, stats = step(params, opt_state, x, y, batches, jnp.int32(i))
        stats = jax.device_get(stats)
        history.append(stats)
        if not stats.isfinite and first_overflow is None:
            first_overflow = overflow_report(*before, x, y, batches, jnp.int32(i))
        if options.progress and (i % 10 == 0 or not stats.isfinite):
            bar.set_postfix(
                loss=f"{float(stats.loss):.3g}",
                scale=format_scale(float(stats.scale)),
                skipped=int(stats.num_skipped_steps),
            )
    bar.close()
    final_state = amp_core.loss_scale_state(opt_state)
    columns = StepStats(*(np.asarray(column) for column in zip(*history, strict=True)))
    extras = diagnostic_extras(columns._asdict()) if options.diagnostics else {}
    return RunRecord(
        name="jax fp16 + DLS",
        path="jax",
        losses=columns.loss,
        overflow=~columns.isfinite.astype(bool),
        final_loss=full_loss(params, problem),
        scales=columns.scale,
        final_scale=float(final_state.loss_scale),
        num_skipped_steps=int(final_state.num_skipped_steps),
        wall_time_s=time.perf_counter() - start,
        extras=extras,
        first_overflow=first_overflow,
    )


def run_fp32(problem: Problem, options: RunOptions) -> RunRecord:
    """Trains the same model on the same batches in float32 without loss scaling.

    Args:
        problem: the shared model, data and hyperparameters.
        options: progress bar switch.

    Returns:
        The run's :class:`RunRecord` (named ``"jax float32"``).
    """
    tx = optax.adam(problem.learning_rate)
    start = time.perf_counter()
    params = to_params(problem.init_params)
    opt_state = tx.init(params)
    step = make_fp32_step(tx)
    x, y, batches = jnp.asarray(problem.x), jnp.asarray(problem.y), jnp.asarray(problem.batches)
    losses = []
    bar = tqdm(range(problem.steps), desc="jax float32", disable=not options.progress, unit="step")
    for i in bar:
        params, opt_state, loss = step(params, opt_state, x, y, batches, jnp.int32(i))
        losses.append(float(loss))
        if options.progress and i % 10 == 0:
            bar.set_postfix(loss=f"{losses[-1]:.3g}")
    bar.close()
    return RunRecord(
        name="jax float32",
        path="jax",
        losses=np.asarray(losses),
        overflow=np.zeros(problem.steps, bool),
        final_loss=full_loss(params, problem),
        wall_time_s=time.perf_counter() - start,
    )


def run_jax_path(problem: Problem, options: RunOptions) -> list[RunRecord]:
    """The registered ``"jax"`` path: the float16 + DLS run and its float32 reference.

    Args:
        problem: the shared model, data and hyperparameters.
        options: how to run.

    Returns:
        ``[fp16 + DLS record, float32 record]``.
    """
    return [run_fp16_dls(problem, options), run_fp32(problem, options)]
