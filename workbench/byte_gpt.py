"""The byte-level GPT-2 the demo trains and the cbfloat16 bench times: its size, the settings
of one run, and its initial weights in numpy (the same numbers for torch and for JAX).

:mod:`workbench.byte_gpt_jax` is the flax NNX model; the demo's torch door loads these weights
into transformers' ``GPT2LMHeadModel``.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np


@dataclasses.dataclass(frozen=True)
class ModelSize:
    """The GPT-2 architecture's size (``transformers.GPT2Config`` names).

    Attributes:
        n_layer: transformer blocks.
        n_embd: width of the residual stream.
        n_head: attention heads.
        n_positions: context length in bytes (also the training window).
    """

    n_layer: int = 2
    n_embd: int = 64
    n_head: int = 4
    n_positions: int = 64

    vocab_size = 256
    """Byte-level: one token per byte value."""


@dataclasses.dataclass(frozen=True)
class Settings:
    """What every row of one run shares: model size, optimizer, batches.

    Attributes:
        steps: optimizer steps per row.
        seed: seed of the initial weights and of the training windows.
        batch_size: windows per step.
        learning_rate: AdamW's peak learning rate (linear warm-up over ``warmup_steps``,
            then a cosine decay to a tenth of it at the last step).
        warmup_steps: steps of linear warm-up.
        weight_decay: AdamW's decoupled weight decay.
        max_gradient_norm: the clipping bound of the row that clips (``GradScaler(...,
            max_gradient_norm=...)``).
        eval_windows: held-out windows the held-out loss averages over.
        init_scale: ``None`` (the default): every dynamic row starts from its dtype's default
            (``2**15`` for float16, ``2**31`` for cbfloat16; the peers ``2**15``). A number
            starts them all there (with ``max_loss_scale`` as high), e.g. to watch an overflow
            episode.
        size: the model size.
        loss_divisor: ``k``: every micro-batch's loss is divided by ``k`` before
            ``backward()``, as a loop that accumulates ``k`` micro-batches writes it
            (``loss / accumulation_steps``); the gradients of every micro-batch are ``k`` times
            smaller. With ``micro_batches=1`` one micro-batch stands for the numerics of each
            micro-batch of a ``k``-step accumulation, not for its data.
        micro_batches: micro-batches of ``batch_size`` windows per optimizer step, their
            gradients summed (real accumulation; 1: none).
    """

    steps: int = 100
    seed: int = 0
    batch_size: int = 32
    learning_rate: float = 3e-3
    warmup_steps: int = 20
    weight_decay: float = 0.01
    max_gradient_norm: float = 1.0
    eval_windows: int = 256
    init_scale: float | None = None
    size: ModelSize = ModelSize()
    loss_divisor: int = 1
    micro_batches: int = 1

    def __post_init__(self) -> None:
        for name in ("loss_divisor", "micro_batches"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
                raise ValueError(f"{name} must be an integer of at least 1; got {value!r}")

    @property
    def tokens_per_step(self) -> int:
        """Tokens whose mean one micro-batch's loss stands for: ``batch_size * n_positions *
        loss_divisor`` (those of a ``loss_divisor``-step accumulation)."""
        return self.batch_size * self.size.n_positions * self.loss_divisor

    def learning_rate_at(self, step: Any) -> Any:
        """The learning rate of optimizer step ``step`` (0-based; a number, or a JAX or numpy
        array: only arithmetic and ``cos``/``minimum`` of the array's own module are used)."""
        xp = np if isinstance(step, (int, float, np.integer, np.ndarray)) else _jnp()
        warm = xp.minimum(1.0, (step + 1) / self.warmup_steps)
        progress = xp.minimum(
            1.0, xp.maximum(0.0, step - self.warmup_steps) / max(1, self.steps - self.warmup_steps)
        )
        decay = 0.1 + 0.9 * 0.5 * (1.0 + xp.cos(np.pi * progress))
        return self.learning_rate * warm * decay


def _jnp() -> Any:
    import jax.numpy as jnp

    return jnp


def initial_weights(size: ModelSize, seed: int) -> dict[str, np.ndarray]:
    """GPT-2's initialisation, in numpy, under ``GPT2LMHeadModel``'s state-dict names.

    Weights normal with standard deviation 0.02 (the residual projections ``c_proj`` divided
    by ``sqrt(2 * n_layer)``), biases zero, layer norms one and zero; the output layer is tied
    to the token embedding (``transformer.wte.weight``). Both of the demo's front doors start from
    these arrays, so that their float32 rows start from the same loss.
    """
    rng = np.random.default_rng([seed, 1])
    e, v, t = size.n_embd, size.vocab_size, size.n_positions

    def normal(*shape: int, std: float = 0.02) -> np.ndarray:
        return (rng.standard_normal(shape) * std).astype(np.float32)

    projection_std = 0.02 / np.sqrt(2 * size.n_layer)
    weights = {"transformer.wte.weight": normal(v, e), "transformer.wpe.weight": normal(t, e)}
    for i in range(size.n_layer):
        block = f"transformer.h.{i}."
        for norm in ("ln_1", "ln_2"):
            weights[block + norm + ".weight"] = np.ones(e, np.float32)
            weights[block + norm + ".bias"] = np.zeros(e, np.float32)
        for name, (fan_in, fan_out), std in (
            ("attn.c_attn", (e, 3 * e), 0.02),
            ("attn.c_proj", (e, e), projection_std),
            ("mlp.c_fc", (e, 4 * e), 0.02),
            ("mlp.c_proj", (4 * e, e), projection_std),
        ):
            weights[block + name + ".weight"] = normal(fan_in, fan_out, std=std)
            weights[block + name + ".bias"] = np.zeros(fan_out, np.float32)
    weights["transformer.ln_f.weight"] = np.ones(e, np.float32)
    weights["transformer.ln_f.bias"] = np.zeros(e, np.float32)
    return weights
