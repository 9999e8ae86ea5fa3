"""The JAX front door: the same GPT-2 architecture in flax NNX, trained through
``amp_core.flax_nnx.LossScaledOptimizer``.

:class:`GPT` is GPT-2 as transformers writes it (learned positions, pre-norm blocks, causal
self-attention, a tanh-GELU MLP, a final layer norm, the output layer tied to the token
embedding), starting from the same numpy weights as the torch front door
(:func:`demo.text.initial_weights`), so the two float32 rows start from the same loss.

Half formats are computed as on the torch side (:mod:`demo.torch_door`): float32 master
weights; every weight as it is read, and the output of every place where transformers' model has
a module (embeddings, layer norms, linear layers, the GELU, the attention and MLP blocks, each
block), rounded to the row's format in both directions; float32 arithmetic in between. float16
and bfloat16 round with JAX's own casts (``x.astype(jnp.float16).astype(jnp.float32)``, whose
transpose rounds the gradient), cbfloat16 with ``hardware.CBFLOAT16.cast``.

The training step, for this library's rows::

    grads = nnx.grad(lambda m: optimizer.scale_loss(loss_fn(m)))(model)
    isfinite = optimizer.update(model, grads)   # skips (and keeps every bit) on overflow

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
import optax
from flax import nnx
from tqdm.auto import tqdm

import amp_core
import hardware
from amp_core.flax_nnx import LossScaledOptimizer
from demo.rows import PEER_GROWTH_INTERVAL, PEER_INIT_SCALE, Row, RowResult
from demo.text import ModelSize, Settings, initial_weights

Cast = Callable[[jax.Array], jax.Array]


def format_cast(fmt: str) -> Cast:
    """The cast (both directions) to ``fmt`` in a float32 container."""
    if fmt == "float32":
        return lambda x: x
    if fmt == "cbfloat16":
        return hardware.CBFLOAT16.cast
    dtype = {"float16": jnp.float16, "bfloat16": jnp.bfloat16}[fmt]
    return lambda x: x.astype(dtype).astype(jnp.float32)


def _layer_norm(x: jax.Array, scale: jax.Array, bias: jax.Array) -> jax.Array:
    mean = jnp.mean(x, axis=-1, keepdims=True)
    var = jnp.mean(jnp.square(x - mean), axis=-1, keepdims=True)
    return (x - mean) * jax.lax.rsqrt(var + 1e-5) * scale + bias


class Block(nnx.Module):
    """One GPT-2 block: ``x + attn(ln_1(x))``, then ``+ mlp(ln_2(.))``."""

    def __init__(self, weights: dict[str, np.ndarray], prefix: str, n_head: int) -> None:
        def param(name: str) -> nnx.Param:
            return nnx.Param(jnp.asarray(weights[prefix + name]))

        self.n_head = n_head
        self.ln_1_w, self.ln_1_b = param("ln_1.weight"), param("ln_1.bias")
        self.attn_w, self.attn_b = param("attn.c_attn.weight"), param("attn.c_attn.bias")
        self.proj_w, self.proj_b = param("attn.c_proj.weight"), param("attn.c_proj.bias")
        self.ln_2_w, self.ln_2_b = param("ln_2.weight"), param("ln_2.bias")
        self.fc_w, self.fc_b = param("mlp.c_fc.weight"), param("mlp.c_fc.bias")
        self.out_w, self.out_b = param("mlp.c_proj.weight"), param("mlp.c_proj.bias")

    def __call__(self, x: jax.Array, r: Cast) -> jax.Array:
        def linear(h: jax.Array, w: nnx.Param, b: nnx.Param) -> jax.Array:
            return r(h @ r(w[...]) + r(b[...]))

        batch, length, width = x.shape
        heads = self.n_head
        a = r(_layer_norm(x, r(self.ln_1_w[...]), r(self.ln_1_b[...])))
        q, k, v = jnp.split(linear(a, self.attn_w, self.attn_b), 3, axis=-1)
        q, k, v = (
            t.reshape(batch, length, heads, width // heads).swapaxes(1, 2) for t in (q, k, v)
        )
        scores = (q @ k.swapaxes(-1, -2)) * (width // heads) ** -0.5
        causal = jnp.tril(jnp.ones((length, length), bool))
        scores = jnp.where(causal, scores, jnp.finfo(jnp.float32).min)
        attended = jax.nn.softmax(scores, axis=-1) @ v
        attended = attended.swapaxes(1, 2).reshape(batch, length, width)
        x = x + linear(attended, self.proj_w, self.proj_b)
        m = r(_layer_norm(x, r(self.ln_2_w[...]), r(self.ln_2_b[...])))
        m = r(jax.nn.gelu(linear(m, self.fc_w, self.fc_b), approximate=True))
        return r(x + linear(m, self.out_w, self.out_b))


class GPT(nnx.Module):
    """GPT-2 with a byte vocabulary, computing in the format of the cast ``r``.

    Args:
        size: the model size.
        seed: the seed of :func:`demo.text.initial_weights`.
        fmt: the row's format.
    """

    def __init__(self, size: ModelSize, seed: int, fmt: str = "float32") -> None:
        weights = initial_weights(size, seed)
        self.fmt = fmt
        self.wte = nnx.Param(jnp.asarray(weights["transformer.wte.weight"]))
        self.wpe = nnx.Param(jnp.asarray(weights["transformer.wpe.weight"]))
        self.blocks = nnx.List(
            [Block(weights, f"transformer.h.{i}.", size.n_head) for i in range(size.n_layer)]
        )
        self.ln_f_w = nnx.Param(jnp.asarray(weights["transformer.ln_f.weight"]))
        self.ln_f_b = nnx.Param(jnp.asarray(weights["transformer.ln_f.bias"]))

    def __call__(self, ids: jax.Array) -> jax.Array:
        """The logits ``(batch, length, 256)`` of the byte ids ``(batch, length)``."""
        r = format_cast(self.fmt)
        wte = r(self.wte[...])
        x = r(wte[ids] + r(self.wpe[...])[: ids.shape[1]])
        for block in self.blocks:
            x = block(x, r)
        x = r(_layer_norm(x, r(self.ln_f_w[...]), r(self.ln_f_b[...])))
        return r(x @ wte.T)


def cross_entropy(model: GPT, windows: jax.Array) -> jax.Array:
    """Mean next-byte cross-entropy (float32)."""
    logits = model(windows[:, :-1]).astype(jnp.float32)
    return optax.softmax_cross_entropy_with_integer_labels(logits, windows[:, 1:]).mean()


def _tx(settings: Settings) -> optax.GradientTransformation:
    return optax.adamw(settings.learning_rate_at, weight_decay=settings.weight_decay)


def _config(row: Row, settings: Settings) -> amp_core.LossScaleConfig:
    if row.scaling == "none":
        return amp_core.StaticLossScale()
    clip = settings.max_gradient_norm if row.scaling == "dls+clip" else None
    start = settings.init_scale
    return amp_core.DynamicLossScale(
        half_dtype=row.fmt, init_scale=start, max_loss_scale=start, max_gradient_norm=clip
    )


def _loss_and_grads(
    model: GPT, windows: jax.Array, divisor: jax.Array, scale_loss: Callable[[jax.Array], Any]
) -> tuple[jax.Array, Any]:
    """The mean loss and the gradients of ``scale_loss(loss / divisor)``.

    ``windows`` of ``(batch, n_positions + 1)``: one micro-batch. ``(micro_batches, batch,
    n_positions + 1)``: the micro-batches one after the other (a ``lax.scan``), their gradients
    summed in float32, as the torch loop's ``.grad`` accumulates them.
    """

    def objective(m: GPT, w: jax.Array) -> tuple[jax.Array, jax.Array]:
        loss = cross_entropy(m, w)
        return scale_loss(loss / divisor), loss

    if windows.ndim == 2:
        (_, loss), grads = nnx.value_and_grad(objective, has_aux=True)(model, windows)
        return loss, grads
    graph, params, rest = nnx.split(model, nnx.Param, ...)

    def micro(total: Any, w: jax.Array) -> tuple[Any, jax.Array]:
        (_, loss), g = jax.value_and_grad(
            lambda p: objective(nnx.merge(graph, p, rest), w), has_aux=True
        )(params)
        return jax.tree.map(jnp.add, total, g), loss

    grads, losses = jax.lax.scan(micro, jax.tree.map(jnp.zeros_like, params), windows)
    return losses.mean(), grads


def _amp_core_step(
    graphdef: Any, state: Any, windows: jax.Array, divisor: jax.Array
) -> tuple[Any, jax.Array, ...]:
    """One step of ``LossScaledOptimizer``: returns the new state, the loss, the scale the
    step used and whether it was skipped."""
    model, optimizer = nnx.merge(graphdef, state)
    scale = optimizer.scaler.loss_scale
    loss, grads = _loss_and_grads(model, windows, divisor, optimizer.scale_loss)
    isfinite = optimizer.update(model, grads)
    return nnx.state((model, optimizer)), loss, scale, ~isfinite


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
    loss, grads = _loss_and_grads(model, windows, divisor, loss_scale.scale)
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


QUICK_COMPILE = {"xla_backend_optimization_level": 0}
"""XLA:CPU options for the steps of the float32, float16 and bfloat16 rows: compiling them takes
half the time, and they run as fast. (cbfloat16's bit-exact rounding keeps the default: without
LLVM's optimisations its step ran 5x slower.)"""


def _jitted(step: Callable[..., Any], fmt: str) -> Callable[..., Any]:
    options = None if fmt == "cbfloat16" else QUICK_COMPILE
    return jax.jit(step, static_argnums=0, donate_argnums=1, compiler_options=options)


_STEPS = {
    (name, fmt): _jitted(step, fmt)
    for name, step in (("amp_core", _amp_core_step), ("jmp", _jmp_step))
    for fmt in ("float32", "float16", "bfloat16", "cbfloat16")
}


@nnx.jit
def _held_out(model: GPT, windows: jax.Array) -> jax.Array:
    return cross_entropy(model, windows)


@nnx.jit
def _float32_grads(model: GPT, windows: jax.Array, divisor: jax.Array) -> Any:
    return nnx.grad(lambda m: cross_entropy(m, windows) / divisor)(model)


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
        optimizer: Any = nnx.Optimizer(model, _tx(settings), wrt=nnx.Param)
        scaler = (
            jnp.float32(settings.init_scale or PEER_INIT_SCALE),
            jnp.int32(0),
        )  # jmp's scale and counter
    else:
        optimizer = LossScaledOptimizer(model, _tx(settings), _config(row, settings), wrt=nnx.Param)
    graphdef, state = nnx.split((model, optimizer))
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
