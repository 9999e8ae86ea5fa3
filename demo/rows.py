"""The rows of the demo's table, the same for both front doors, and what each row reports.

Every row trains the same model from the same initial weights on the same batches; only the
number format of the forward and backward passes and the loss scaling change:

========================  ==========  ===============================================
row                       format      loss scaling
========================  ==========  ===============================================
float32                   float32     none (the reference)
float16                   float16     none
float16 + DLS             float16     this library's dynamic loss scaling, defaults
float16 + DLS + clip      float16     the same, with ``max_gradient_norm``
bfloat16                  bfloat16    none
cbfloat16 + DLS           cbfloat16   dynamic loss scaling from cbfloat16's defaults
cbfloat16                 cbfloat16   none
peer                      float16     torch.amp.GradScaler / jmp.DynamicLossScale
========================  ==========  ===============================================

The peers are configured so that their rule coincides with this library's defaults (initial
scale ``2**15``, halve on any overflow, double after 2001 steps without one), so that the
skip decisions can be compared step by step.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np

FORMATS = ("float32", "float16", "bfloat16", "cbfloat16")
"""The number formats of the rows."""

PEER_INIT_SCALE = 2.0**15
"""The peers' initial scale: this library's float16 default (torch's own default is 2**16)."""

PEER_GROWTH_INTERVAL = 2001
"""The peers double after this many finite steps in a row; this library's default
``steps_per_increase=2000`` doubles on the 2001st step after a rescale."""


@dataclasses.dataclass(frozen=True)
class Row:
    """One training configuration of the table.

    Attributes:
        key: a short identifier (``"float16+dls"``), the same in both front doors.
        label: the row's name in the table, per front door for the peer.
        fmt: the number format of the forward and backward passes.
        scaling: ``"none"``, ``"dls"`` (this library, defaults), ``"dls+clip"`` (with
            ``max_gradient_norm``) or ``"peer"``.
    """

    key: str
    label: str
    fmt: str
    scaling: str

    @property
    def is_scaled(self) -> bool:
        """Whether the row uses loss scaling."""
        return self.scaling != "none"


def rows_for(front_door: str) -> tuple[Row, ...]:
    """The rows of ``front_door`` (``"torch"`` or ``"jax"``), in table order.

    Example:
        >>> from demo.rows import rows_for
        >>> [row.label for row in rows_for("jax")][-1]
        'float16 + jmp.DynamicLossScale'
    """
    peer = {"torch": "float16 + torch.amp.GradScaler", "jax": "float16 + jmp.DynamicLossScale"}
    if front_door not in peer:
        raise ValueError(f"front_door must be 'torch' or 'jax'; got {front_door!r}")
    return (
        Row("float32", "float32", "float32", "none"),
        Row("float16", "float16, no scaling", "float16", "none"),
        Row("float16+dls", "float16 + DLS", "float16", "dls"),
        Row("float16+dls+clip", "float16 + DLS + clip", "float16", "dls+clip"),
        Row("bfloat16", "bfloat16, no scaling", "bfloat16", "none"),
        Row("cbfloat16+dls", "cbfloat16 + DLS", "cbfloat16", "dls"),
        Row("cbfloat16", "cbfloat16, no scaling", "cbfloat16", "none"),
        Row("peer", peer[front_door], "float16", "peer"),
    )


@dataclasses.dataclass
class RowResult:
    """What one row's training run reports.

    Attributes:
        front_door: ``"torch"`` or ``"jax"``.
        row: the :class:`Row`.
        held_out_loss: mean cross-entropy (nats per byte) of the final float32 master weights
            on the held-out windows, computed in float32.
        train_losses: the training loss of every step, as the row computed it.
        skipped: per step, whether the scaler skipped it.
        scales: per step, the loss scale the step used (``None`` without loss scaling).
        final_scale: the scale after the last step (``None`` without loss scaling).
        underflow_at_1: fraction of the gradient elements (float32 gradients of the final
            weights on the last batch) that round to zero in the row's format at scale 1
            (``None`` for float32).
        underflow_at_scale: the same at the final loss scale (``None`` without scaling).
        time_per_step_s: median wall time of a step (compilation excluded).
    """

    front_door: str
    row: Row
    held_out_loss: float
    train_losses: list[float]
    skipped: list[bool]
    scales: list[float] | None
    final_scale: float | None
    underflow_at_1: float | None
    underflow_at_scale: float | None
    time_per_step_s: float

    @property
    def skipped_steps(self) -> int:
        """How many steps the scaler skipped."""
        return int(sum(self.skipped))

    @property
    def scale_range(self) -> tuple[float, float] | None:
        """The smallest and largest loss scale the run held (``None`` without scaling)."""
        if self.scales is None:
            return None
        held = [*self.scales, *([] if self.final_scale is None else [self.final_scale])]
        return min(held), max(held)

    def as_json(self, reference: float | None) -> dict[str, Any]:
        """The row as a JSON object: the table's columns, then the per-step curves."""
        scale_range = self.scale_range
        return {
            "front_door": self.front_door,
            "row": self.row.key,
            "label": self.row.label,
            "format": self.row.fmt,
            "loss_scaling": self.row.scaling,
            "held_out_loss": self.held_out_loss,
            "ratio_to_float32": None if reference is None else self.held_out_loss / reference,
            "skipped_steps": self.skipped_steps,
            "loss_scale_min": None if scale_range is None else scale_range[0],
            "loss_scale_max": None if scale_range is None else scale_range[1],
            "underflow_fraction_at_scale_1": self.underflow_at_1,
            "underflow_fraction_at_loss_scale": self.underflow_at_scale,
            "time_per_step_s": self.time_per_step_s,
            "train_loss": [float(x) for x in self.train_losses],
            "loss_scale": None if self.scales is None else [float(x) for x in self.scales],
            "skipped": [bool(x) for x in self.skipped],
        }


@dataclasses.dataclass
class DoorResult:
    """Everything one front door's run produced.

    Attributes:
        front_door: ``"torch"`` or ``"jax"``.
        rows: one :class:`RowResult` per row, in table order.
        gradient_log2: log2 of the magnitudes of the nonzero float32 gradient elements of the
            float32 row's final weights (the histogram's data).
        float32_seeds: held-out loss of the float32 row per seed (the first is ``rows[0]``'s);
            one entry unless the run asked for the spread.
    """

    front_door: str
    rows: list[RowResult]
    gradient_log2: np.ndarray
    float32_seeds: dict[int, float]

    @property
    def reference(self) -> float:
        """The float32 row's held-out loss."""
        return self.rows[0].held_out_loss

    def row(self, key: str) -> RowResult:
        """The result of the row ``key``."""
        return next(r for r in self.rows if r.row.key == key)
