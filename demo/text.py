"""The text: the Python standard library's own source, read as bytes.

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

import numpy as np

from workbench.byte_gpt import Settings

HELD_OUT_EVERY = 10
"""Every tenth file (sorted by name) is held out."""


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
