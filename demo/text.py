"""The text and the model size: the Python standard library's own source, read as bytes.

Every machine that runs Python has the standard library's source files, so the demo trains on
real text without downloading anything. The files are picked deterministically: every ``*.py``
file at the top level of ``sysconfig.get_paths()["stdlib"]``, sorted by name; every tenth file
(positions 9, 19, 29, ...) is held out. Each split is the concatenation of its files' bytes, so
the vocabulary is the 256 byte values and nothing needs a tokenizer.

Both front doors train on the same numbers: the training windows of every step (drawn from the
training bytes with ``numpy.random.default_rng(seed)``) and the held-out windows (evenly spaced,
the same for every seed) are numpy arrays made here once.
"""

from __future__ import annotations

import dataclasses
import sysconfig
from pathlib import Path
from typing import Any

import numpy as np

HELD_OUT_EVERY = 10
"""Every tenth file (sorted by name) is held out."""


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


@dataclasses.dataclass(frozen=True)
class Corpus:
    """The bytes both front doors train and evaluate on.

    Attributes:
        train: the training bytes, uint8.
        held_out: the held-out bytes, uint8.
        train_files: names of the training files.
        held_out_files: names of the held-out files.
        root: the folder they were read from.
    """

    train: np.ndarray
    held_out: np.ndarray
    train_files: tuple[str, ...]
    held_out_files: tuple[str, ...]
    root: Path


def _jnp() -> Any:
    import jax.numpy as jnp

    return jnp


def stdlib_root() -> Path:
    """The folder of the running interpreter's standard library source."""
    return Path(sysconfig.get_paths()["stdlib"])


def load_corpus(root: Path | None = None) -> Corpus:
    """Reads the standard library's top-level ``*.py`` files and splits them by file.

    Args:
        root: the folder to read (default :func:`stdlib_root`).

    Returns:
        The :class:`Corpus`.

    Raises:
        FileNotFoundError: ``root`` holds fewer than ``HELD_OUT_EVERY`` ``*.py`` files.

    Example:
        >>> from demo.text import load_corpus
        >>> corpus = load_corpus()
        >>> corpus.train.dtype, len(corpus.held_out) > 100_000
        (dtype('uint8'), True)
        >>> set(corpus.train_files) & set(corpus.held_out_files)
        set()
    """
    root = stdlib_root() if root is None else Path(root)
    files = sorted(root.glob("*.py"))
    if len(files) < HELD_OUT_EVERY:
        raise FileNotFoundError(
            f"expected at least {HELD_OUT_EVERY} *.py files in {root} (the standard library's "
            f"source); found {len(files)}"
        )
    held = [f for i, f in enumerate(files) if i % HELD_OUT_EVERY == HELD_OUT_EVERY - 1]
    train = [f for f in files if f not in held]

    def read(paths: list[Path]) -> np.ndarray:
        return np.frombuffer(b"".join(p.read_bytes() for p in paths), np.uint8).copy()

    return Corpus(
        train=read(train),
        held_out=read(held),
        train_files=tuple(f.name for f in train),
        held_out_files=tuple(f.name for f in held),
        root=root,
    )


def training_windows(corpus: Corpus, settings: Settings) -> np.ndarray:
    """Every step's batch: ``(steps, batch_size, n_positions + 1)`` int32 byte windows, or
    ``(steps, micro_batches, batch_size, n_positions + 1)`` with more than one micro-batch.

    The inputs of a window are its first ``n_positions`` bytes, the targets its last
    ``n_positions`` (the next byte of each position). Drawn from ``settings.seed``; with micro
    batches, the first micro-batch of every step is the batch of the same step without them.
    """
    length = settings.size.n_positions + 1
    rng = np.random.default_rng(settings.seed)
    high = len(corpus.train) - length
    starts = rng.integers(0, high, (settings.steps, settings.batch_size))
    if settings.micro_batches > 1:
        shape = (settings.steps, settings.micro_batches - 1, settings.batch_size)
        starts = np.concatenate([starts[:, None], rng.integers(0, high, shape)], axis=1)
    return corpus.train[starts[..., None] + np.arange(length)].astype(np.int32)


def held_out_windows(corpus: Corpus, settings: Settings) -> np.ndarray:
    """``(eval_windows, n_positions + 1)`` int32 windows, evenly spaced over the held-out bytes
    (the same for every seed)."""
    length = settings.size.n_positions + 1
    starts = np.linspace(0, len(corpus.held_out) - length, settings.eval_windows).astype(np.int64)
    return corpus.held_out[starts[:, None] + np.arange(length)].astype(np.int32)


def initial_weights(size: ModelSize, seed: int) -> dict[str, np.ndarray]:
    """GPT-2's initialisation, in numpy, under ``GPT2LMHeadModel``'s state-dict names.

    Weights normal with standard deviation 0.02 (the residual projections ``c_proj`` divided
    by ``sqrt(2 * n_layer)``), biases zero, layer norms one and zero; the output layer is tied
    to the token embedding (``transformer.wte.weight``). Both front doors start from these
    arrays, so that their float32 rows start from the same loss.
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
