"""Where loss scaling matters: the demo's rows trained at several tokens per optimizer step.

The loss of a step is a *mean* over its tokens, so every gradient of one backward pass scales as
``1/N`` with ``N`` tokens; a loop that accumulates ``k`` micro-batches divides each micro-batch's
loss by ``k`` before ``backward()`` (``loss / accumulation_steps``, as nanoGPT, Megatron-LM and
Hugging Face accelerate write it), and so each micro-batch's gradients by ``k`` more. That is
what underflows in a half format.

The sweep trains every row at accumulation factors ``k`` with one micro-batch per step whose loss
is divided by ``k``: it stands for the *numerics* of every micro-batch of a ``k``-step
accumulation (the same gradient magnitudes in the same format), not for its data (the step sees
one micro-batch, not ``k``). One ``k`` is also trained with ``k`` real micro-batches per step,
through each front door's own accumulation path (the torch loop's repeated ``backward()``, a
``lax.scan`` summing the gradients inside the JAX step), to confirm that the emulation moves the
rows the same way.

Before training, the gradient-range report of the first step (the float32 gradients of the
initial weights on the first batch, divided by ``k``) gives each format's underflow fraction at
scale 1 and a suggested loss scale: the prediction of which rows will fail.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from demo import report
from demo.rows import DoorResult, RowResult, rows_for
from demo.text import held_out_windows, load_corpus, training_windows
from workbench.byte_gpt import Settings
from workbench.tables import markdown_table

HALF_FORMATS = ("float16", "bfloat16", "cbfloat16")
"""The formats the first-step gradient-range report checks."""

ALL_ROWS = ("float32", "float16", "float16+dls", "bfloat16", "cbfloat16+dls", "cbfloat16", "peer")
"""The rows of the full sweep (the table's rows less the clipping one)."""

QUICK_ROWS = ("float32", "float16", "float16+dls", "cbfloat16+dls", "cbfloat16", "peer")
"""The rows of the quick sweep: cbfloat16 as ``set_half_dtype("cbfloat16")`` runs it by default
(dynamic loss scaling from ``2**31``) and without loss scaling."""

ACCUMULATION_ROWS = ("float32", "float16", "float16+dls", "cbfloat16+dls", "cbfloat16")
"""The rows trained with real accumulation."""


@dataclasses.dataclass(frozen=True)
class SweepPlan:
    """What one sweep trains.

    Attributes:
        ks: the accumulation factors (each micro-batch's loss is divided by ``k``), ascending.
        rows: the row keys (:func:`demo.rows.rows_for`), ``"float32"`` first.
        steps: optimizer steps of every row.
        accumulate_k: the ``k`` also trained with ``k`` real micro-batches per step (one of
            ``ks``), or ``None``.
    """

    ks: tuple[int, ...]
    rows: tuple[str, ...]
    steps: int
    accumulate_k: int | None = None

    def __post_init__(self) -> None:
        if not self.ks:
            raise ValueError("ks must name at least one accumulation factor; got none")
        for k in self.ks:
            if isinstance(k, bool) or not isinstance(k, int) or k < 1:
                raise ValueError(f"every k must be an integer of at least 1; got {k!r}")
        if list(self.ks) != sorted(set(self.ks)):
            raise ValueError(f"ks must be distinct and ascending; got {self.ks}")
        known = {row.key for row in rows_for("torch")}
        unknown = [key for key in self.rows if key not in known]
        if unknown or not self.rows or self.rows[0] != "float32":
            raise ValueError(
                f"rows must start with 'float32' and be among {sorted(known)}; got {self.rows}"
            )
        if isinstance(self.steps, bool) or not isinstance(self.steps, int) or self.steps < 2:
            raise ValueError(f"steps must be an integer of at least 2; got {self.steps!r}")
        if self.accumulate_k is not None and self.accumulate_k not in self.ks:
            raise ValueError(
                f"accumulate_k must be one of ks {self.ks}, to compare with its emulation; "
                f"got {self.accumulate_k!r}"
            )


QUICK = SweepPlan(ks=(1, 256), rows=QUICK_ROWS, steps=80)
"""``make demo``: k = 1 (the main table's rows) and 256 (2048 tokens per micro-batch x 256: about
0.5M tokens per step, GPT-2's own)."""

FULL = SweepPlan(ks=(1, 16, 256, 4096), rows=ALL_ROWS, steps=300, accumulate_k=16)
"""``python -m demo --full``."""


@dataclasses.dataclass
class SweepEntry:
    """One row trained at one ``k``.

    Attributes:
        k: the accumulation factor.
        tokens_per_step: tokens of the ``k``-step accumulation the micro-batch stands for.
        result: the row's result (its underflow fractions are those of one micro-batch's
            float32 gradients of the final weights, ``loss / k``).
        reference: float32's held-out loss at the same ``k`` (and the same accumulation).
        micro_batches: 1 (one micro-batch, ``loss / k``) or ``k`` (real accumulation).
    """

    k: int
    tokens_per_step: int
    result: RowResult
    reference: float
    micro_batches: int = 1

    @property
    def ratio(self) -> float:
        """Held-out loss over float32's at the same ``k``."""
        return self.result.held_out_loss / self.reference

    def as_json(self) -> dict[str, Any]:
        """The entry as one object of ``demo.json``'s ``sweep`` list."""
        result = self.result
        scale_range = result.scale_range
        return {
            "front_door": result.front_door,
            "k": self.k,
            "tokens_per_step": self.tokens_per_step,
            "micro_batches": self.micro_batches,
            "row": result.row.key,
            "label": result.row.label,
            "format": result.row.fmt,
            "scaling": result.row.scaling,
            "held_out_loss": result.held_out_loss,
            "ratio_to_float32": self.ratio,
            "skipped_steps": result.skipped_steps,
            "loss_scale_min": None if scale_range is None else scale_range[0],
            "loss_scale_max": None if scale_range is None else scale_range[1],
            "underflow_at_1": result.underflow_at_1,
            "underflow_at_scale": result.underflow_at_scale,
        }


@dataclasses.dataclass(frozen=True)
class Prediction:
    """The first step's gradient-range report at one ``k`` in one format.

    Attributes:
        k: the accumulation factor.
        fmt: the half format.
        underflow_at_1: fraction of the gradient elements that round to zero at scale 1.
        suggested_loss_scale: the largest power of two leaving 2 doublings of headroom.
    """

    k: int
    fmt: str
    underflow_at_1: float
    suggested_loss_scale: float


@dataclasses.dataclass
class DoorSweep:
    """One front door's sweep.

    Attributes:
        front_door: ``"torch"`` or ``"jax"``.
        plan: what was trained.
        entries: one per ``k`` and row (emulated), then the real accumulation's.
        predictions: the first step's report per ``k`` and format.
        gradient_log2: log2 of the nonzero float32 gradient magnitudes (``loss / k``) of the
            float32 row's final weights at the largest ``k`` (the histogram's data).
    """

    front_door: str
    plan: SweepPlan
    entries: list[SweepEntry]
    predictions: list[Prediction]
    gradient_log2: np.ndarray

    def entry(self, k: int, key: str, micro_batches: int = 1) -> SweepEntry:
        """The entry of row ``key`` at ``k``."""
        return next(
            e
            for e in self.entries
            if e.k == k and e.result.row.key == key and e.micro_batches == micro_batches
        )

    def prediction(self, k: int, fmt: str) -> Prediction:
        """The first step's report at ``k`` in ``fmt``."""
        return next(p for p in self.predictions if p.k == k and p.fmt == fmt)


def run_sweep(
    front_door: str,
    settings: Settings,
    plan: SweepPlan,
    progress: bool = True,
    reuse: Mapping[str, RowResult] | None = None,
) -> DoorSweep:
    """Trains ``plan``'s rows at each of its ``k`` through ``front_door``.

    Args:
        front_door: ``"torch"`` or ``"jax"``.
        settings: model, optimizer and batch; ``steps`` is replaced by ``plan.steps``.
        plan: the ``k``, the rows, the real accumulation.
        progress: show progress bars.
        reuse: results at ``k = 1`` already trained with the same settings and steps (the
            main table's rows), by row key; they are not trained again.

    Returns:
        The :class:`DoorSweep`.
    """
    if front_door == "torch":
        from demo import torch_door as door
    else:
        from demo import jax_door as door  # type: ignore[no-redef]
    rows = {row.key: row for row in rows_for(front_door)}
    settings = dataclasses.replace(settings, steps=plan.steps, loss_divisor=1, micro_batches=1)
    corpus = load_corpus()
    held_out = held_out_windows(corpus, settings)
    batches = training_windows(corpus, settings)
    entries: list[SweepEntry] = []
    predictions: list[Prediction] = []
    kept: list[np.ndarray] = []
    context = door.one_thread() if front_door == "torch" else contextlib.nullcontext()
    with context:
        for k in plan.ks:
            at_k = dataclasses.replace(settings, loss_divisor=k)
            for fmt, (underflow, suggested) in door.first_step_ranges(
                at_k, batches[0], HALF_FORMATS
            ).items():
                predictions.append(Prediction(k, fmt, underflow, suggested))
            results = []
            for key in plan.rows:
                if k == 1 and reuse is not None and key in reuse:
                    results.append(reuse[key])
                    continue
                keep = None
                if key == "float32" and k == plan.ks[-1]:

                    def keep(grads: Any) -> None:
                        kept.append(door.gradient_log2(grads))

                results.append(door.train_row(rows[key], at_k, batches, held_out, progress, keep))
            entries += _entries(results, k, at_k)
        if plan.accumulate_k is not None:
            k = plan.accumulate_k
            real = dataclasses.replace(settings, loss_divisor=k, micro_batches=k)
            micro = training_windows(corpus, real)
            results = [
                door.train_row(rows[key], real, micro, held_out, progress)
                for key in ACCUMULATION_ROWS
                if key in plan.rows
            ]
            entries += _entries(results, k, real)
    if not kept:  # the largest k's float32 row came from `reuse` (a sweep of k = 1 only)
        kept.append(np.zeros(0))
    return DoorSweep(front_door, plan, entries, predictions, kept[0])


def _entries(results: Sequence[RowResult], k: int, settings: Settings) -> list[SweepEntry]:
    reference = results[0].held_out_loss
    return [
        SweepEntry(k, settings.tokens_per_step, r, reference, settings.micro_batches)
        for r in results
    ]


def same_decisions(ours: RowResult, peer: RowResult) -> bool:
    """Whether the peer skipped the same steps at the same scales."""
    return ours.skipped == peer.skipped and ours.scales == peer.scales


def verdict_lines(sweep: DoorSweep) -> list[str]:
    """The claims at the largest ``k``, and the real accumulation against its emulation."""
    k = sweep.plan.ks[-1]
    keys = sweep.plan.rows
    lines = []
    if "float16" in keys:
        ratio = sweep.entry(k, "float16").ratio
        lines.append(
            f"k = {k}: float16 without scaling ends {100 * (ratio - 1):+.1f}% from float32 "
            f"({'at least' if ratio >= 1.05 else 'NOT'} 5% above)"
        )
    if "float16+dls" in keys:
        ratio = sweep.entry(k, "float16+dls").ratio
        lines.append(
            f"k = {k}: float16 + DLS ends {100 * (ratio - 1):+.1f}% from float32 "
            f"({'within' if abs(ratio - 1) <= 0.02 else 'NOT within'} 2%)"
        )
    if "cbfloat16+dls" in keys:
        entry = sweep.entry(k, "cbfloat16+dls")
        lines.append(
            f"k = {k}: cbfloat16 + DLS (the defaults of set_half_dtype('cbfloat16')) ends "
            f"{100 * (entry.ratio - 1):+.1f}% from float32, {entry.result.skipped_steps} steps "
            f"skipped"
        )
    if "cbfloat16" in keys:
        ratio = sweep.entry(k, "cbfloat16").ratio
        lines.append(f"k = {k}: cbfloat16 without scaling ends {100 * (ratio - 1):+.1f}%")
    if "peer" in keys and "float16+dls" in keys:
        ours, peer = sweep.entry(k, "float16+dls").result, sweep.entry(k, "peer").result
        same = same_decisions(ours, peer)
        lines.append(
            f"k = {k}: float16 + DLS and {peer.row.label} took "
            f"{'the same' if same else 'DIFFERENT'} skip decisions at the same scales on all "
            f"{len(ours.skipped)} steps ({ours.skipped_steps} skipped); training losses "
            f"{'bit-identical' if ours.train_losses == peer.train_losses else 'not identical'}"
        )
    if sweep.plan.accumulate_k is not None:
        k = sweep.plan.accumulate_k
        pairs = [
            (e, sweep.entry(k, e.result.row.key))
            for e in sweep.entries
            if e.micro_batches > 1 and e.result.row.key != "float32"
        ]
        listed = "; ".join(
            f"{real.result.row.label} {100 * (real.ratio - 1):+.2f}% (emulated "
            f"{100 * (emulated.ratio - 1):+.2f}%)"
            for real, emulated in pairs
        )
        lines.append(f"k = {k} with {k} real micro-batches per step, against float32: {listed}")
    return lines


TABLE_COLUMNS = (
    "k",
    "tokens per step",
    "row",
    "held-out loss",
    "ratio to float32",
    "skipped steps",
    "loss-scale range",
    "underflow at scale 1",
    "underflow at loss scale",
)


def table_cells(entry: SweepEntry) -> list[str]:
    """The cells of one entry in the long table."""
    cells = report.row_cells(entry.result, entry.reference)
    k = f"{entry.k} (real)" if entry.micro_batches > 1 else str(entry.k)
    return [k, f"{entry.tokens_per_step:,}", *cells[:7]]


def markdown_tables(sweep: DoorSweep) -> str:
    """The ratio table (rows by ``k``), the prediction table and the long table, markdown."""
    ks = sweep.plan.ks
    emulated = [e for e in sweep.entries if e.micro_batches == 1]
    real = [e for e in sweep.entries if e.micro_batches > 1]
    head = ["row", *(f"k = {k} ({_tokens(e.tokens_per_step)})" for k, e in _firsts(emulated))]
    if real:
        head.append(f"k = {real[0].k}, real accumulation")
    ratios = []
    for key in sweep.plan.rows:
        label = next(e.result.row.label for e in emulated if e.result.row.key == key)
        cells = [label, *(f"{sweep.entry(k, key).ratio:.4f}" for k in ks)]
        if real:
            match = [e for e in real if e.result.row.key == key]
            cells.append(f"{match[0].ratio:.4f}" if match else "-")
        ratios.append(cells)
    predictions = []
    for fmt in HALF_FORMATS:
        cells = [fmt]
        for k in ks:
            p = sweep.prediction(k, fmt)
            scale = report.format_scale(p.suggested_loss_scale)
            cells.append(f"{100 * p.underflow_at_1:.2f}%, {scale}")
        predictions.append(cells)
    lines = [
        "Held-out loss / float32's at the same k:",
        "",
        *markdown_table(head, ratios),
        "",
        "Predicted from the first step (the float32 gradients of the initial weights, "
        "`loss / k`): fraction of gradient elements that underflow at scale 1, and the "
        "suggested loss scale (2 doublings of headroom):",
        "",
        *markdown_table(["format", *(f"k = {k}" for k in ks)], predictions),
        "",
        *markdown_table(TABLE_COLUMNS, [table_cells(e) for e in sweep.entries]),
    ]
    return "\n".join(lines)


def text_table(sweep: DoorSweep) -> str:
    """The long table for the terminal."""
    rows = [list(TABLE_COLUMNS), *(table_cells(e) for e in sweep.entries)]
    widths = [max(len(row[i]) for row in rows) for i in range(len(TABLE_COLUMNS))]
    lines = ["  ".join(c.rjust(w) for c, w in zip(row, widths, strict=True)) for row in rows]
    return "\n".join([lines[0], "-" * len(lines[0]), *lines[1:]])


def _firsts(entries: Sequence[SweepEntry]) -> list[tuple[int, SweepEntry]]:
    seen: dict[int, SweepEntry] = {}
    for e in entries:
        seen.setdefault(e.k, e)
    return list(seen.items())


def _tokens(count: int) -> str:
    if count >= 1_000_000:
        return f"{count / 1_000_000:.1f}M tokens"
    if count >= 1000:
        return f"{count / 1000:.0f}k tokens"
    return f"{count} tokens"


def plot_losses(sweeps: Sequence[DoorSweep], path: Path) -> Path:
    """Held-out loss against tokens per step (log x), one line per row, a panel per door."""
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(sweeps), figsize=(6 * len(sweeps), 4.5), squeeze=False)
    for ax, sweep in zip(axes[0], sweeps, strict=True):
        for key in sweep.plan.rows:
            points = [e for e in sweep.entries if e.result.row.key == key and e.micro_batches == 1]
            x = [e.tokens_per_step for e in points]
            y = [e.result.held_out_loss for e in points]
            style = "--" if key == "float32" else "-"
            ax.plot(x, y, style, marker="o", label=points[0].result.row.label)
        real = [e for e in sweep.entries if e.micro_batches > 1]
        if real:
            ax.scatter(
                [e.tokens_per_step for e in real],
                [e.result.held_out_loss for e in real],
                marker="x",
                color="black",
                zorder=3,
                label=f"k = {real[0].k}, real accumulation",
            )
        ax.set_xscale("log", base=2)
        ax.set_xlabel("tokens per optimizer step (micro-batch tokens x k)")
        ax.set_ylabel("held-out loss (nats/byte)")
        ax.set_title(f"{sweep.front_door}: {sweep.plan.steps} steps at each k")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    return report.save_figure(fig, path)


def plot_underflow(sweeps: Sequence[DoorSweep], path: Path) -> Path:
    """The first step's underflow fraction at scale 1 against tokens per step, per format."""
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4.5))
    for sweep, style in zip(sweeps, ("-", ":"), strict=False):
        tokens = {e.k: e.tokens_per_step for e in sweep.entries}
        for fmt in HALF_FORMATS:
            points = [p for p in sweep.predictions if p.fmt == fmt]
            ax.plot(
                [tokens[p.k] for p in points],
                [100 * p.underflow_at_1 for p in points],
                style,
                marker="o",
                label=f"{fmt} ({sweep.front_door})",
            )
    ax.set_xscale("log", base=2)
    ax.set_xlabel("tokens per optimizer step (micro-batch tokens x k)")
    ax.set_ylabel("gradient elements that underflow at scale 1 (%)")
    ax.set_title("First step's gradient-range report: what underflows without loss scaling")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    return report.save_figure(fig, path)


def plot_gradients(sweep: DoorSweep, path: Path) -> Path:
    """The gradient histogram at the largest ``k`` against the formats' ranges."""
    k = sweep.plan.ks[-1]
    rows = [e.result for e in sweep.entries if e.k == k and e.micro_batches == 1]
    door = DoorResult(f"{sweep.front_door}, k = {k}", rows, sweep.gradient_log2, {})
    return report.plot_gradient_range(door, path)


def plot_all(sweeps: Sequence[DoorSweep], out_dir: Path) -> list[Path]:
    """The sweep's plots: ``sweep_losses.png``, ``sweep_underflow.png`` and
    ``<door>_sweep_gradients.png``."""
    import matplotlib

    matplotlib.use("Agg")
    paths = [
        plot_losses(sweeps, out_dir / "sweep_losses.png"),
        plot_underflow(sweeps, out_dir / "sweep_underflow.png"),
    ]
    for sweep in sweeps:
        if "float16+dls" in sweep.plan.rows and sweep.gradient_log2.size:
            paths.append(plot_gradients(sweep, out_dir / f"{sweep.front_door}_sweep_gradients.png"))
    return paths


def as_json(sweeps: Sequence[DoorSweep]) -> dict[str, Any]:
    """``demo.json``'s ``sweep`` list and ``sweep_predictions`` list."""
    return {
        "sweep": [e.as_json() for s in sweeps for e in s.entries],
        "sweep_predictions": [
            {"front_door": s.front_door, **dataclasses.asdict(p)}
            for s in sweeps
            for p in s.predictions
        ],
    }


def markdown(sweeps: Sequence[DoorSweep], plots: Sequence[Path]) -> list[str]:
    """``demo.md``'s sweep section."""
    steps = ", ".join(sorted({str(s.plan.steps) for s in sweeps}))
    parts = [
        "## Where loss scaling matters: tokens per optimizer step",
        "",
        f"{steps} steps per row; each micro-batch's loss divided by k before backward (one "
        "micro-batch per step: the numerics of every micro-batch of a k-step accumulation, not "
        "its data; `(real)`: k micro-batches per step, accumulated).",
        "",
    ]
    for sweep in sweeps:
        parts += [f"### {sweep.front_door}", "", markdown_tables(sweep), ""]
        parts += [f"* {line}" for line in verdict_lines(sweep)] + [""]
    parts += [f"![{p.stem}]({p.name})" for p in plots]
    return parts
