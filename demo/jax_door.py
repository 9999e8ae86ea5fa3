"""The JAX front door: the same GPT-2 architecture in flax NNX
(:class:`workbench.byte_gpt_jax.GPT`, its architecture and its rounding described there, the
same places as on the torch side, :mod:`demo.torch_door`), trained through
``amp_core.flax_nnx.LossScaledOptimizer`` (:func:`workbench.byte_gpt_jax.loss_scaled_step`).

The peer row uses ``jmp.DynamicLossScale`` around a plain ``nnx.Optimizer``, with its
documented ``scale`` / ``unscale`` / ``all_finite`` / ``select_tree`` / ``adjust`` loop.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import jmp
import numpy as np
from flax import nnx
from tqdm.auto import tqdm

import amp_core
from amp_core.flax_nnx import LossScaledOptimizer
from demo.rows import PEER_GROWTH_INTERVAL, PEER_INIT_SCALE, Row, RowResult
from workbench.byte_gpt import Settings
from workbench.byte_gpt_jax import GPT, adamw, cross_entropy, loss_and_grads, loss_scaled_step


def _config(row: Row, settings: Settings) -> amp_core.LossScaleConfig:
    if row.scaling == "none":
        return amp_core.StaticLossScale()
    clip = settings.max_gradient_norm if row.scaling == "dls+clip" else None
    start = settings.init_scale
    return amp_core.DynamicLossScale(
        half_dtype=row.fmt, init_scale=start, max_loss_scale=start, max_gradient_norm=clip
    )


def _jmp_step(
    graphdef: Any,
    state: Any,
    scaler: tuple[jax.Array, jax.Array],
    windows: jax.Array,
    divisor: jax.Array,
) -> tuple[Any, jax.Array, ...]:
    """One step with ``jmp.DynamicLossScale`` (its two arrays passed as ``scaler``)."""
    model, optimizer = nnx.merge(graphdef, state)
    loss_scale = jmp.DynamicLossScale(*scaler, period=PEER_GROWTH_INTERVAL)
    loss, grads = loss_and_grads(model, windows, divisor, loss_scale.scale)
    grads = loss_scale.unscale(grads)
    finite = jmp.all_finite(grads)
    before = jax.tree.map(lambda x: x, nnx.state((model, optimizer)))  # the values, not Variables
    optimizer.update(model, grads)
    nnx.update((model, optimizer), jmp.select_tree(finite, nnx.state((model, optimizer)), before))
    new = loss_scale.adjust(finite)
    scale = loss_scale.loss_scale
    return (
        nnx.state((model, optimizer)),
        loss,
        scale,
        ~finite,
        (new.loss_scale, new.counter),
    )


def _jitted(step: Callable[..., Any], fmt: str) -> Callable[..., Any]:
    """Every format's step compiled alike, with XLA's default options, so that the table's rows
    compare formats, not compilers (at optimisation level 0 float32's step ran about 2x slower
    and compiled no faster; docs/performance-notes.md)."""
    del fmt
    return jax.jit(step, static_argnums=0, donate_argnums=1)


_STEPS = {
    (name, fmt): _jitted(step, fmt)
    for name, step in (("amp_core", loss_scaled_step), ("jmp", _jmp_step))
    for fmt in ("float32", "float16", "bfloat16", "cbfloat16")
}


@nnx.jit
def _held_out(model: GPT, windows: jax.Array) -> jax.Array:
    return cross_entropy(model, windows)


@nnx.jit
def _float32_grads(model: GPT, windows: jax.Array, divisor: jax.Array) -> Any:
    return nnx.grad(lambda m: cross_entropy(m, windows) / divisor)(model)


# The steps are jitted with the graph definition static, and each row's optimizer holds a fresh
# optax transformation (closures) in it: every row, seed and k would trace and compile an
# identical step again (several seconds each on a CPU). Rows with the same format, scaling,
# configuration, schedule and model share the first one's definition, and so its compiled step.
_GRAPHDEFS: dict[tuple[Any, ...], Any] = {}


def _shared_graphdef(row: Row, settings: Settings, graphdef: Any) -> Any:
    config = None if row.scaling == "peer" else _config(row, settings)
    schedule = (settings.steps, settings.learning_rate, settings.warmup_steps)
    key = (row.scaling == "peer", row.fmt, config, schedule, settings.weight_decay, settings.size)
    return _GRAPHDEFS.setdefault(key, graphdef)


def train_row(
    row: Row,
    settings: Settings,
    batches: np.ndarray,
    held_out: np.ndarray,
    progress: bool = True,
    on_gradients: Callable[[Any], None] | None = None,
) -> RowResult:
    """Trains one row and measures it (see :func:`demo.torch_door.train_row`)."""
    model = GPT(settings.size, settings.seed, row.fmt)
    if row.scaling == "peer":
        optimizer: Any = nnx.Optimizer(model, adamw(settings), wrt=nnx.Param)
        scaler = (
            jnp.float32(settings.init_scale or PEER_INIT_SCALE),
            jnp.int32(0),
        )  # jmp's scale and counter
    else:
        optimizer = LossScaledOptimizer(
            model, adamw(settings), _config(row, settings), wrt=nnx.Param
        )
    graphdef, state = nnx.split((model, optimizer))
    graphdef = _shared_graphdef(row, settings, graphdef)
    losses: list[float] = []
    skipped: list[bool] = []
    scales: list[float] = []
    times: list[float] = []
    bar = tqdm(range(settings.steps), desc=f"jax {row.label}", disable=not progress, unit="step")
    divisor = jnp.float32(settings.loss_divisor)
    for step in bar:
        start = time.perf_counter()
        windows = jnp.asarray(batches[step])
        if row.scaling == "peer":
            step_fn = _STEPS["jmp", row.fmt]
            state, loss, scale, skip, scaler = step_fn(graphdef, state, scaler, windows, divisor)
        else:
            step_fn = _STEPS["amp_core", row.fmt]
            state, loss, scale, skip = step_fn(graphdef, state, windows, divisor)
        loss, scale, skip = jax.device_get((loss, scale, skip))
        losses.append(float(loss))
        scales.append(float(scale))
        skipped.append(bool(skip))
        times.append(time.perf_counter() - start)
        if step % 10 == 0 or skipped[-1]:
            bar.set_postfix(loss=f"{losses[-1]:.3f}", scale=f"{scales[-1]:g}", skipped=sum(skipped))
    bar.close()
    nnx.update((model, optimizer), state)
    if row.scaling == "peer":
        final_scale = float(scaler[0])
    else:
        final_scale = float(optimizer.scaler.loss_scale)
    model.fmt = "float32"  # the master weights, measured in float32
    last = batches[-1][0] if settings.micro_batches > 1 else batches[-1]
    grads = _float32_grads(model, jnp.asarray(last), divisor)
    if on_gradients is not None:
        on_gradients(grads)
    underflow_at_1 = underflow_at_scale = None
    if row.fmt != "float32":
        underflow_at_1 = _underflow_fraction(grads, row.fmt, 1.0)
        if row.is_scaled:
            underflow_at_scale = _underflow_fraction(grads, row.fmt, final_scale)
    return RowResult(
        front_door="jax",
        row=row,
        held_out_loss=float(_held_out(model, jnp.asarray(held_out))),
        train_losses=losses,
        skipped=skipped,
        scales=scales if row.is_scaled else None,
        final_scale=final_scale if row.is_scaled else None,
        underflow_at_1=underflow_at_1,
        underflow_at_scale=underflow_at_scale,
        time_per_step_s=float(np.median(times[1:] if len(times) > 1 else times)),
    )


@functools.partial(jax.jit, static_argnums=1)
def _range_totals(grads: Any, fmt: str, scale: jax.Array) -> amp_core.GradientRange:
    report = amp_core.gradient_range_report(grads, half_dtype=fmt, loss_scale=scale)
    return amp_core.gradient_range_totals(report)


def _underflow_fraction(grads: Any, fmt: str, scale: float) -> float:
    """The fraction of gradient elements that underflow in ``fmt`` at ``scale``."""
    total = jax.device_get(_range_totals(nnx.to_pure_dict(grads), fmt, jnp.float32(scale)))
    return int(total.underflows) / max(int(total.size), 1)


def first_step_ranges(
    settings: Settings, windows: np.ndarray, formats: Sequence[str]
) -> dict[str, tuple[float, float]]:
    """The gradient-range report of the first step, per format (see
    :func:`demo.torch_door.first_step_ranges`)."""
    model = GPT(settings.size, settings.seed)
    divisor = jnp.float32(settings.loss_divisor)
    grads = _float32_grads(model, jnp.asarray(windows), divisor)
    ranges = {}
    for fmt in formats:
        suggested = amp_core.suggested_loss_scale(nnx.to_pure_dict(grads), half_dtype=fmt)
        ranges[fmt] = (_underflow_fraction(grads, fmt, 1.0), float(suggested))
    return ranges


def gradient_log2(grads: Any) -> np.ndarray:
    """log2 of the magnitudes of the nonzero elements of ``grads``."""
    values = np.concatenate([np.ravel(np.asarray(g)) for g in jax.tree.leaves(grads)])
    values = np.abs(values[values != 0]).astype(np.float64)
    return np.log2(values)
