"""Reporting shared by every path: the terminal table and the PNG plot of a list of records."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from pathlib import Path

import numpy as np

from demo.mlp.problem import FLOAT16_MAX
from demo.mlp.records import RunRecord


def format_scale(value: float | None) -> str:
    """Formats a loss scale as ``2^k`` when it is a power of two, else in ``%g`` notation."""
    if value is None:
        return "-"
    exponent = math.log2(value) if value > 0 else float("nan")
    if math.isfinite(exponent) and exponent == int(exponent):
        return f"2^{int(exponent)}"
    return f"{value:g}"


def summary_table(records: Sequence[RunRecord]) -> str:
    """The end-of-run table: one row per record.

    Columns: final loss (float32, whole data set), min / max / final loss scale, overflowed
    steps, skipped steps (the scaler's own counter) and wall time.

    Args:
        records: the runs to show, in order.

    Returns:
        The table as a multi-line string.
    """
    header = (
        "run",
        "final loss",
        "min scale",
        "max scale",
        "final scale",
        "overflows",
        "skipped",
        "time",
    )
    rows = [header]
    for record in records:
        scales = record.all_scales
        rows.append(
            (
                record.name,
                f"{record.final_loss:.4g}",
                format_scale(float(scales.min())) if scales.size else "-",
                format_scale(float(scales.max())) if scales.size else "-",
                format_scale(record.final_scale),
                str(record.num_overflows) if record.is_scaled else "-",
                "-" if record.num_skipped_steps is None else str(record.num_skipped_steps),
                f"{record.wall_time_s:.1f} s",
            )
        )
    widths = [max(len(row[i]) for row in rows) for i in range(len(header))]

    def line(row: Sequence[str]) -> str:
        cells = [row[0].ljust(widths[0])] + [
            c.rjust(w) for c, w in zip(row[1:], widths[1:], strict=True)
        ]
        return "  ".join(cells)

    rule = "-" * len(line(header))
    return "\n".join([line(header), rule, *(line(row) for row in rows[1:])])


def comparison_lines(records: Sequence[RunRecord]) -> list[str]:
    """One line per scaled run comparing its final loss with the unscaled run of its path."""
    lines = []
    for record in records:
        if not record.is_scaled:
            continue
        references = [r for r in records if not r.is_scaled and r.path == record.path]
        references = references or [r for r in records if not r.is_scaled]
        if references:
            ref = references[0]
            lines.append(
                f"{record.name}: final loss {record.final_loss:.4g} = "
                f"{record.final_loss / ref.final_loss:.3f} x {ref.name} ({ref.final_loss:.4g})"
            )
    return lines


def overflow_summary(gradients: Mapping[str, int], total: int) -> str:
    """Names the gradients that overflowed, in the words of ``cstorch.amp.OverflowReport``.

    For a path without torch (the JAX path builds it from ``amp_core.nonfinite_report``).

    Args:
        gradients: per gradient that overflowed, its number of inf or NaN elements (0 for
            finite values whose squares overflow float32).
        total: how many gradients were read.

    Returns:
        ``"2 of 6 gradients non-finite: layers.0.w (3 elements), ..."``.

    Example:
        >>> from demo.mlp.report import overflow_summary
        >>> overflow_summary({"layers.2.b": 1}, 6)
        '1 of 6 gradients non-finite: layers.2.b (1 element)'
    """
    head = f"{len(gradients)} of {total} gradients non-finite"
    if not gradients:
        return head

    def elements(count: int) -> str:
        if count == 0:
            return "finite values too large to square in float32"
        return f"{count} element{'s' if count != 1 else ''}"

    return f"{head}: " + ", ".join(f"{name} ({elements(n)})" for name, n in gradients.items())


def provenance_lines(records: Sequence[RunRecord]) -> list[str]:
    """Explains where each scaled run's overflows came from.

    Names the gradients that overflowed on the first skipped step (``first overflow: ...``, the
    scaler's overflow report, :attr:`RunRecord.first_overflow`). If the run recorded diagnostics,
    also uses the ``forward_finite``, ``f32_finite``, ``f32_peak`` and ``params_unchanged``
    extras (recorded by the MLP paths): a genuine float16 backward overflow has a finite forward
    loss and a finite float32 backward (same step, same scale) whose peak magnitude exceeds the
    float16 maximum.
    """
    lines = []
    for record in records:
        extras = record.extras
        diagnosed = {"forward_finite", "f32_finite", "f32_peak"} <= set(extras)
        if not record.is_scaled or not (diagnosed or record.first_overflow is not None):
            continue
        lines.append(f"Overflow check ({record.name}):")
        if record.first_overflow is not None:
            lines.append(f"  first overflow: {record.first_overflow}")
        if not diagnosed:
            continue
        over = record.overflow
        peak = np.asarray(extras["f32_peak"])
        predicted = peak > FLOAT16_MAX
        genuine = over & extras["forward_finite"] & extras["f32_finite"] & predicted
        lines.append(
            f"  {int(genuine.sum())} of {int(over.sum())} overflows are float16 overflows in "
            f"the backward pass: float16 forward loss finite, same step in float32 finite "
            f"with peak |value| > {FLOAT16_MAX:g}."
        )
        peaks = []
        if over.any():
            peaks.append(f"smallest on a skipped step {peak[over].min():.4g}")
        if (~over).any():
            peaks.append(f"largest on an applied step {peak[~over].max():.4g}")
        lines.append(
            f"  float32 backward peak: {'; '.join(peaks)}; 'peak > {FLOAT16_MAX:g}' predicts "
            f"the overflow flag on {int((predicted == over).sum())} of {record.steps} steps."
        )
        if "params_unchanged" in extras:
            same = np.asarray(extras["params_unchanged"], bool)
            lines.append(
                f"  parameters and optimizer state bit-identical on {int((same & over).sum())} "
                f"of {int(over.sum())} skipped steps; changed on {int((~same & ~over).sum())} "
                f"of {int((~over).sum())} applied steps."
            )
    return lines


def plot_records(records: Sequence[RunRecord], path: str | Path, title: str | None = None) -> Path:
    """Saves the loss and loss-scale history of ``records`` as a PNG (matplotlib, Agg).

    Top: loss per step of every record (log y), skipped steps marked with red crosses.
    Bottom: loss scale per step of the scaled records (log2 y), skipped steps marked.
    When the records come from several paths, the first path is drawn wide and pale and the
    later ones thin, with red pluses for their skipped steps, so that coinciding curves show.

    Args:
        records: the runs to plot.
        path: the PNG to write; its folder is created.
        title: the figure title.

    Returns:
        The path written.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig, (ax_loss, ax_scale) = plt.subplots(
        2, 1, figsize=(10, 7.5), sharex=True, gridspec_kw={"height_ratios": [3, 2]}
    )
    skip_label = "skipped step (float16 overflow)"
    # With several paths, the first path's lines are wide and pale and its skips are crosses,
    # later paths' lines thin and their skips pluses: curves that coincide stay visible.
    paths = list(dict.fromkeys(record.path for record in records))
    for record in records:
        steps = np.arange(record.steps)
        first = paths.index(record.path) == 0
        wide = {"lw": 3.0, "alpha": 0.5} if first and len(paths) > 1 else {}
        marker = "x" if first else "+"
        style = {"lw": 1.2, **wide} if record.is_scaled else {"lw": 1.2, "ls": "--", **wide}
        ax_loss.plot(steps, record.losses, label=record.name, **style)
        if record.overflow.any():
            finite_losses = np.where(np.isfinite(record.losses), record.losses, np.nan)
            ax_loss.plot(
                steps[record.overflow],
                finite_losses[record.overflow],
                marker,
                color="red",
                ms=7,
                mew=1.8,
                label=f"{record.name}: {skip_label}",
            )
        if record.is_scaled:
            ax_scale.step(
                steps, record.scales, where="post", label=record.name, **{"lw": 1.5, **wide}
            )
            ax_scale.plot(
                steps[record.overflow],
                record.scales[record.overflow],
                marker,
                color="red",
                ms=8,
                mew=2,
                label=f"{record.name}: {skip_label}",
            )
    ax_loss.set_yscale("log")
    ax_loss.set_ylabel("training loss (MSE, log scale)")
    ax_loss.grid(True, which="both", alpha=0.3)
    ax_loss.legend(loc="upper right")
    ax_scale.set_yscale("log", base=2)
    ax_scale.set_ylabel("loss scale (log2 scale)")
    ax_scale.set_xlabel("training step")
    ax_scale.grid(True, which="major", alpha=0.3)
    if ax_scale.has_data():
        ax_scale.legend(loc="upper right")
    fig.suptitle(title or "Dynamic loss scaling with float16 compute")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
