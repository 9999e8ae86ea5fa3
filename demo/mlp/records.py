"""The result every demo path returns: one :class:`RunRecord` per training run."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

import numpy as np
from numpy.typing import ArrayLike, DTypeLike

DIAGNOSTICS: dict[str, DTypeLike] = {
    "forward_finite": bool,
    "f32_finite": bool,
    "f32_peak": np.float64,
    "params_unchanged": bool,
    "num_skipped_steps": np.int64,
}
"""The per-step diagnostics a scaled run records in :attr:`RunRecord.extras`, with their dtypes:

* ``forward_finite``: the float16 forward loss was finite;
* ``f32_finite``: the same step's backward pass, recomputed in float32, was finite;
* ``f32_peak``: the largest magnitude in that float32 backward pass;
* ``params_unchanged``: parameters and optimizer state are bit-identical after the step;
* ``num_skipped_steps``: the scaler's skipped-step counter after the step.
"""


def diagnostic_extras(columns: Mapping[str, ArrayLike]) -> dict[str, np.ndarray]:
    """The :data:`DIAGNOSTICS` entries of ``columns`` (one value per step), as typed arrays.

    Example:
        >>> from demo.mlp.records import DIAGNOSTICS, diagnostic_extras
        >>> columns = {key: [0, 1] for key in DIAGNOSTICS} | {"loss": [0.5, 0.4]}
        >>> extras = diagnostic_extras(columns)
        >>> list(extras) == list(DIAGNOSTICS)
        True
        >>> extras["params_unchanged"], extras["f32_peak"].dtype
        (array([False,  True]), dtype('float64'))
    """
    return {key: np.asarray(columns[key], dtype) for key, dtype in DIAGNOSTICS.items()}


@dataclasses.dataclass
class RunRecord:
    """Per-step history of one training run, the common currency of reporting and plotting.

    A run without loss scaling (the float32 reference) leaves ``scales`` and ``final_scale`` as
    ``None`` and ``num_skipped_steps`` as ``None``; its ``overflow`` flags are all ``False``.

    Attributes:
        name: label in the table and the plot legend, e.g. ``"jax fp16 + DLS"``.
        path: the registry name of the path that produced it (``"jax"``, ``"torch"``, ...).
        losses: training loss of every step, shape ``(steps,)``, as float64.
        overflow: whether the step's gradients were non-finite, shape ``(steps,)``, bool. With
            dynamic loss scaling these are the skipped steps.
        final_loss: loss of the final parameters on the whole data set, computed in float32.
        scales: the loss scale each step was computed with (before that step's update), shape
            ``(steps,)``, or ``None`` for a run without loss scaling.
        final_scale: the loss scale after the last update, or ``None``.
        num_skipped_steps: the skipped-step counter as reported by the scaler itself, or
            ``None`` for a run without loss scaling.
        wall_time_s: wall-clock seconds of the run (compilation included).
        extras: optional per-step diagnostics (arrays of shape ``(steps,)``) for tests and the
            report, e.g. ``"params_unchanged"``.
        first_overflow: which gradients held inf or NaN on the first skipped step, in the words
            of ``cstorch.amp.OverflowReport`` (``"2 of 6 gradients non-finite: ..."``), or
            ``None`` when no step was skipped.
    """

    name: str
    path: str
    losses: np.ndarray
    overflow: np.ndarray
    final_loss: float
    scales: np.ndarray | None = None
    final_scale: float | None = None
    num_skipped_steps: int | None = None
    wall_time_s: float = 0.0
    extras: dict[str, Any] = dataclasses.field(default_factory=dict)
    first_overflow: str | None = None

    def __post_init__(self) -> None:
        self.losses = np.asarray(self.losses, dtype=np.float64)
        self.overflow = np.asarray(self.overflow, dtype=bool)
        if self.losses.shape != self.overflow.shape or self.losses.ndim != 1:
            raise ValueError(
                f"losses and overflow must be 1-d of the same length; got shapes "
                f"{self.losses.shape} and {self.overflow.shape}"
            )
        if self.scales is not None:
            self.scales = np.asarray(self.scales, dtype=np.float64)
            if self.scales.shape != self.losses.shape:
                raise ValueError(
                    f"scales must have one entry per step; got shape {self.scales.shape} "
                    f"for {self.steps} steps"
                )

    @property
    def steps(self) -> int:
        """Number of training steps recorded."""
        return int(self.losses.shape[0])

    @property
    def is_scaled(self) -> bool:
        """Whether the run used loss scaling (has a scale history)."""
        return self.scales is not None

    @property
    def num_overflows(self) -> int:
        """Number of steps whose gradients overflowed."""
        return int(self.overflow.sum())

    @property
    def all_scales(self) -> np.ndarray:
        """Every scale the run held: the per-step scales followed by the final one."""
        if self.scales is None:
            return np.zeros(0)
        tail = [] if self.final_scale is None else [self.final_scale]
        return np.concatenate([self.scales, np.asarray(tail, dtype=np.float64)])
