"""The embedded default problem: a small MLP regression on synthetic data, shared by every path.

Everything a path needs to train the same model on the same data is here as numpy arrays, so
that a JAX run and a torch run start from identical numbers: the data set, the initial weights,
the mini-batch of every step, and the optimizer and loss-scaling hyperparameters.

The model is ``tanh(x @ w1 + b1) -> tanh(. @ w2 + b2) -> . @ w3 + b3`` with weights stored as
``(in, out)`` (a torch ``nn.Linear`` holds ``w.T``), trained with Adam on the mean squared error.
"""

from __future__ import annotations

import dataclasses
import itertools

import numpy as np

FLOAT16_MAX = float(np.finfo(np.float16).max)
"""The largest finite float16 value."""


@dataclasses.dataclass(frozen=True)
class ScalerSettings:
    """Dynamic loss-scaling hyperparameters of the demo (cstorch ``GradScaler`` argument names).

    The initial scale is far above what float16 can hold in the backward pass, so the first
    steps overflow and the scaler backs off; a short ``steps_per_increase`` lets it grow again,
    and overflow again at the top, several times within a few hundred steps.

    Attributes:
        init_scale: the first loss scale.
        max_loss_scale: upper bound of the scale.
        min_loss_scale: lower bound of the scale.
        steps_per_increase: the scale doubles after this many steps without a rescale.
    """

    init_scale: float = 2.0**24
    max_loss_scale: float = 2.0**24
    min_loss_scale: float = 2.0**-14
    steps_per_increase: int = 50


@dataclasses.dataclass(frozen=True)
class Problem:
    """Model, data and hyperparameters of one demo run, identical for every path.

    Attributes:
        x: inputs, ``(num_samples, in_features)`` float32.
        y: targets, ``(num_samples, 1)`` float32.
        init_params: initial weights as ``[(w, b), ...]`` per layer, ``w`` of shape
            ``(in, out)``, float32; hidden layers use ``tanh``, the last layer is linear.
        batches: sample indices of every step's mini-batch, ``(steps, batch_size)`` int.
        learning_rate: Adam's learning rate (default betas and eps).
        scaler: the dynamic loss-scaling settings.
        seed: the seed everything above was drawn from.
    """

    x: np.ndarray
    y: np.ndarray
    init_params: tuple[tuple[np.ndarray, np.ndarray], ...]
    batches: np.ndarray
    learning_rate: float
    scaler: ScalerSettings
    seed: int

    @property
    def steps(self) -> int:
        """Number of training steps."""
        return int(self.batches.shape[0])

    def batch(self, step: int) -> tuple[np.ndarray, np.ndarray]:
        """The ``(x, y)`` mini-batch of ``step``."""
        index = self.batches[step]
        return self.x[index], self.y[index]


@dataclasses.dataclass(frozen=True)
class RunOptions:
    """How to run a path (not what to train).

    Attributes:
        progress: show a tqdm progress bar.
        diagnostics: also record per-step diagnostics (overflow provenance, whether the
            parameters changed), at the cost of extra work per step.
    """

    progress: bool = True
    diagnostics: bool = True


def make_problem(
    steps: int = 300,
    seed: int = 0,
    *,
    num_samples: int = 2048,
    in_features: int = 16,
    hidden: int = 128,
    batch_size: int = 128,
    learning_rate: float = 3e-3,
    scaler: ScalerSettings | None = None,
) -> Problem:
    """Generates the synthetic regression problem, deterministically from ``seed``.

    The targets come from a random two-layer ``tanh`` teacher plus a little noise; the student
    is a wider three-layer MLP with Glorot-uniform weights and zero biases.

    Args:
        steps: number of training steps (one mini-batch each).
        seed: seed of the data, the initial weights and the batch order.
        num_samples: size of the data set.
        in_features: input dimension.
        hidden: width of the student's two hidden layers.
        batch_size: mini-batch size.
        learning_rate: Adam's learning rate.
        scaler: the loss-scaling settings (default :class:`ScalerSettings`).

    Returns:
        The :class:`Problem`.

    Raises:
        ValueError: ``steps`` or a size is not positive.
    """
    for name, value in (
        ("steps", steps),
        ("num_samples", num_samples),
        ("in_features", in_features),
        ("hidden", hidden),
        ("batch_size", batch_size),
    ):
        if value < 1:
            raise ValueError(f"{name} must be a positive integer; got {value!r}")
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((num_samples, in_features)).astype(np.float32)
    teacher_w1 = rng.standard_normal((in_features, 32)) / np.sqrt(in_features) * 2.0
    teacher_w2 = rng.standard_normal((32, 1)) / np.sqrt(32) * 3.0
    y = np.tanh(x @ teacher_w1) @ teacher_w2 + 0.05 * rng.standard_normal((num_samples, 1))
    widths = (in_features, hidden, hidden, 1)
    params = []
    for fan_in, fan_out in itertools.pairwise(widths):
        limit = np.sqrt(6.0 / (fan_in + fan_out))
        w = rng.uniform(-limit, limit, (fan_in, fan_out)).astype(np.float32)
        params.append((w, np.zeros(fan_out, np.float32)))
    batches = np.stack(
        [rng.choice(num_samples, size=batch_size, replace=False) for _ in range(steps)]
    )
    return Problem(
        x=x,
        y=y.astype(np.float32),
        init_params=tuple(params),
        batches=batches,
        learning_rate=learning_rate,
        scaler=scaler or ScalerSettings(),
        seed=seed,
    )
