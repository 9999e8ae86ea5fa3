"""The byte-level GPT-2 in flax NNX, and its training step through
``amp_core.flax_nnx.LossScaledOptimizer``: the demo's JAX front door trains it, the cbfloat16
bench times its step.

:class:`GPT` is GPT-2 as transformers writes it (learned positions, pre-norm blocks, causal
self-attention, a tanh-GELU MLP, a final layer norm, the output layer tied to the token
embedding), starting from the numpy weights of :func:`workbench.byte_gpt.initial_weights`, the
same as the demo's torch front door, so that the two float32 rows start from the same loss.

Half formats: float32 master weights; every weight as it is read, and the output of every place
where transformers' model has a module (embeddings, layer norms, linear layers, the GELU, the
attention and MLP blocks, each block), rounded to the row's format in both directions; float32
arithmetic in between. float16 and bfloat16 round with JAX's own casts
(``x.astype(jnp.float16).astype(jnp.float32)``, whose transpose rounds the gradient), cbfloat16
with ``hardware.CBFLOAT16.cast``.

The training step (:func:`loss_scaled_step`)::

    grads = nnx.grad(lambda m: optimizer.scale_loss(loss_fn(m)))(model)
    isfinite = optimizer.update(model, grads)   # skips (and keeps every bit) on overflow
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

import hardware
from workbench.byte_gpt import ModelSize, Settings, initial_weights

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
        seed: the seed of :func:`workbench.byte_gpt.initial_weights`.
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


def adamw(settings: Settings) -> optax.GradientTransformation:
    """AdamW with ``settings``' learning-rate schedule and weight decay."""
    return optax.adamw(settings.learning_rate_at, weight_decay=settings.weight_decay)


def loss_and_grads(
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


def loss_scaled_step(
    graphdef: Any, state: Any, windows: jax.Array, divisor: jax.Array
) -> tuple[Any, jax.Array, ...]:
    """One step of ``LossScaledOptimizer``: returns the new state, the loss, the scale the
    step used and whether it was skipped."""
    model, optimizer = nnx.merge(graphdef, state)
    scale = optimizer.scaler.loss_scale
    loss, grads = loss_and_grads(model, windows, divisor, optimizer.scale_loss)
    isfinite = optimizer.update(model, grads)
    return nnx.state((model, optimizer)), loss, scale, ~isfinite
