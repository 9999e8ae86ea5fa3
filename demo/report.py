"""The table (terminal and markdown), ``demo.json`` and the plots of a demo run."""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

import hardware
from demo.rows import DoorResult, RowResult
from workbench.tables import markdown_table

COLUMNS = (
    "row",
    "held-out loss",
    "ratio to float32",
    "skipped steps",
    "loss-scale range",
    "underflow at scale 1",
    "underflow at loss scale",
    "time per step",
)


def format_scale(value: float) -> str:
    """``2^k`` for a power of two, else ``%g``."""
    exponent = math.log2(value) if value > 0 else float("nan")
    if math.isfinite(exponent) and exponent == int(exponent):
        return f"2^{int(exponent)}"
    return f"{value:g}"


def _percent(value: float | None) -> str:
    return "-" if value is None else f"{100 * value:.3f}%"


def row_cells(result: RowResult, reference: float) -> list[str]:
    """The table's cells of one row."""
    scale_range = result.scale_range
    if scale_range is None:
        scales = "-"
    elif scale_range[0] == scale_range[1]:
        scales = format_scale(scale_range[0])
    else:
        scales = f"{format_scale(scale_range[0])} .. {format_scale(scale_range[1])}"
    return [
        result.row.label,
        f"{result.held_out_loss:.4f}",
        f"{result.held_out_loss / reference:.4f}",
        str(result.skipped_steps) if result.row.is_scaled else "-",
        scales,
        _percent(result.underflow_at_1),
        _percent(result.underflow_at_scale),
        f"{1000 * result.time_per_step_s:.0f} ms",
    ]


def text_table(door: DoorResult) -> str:
    """The terminal table of one front door."""
    rows = [list(COLUMNS), *(row_cells(r, door.reference) for r in door.rows)]
    widths = [max(len(row[i]) for row in rows) for i in range(len(COLUMNS))]
    lines = [
        "  ".join(
            [
                row[0].ljust(widths[0]),
                *(c.rjust(w) for c, w in zip(row[1:], widths[1:], strict=False)),
            ]
        )
        for row in rows
    ]
    return "\n".join([lines[0], "-" * len(lines[0]), *lines[1:]])


def door_table(door: DoorResult) -> str:
    """The markdown table of one front door."""
    return "\n".join(markdown_table(COLUMNS, [row_cells(r, door.reference) for r in door.rows]))


def spread(door: DoorResult) -> tuple[float, float] | None:
    """float32's held-out loss over the seeds: (mean, max - min), or ``None`` for one seed."""
    values = list(door.float32_seeds.values())
    if len(values) < 2:
        return None
    return float(np.mean(values)), float(max(values) - min(values))


def verdict_lines(door: DoorResult) -> list[str]:
    """The claims the run checks: the scaled rows against float32, and the peer's decisions."""
    reference = door.reference
    tolerance = 0.01 * reference
    lines = []
    seeds = spread(door)
    if seeds is not None:
        listed = ", ".join(f"{v:.4f} (seed {s})" for s, v in door.float32_seeds.items())
        lines.append(
            f"float32 over {len(door.float32_seeds)} seeds: {listed}; spread {seeds[1]:.4f}"
        )
        tolerance = max(tolerance, seeds[1])
    for key in ("float16+dls", "cbfloat16+dls"):
        result = door.row(key)
        gap = result.held_out_loss - reference
        within = abs(gap) <= tolerance
        lines.append(
            f"{result.row.label}: {gap:+.4f} from float32 ({100 * gap / reference:+.2f}%), "
            f"{'within' if within else 'NOT within'} the tolerance {tolerance:.4f} "
            f"(1% of float32{' or its seed spread' if seeds else ''})"
        )
    ours, peer = door.row("float16+dls"), door.row("peer")
    differ = [i for i, (a, b) in enumerate(zip(ours.skipped, peer.skipped, strict=False)) if a != b]
    same_losses = ours.train_losses == peer.train_losses
    if differ:
        lines.append(
            f"float16 + DLS and {peer.row.label} took different skip decisions on "
            f"{len(differ)} of {len(ours.skipped)} steps (first at step {differ[0]})"
        )
    else:
        lines.append(
            f"float16 + DLS and {peer.row.label} took the same skip decision on all "
            f"{len(ours.skipped)} steps ({ours.skipped_steps} skipped); training losses "
            f"{'bit-identical' if same_losses else 'not identical'}"
        )
    return lines


def write_json(doors: Sequence[DoorResult], path: Path, meta: dict[str, Any]) -> Path:
    """``demo.json``: the run's settings and one object per row (the columns, then curves)."""
    rows = [r.as_json(door.reference) for door in doors for r in door.rows]
    data = {
        **meta,
        "rows": rows,
        "float32_seeds": {
            d.front_door: {str(k): v for k, v in d.float32_seeds.items()} for d in doors
        },
    }
    path.write_text(json.dumps(data, indent=1) + "\n", encoding="utf-8")
    return path


def write_markdown(
    doors: Sequence[DoorResult], path: Path, header: Sequence[str], plots: Sequence[Path]
) -> Path:
    """``demo.md``: the header lines, then per front door its table, its checks and its plots."""
    parts = [*header, ""]
    for door in doors:
        parts += [f"## {door.front_door}", "", door_table(door), ""]
        parts += [f"* {line}" for line in verdict_lines(door)] + [""]
    parts += [f"![{p.stem}]({p.name})" for p in plots]
    path.write_text("\n".join(parts) + "\n", encoding="utf-8")
    return path


def _moving_average(values: Sequence[float], width: int) -> np.ndarray:
    values = np.asarray(values, np.float64)
    width = max(1, min(width, len(values)))
    kernel = np.ones(width) / width
    return np.convolve(values, kernel, mode="valid")


def plot_losses(door: DoorResult, path: Path) -> Path:
    """Training-loss curves of every row (moving average), with the held-out losses."""
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(9, 5))
    width = max(1, len(door.rows[0].train_losses) // 20)
    tops = []
    for result in door.rows:
        curve = _moving_average(result.train_losses, width)
        steps = np.arange(len(curve)) + width
        label = f"{result.row.label} (held-out {result.held_out_loss:.3f})"
        ax.plot(steps, curve, label=label, linestyle="--" if result.row.fmt == "float32" else "-")
        tops.append(curve[len(curve) // 5])
    ax.set_ylim(top=max(tops))  # the first fifth of the run (the fast initial descent) is cut
    ax.set_xlabel("step")
    ax.set_ylabel(f"training loss (nats/byte, moving average of {width})")
    ax.set_title(f"{door.front_door}: GPT-2 on the standard library's source")
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    return save_figure(fig, path)


def plot_scales(door: DoorResult, path: Path) -> Path:
    """The loss scale of every scaled row per step (log2), skipped steps marked."""
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(9, 4))
    for result in door.rows:
        if result.scales is None:
            continue
        scales = np.log2(np.asarray(result.scales))
        ax.step(np.arange(len(scales)), scales, where="post", label=result.row.label)
        skipped = np.flatnonzero(result.skipped)
        ax.plot(skipped, scales[skipped], "x", color="black", markersize=4)
    ax.set_xlabel("step (x: a skipped step)")
    ax.set_ylabel("log2(loss scale)")
    ax.set_title(f"{door.front_door}: loss-scale trajectories")
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    return save_figure(fig, path)


def plot_gradient_range(door: DoorResult, path: Path) -> Path:
    """Histogram of float32 gradient magnitudes (log2) against each half format's range, at
    scale 1 and shifted by the float16 row's loss scale."""
    import matplotlib.pyplot as plt

    log2 = door.gradient_log2
    scale = door.row("float16+dls").final_scale or 1.0
    shift = math.log2(scale)
    fig, ax = plt.subplots(figsize=(9, 5))
    bins = np.arange(
        math.floor(min(log2.min(), -45)), math.ceil(max(log2.max() + shift, 35)) + 1, 0.5
    )
    ax.hist(log2, bins=bins, histtype="stepfilled", alpha=0.5, label="|gradient| (scale 1)")
    ax.hist(
        log2 + shift,
        bins=bins,
        histtype="step",
        linewidth=1.5,
        label=f"|gradient| x float16 loss scale {format_scale(scale)}",
    )
    colors = {"float16": "tab:red", "bfloat16": "tab:green", "cbfloat16": "tab:purple"}
    lo, hi = bins[0], bins[-1]
    for name, color in colors.items():
        fmt = hardware.get_format(name)
        for value, style, what in (
            (fmt.smallest_subnormal, ":", "smallest subnormal"),
            (fmt.min_normal, "--", "smallest normal"),
            (fmt.max, "-", "largest"),
        ):
            x = math.log2(value)
            if lo <= x <= hi:
                ax.axvline(x, color=color, linestyle=style, label=f"{name} {what} 2^{x:.0f}")
    ax.set_xlim(lo, hi)
    ax.set_xlabel("log2 |gradient element| (float32 gradients of the float32 row's final weights)")
    ax.set_ylabel("elements")
    ax.set_title(
        f"{door.front_door}: gradients against the formats' ranges "
        "(bfloat16's range, 2^-133 .. 2^128, is off the chart)"
    )
    ax.legend(fontsize=7, ncol=2)
    return save_figure(fig, path)


def plot_door(door: DoorResult, out_dir: Path) -> list[Path]:
    """The three plots of one front door, as ``<door>_losses.png``, ``<door>_loss_scale.png``
    and ``<door>_gradients.png``."""
    import matplotlib

    matplotlib.use("Agg")
    return [
        plot_losses(door, out_dir / f"{door.front_door}_losses.png"),
        plot_scales(door, out_dir / f"{door.front_door}_loss_scale.png"),
        plot_gradient_range(door, out_dir / f"{door.front_door}_gradients.png"),
    ]


def save_figure(fig: Any, path: Path) -> Path:
    """Lays out ``fig``, writes it to ``path`` (110 dpi), closes it and returns ``path``."""
    import matplotlib.pyplot as plt

    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
