"""PNG plots of a benchmark run, drawn from its own results (the dict ``bench.json`` holds).

Three plots, each written only when its section ran:

* ``jax_train_step.png``: the JAX train step, every variant's time over plain optax AdamW, for
  both losses (the floor and the peers included);
* ``whole_iteration.png``: whole iterations of the documented loop, the facade's iteration over
  torch's scaler's, per size, optimizer, clipping and ``zero_grad`` setting;
* ``host_cost.png``: the host cost per gradient tensor, each scaler's overhead over the bare
  loop in us per tensor.

Bars are medians over rounds; the error bars span the rounds' minimum to maximum (the axis ends
a little beyond the largest median: a round disturbed by another process may run off it).
matplotlib draws with the Agg backend (no display needed).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

STEP_PNG = "jax_train_step.png"
WHOLE_PNG = "whole_iteration.png"
HOST_PNG = "host_cost.png"


def _pyplot() -> Any:
    import matplotlib

    matplotlib.use("Agg", force=True)
    import matplotlib.pyplot as plt

    return plt


def _spread(stats: list[dict[str, Any]]) -> tuple[list[float], list[list[float]]]:
    """Medians and the (below, above) error-bar lengths of min and max (0 where undefined)."""
    medians, below, above = [], [], []
    for s in stats:
        median = s["median"] if s["median"] is not None else float("nan")
        medians.append(median)
        low = s["min"] if s["min"] is not None else median
        high = s["max"] if s["max"] is not None else median
        below.append(max(0.0, median - low))
        above.append(max(0.0, high - median))
    return medians, [below, above]


def _limit(ax: Any, medians: list[float]) -> None:
    """The value axis from 0 (or the smallest median) to a third beyond the largest median."""
    finite = [m for m in medians if m == m]
    if finite:
        ax.set_xlim(min(0.0, min(finite) * 1.2), max(finite) * 1.35)


def _save(fig: Any, path: Path) -> Path:
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    _pyplot().close(fig)
    return path


def plot_step(results: dict[str, Any], path: Path) -> Path:
    """The JAX train-step table: each variant's step time over plain optax, per loss."""
    plt = _pyplot()
    step = results["step"]
    losses = list(dict.fromkeys(row["loss"] for row in step["rows"]))
    variants = list(dict.fromkeys(row["variant"] for row in step["rows"]))
    fig, ax = plt.subplots(figsize=(8.5, 0.32 * len(variants) * len(losses) + 1.5))
    height = 0.8 / max(1, len(losses))
    every = []
    for index, loss in enumerate(losses):
        rows = {r["variant"]: r for r in step["rows"] if r["loss"] == loss}
        stats = [rows[v]["ratio_plain"] for v in variants if v in rows]
        positions = [i + index * height for i, v in enumerate(variants) if v in rows]
        medians, errors = _spread(stats)
        every += medians
        bars = ax.barh(positions, medians, height, xerr=errors, capsize=2, label=loss)
        ax.bar_label(bars, labels=[f"{m:.2f}x" for m in medians], padding=3, fontsize=8)
    _limit(ax, every)
    ax.axvline(1.0, color="black", linewidth=0.8)
    ax.set_yticks([i + height * (len(losses) - 1) / 2 for i in range(len(variants))])
    ax.set_yticklabels(variants)
    ax.invert_yaxis()
    ax.set_xlabel("step time / plain optax AdamW step (median over rounds; bars: min-max)")
    ax.set_title(
        f"JAX train step, {step['size']} ({step['tensors']} leaves, {step['params'] / 1e6:.1f}M "
        "params), float16 compute"
    )
    ax.legend(loc="upper right")
    return _save(fig, path)


def _whole_label(row: dict[str, Any]) -> str:
    label = f"{row['size']} {row['optimizer']}{' + clip' if row['clip'] else ''}"
    return label if row.get("set_to_none", True) else label + ", set_to_none=False"


def plot_whole(results: dict[str, Any], path: Path) -> Path:
    """The whole-iteration table: the facade's iteration over torch's scaler's."""
    plt = _pyplot()
    rows = results["whole"]
    fig, ax = plt.subplots(figsize=(8.5, 0.32 * len(rows) + 1.4))
    medians, errors = _spread([r["step_ratio"] for r in rows])
    bars = ax.barh(range(len(rows)), medians, xerr=errors, capsize=2, color="tab:green")
    ax.bar_label(bars, labels=[f"{m:.2f}x" for m in medians], padding=3, fontsize=7)
    _limit(ax, medians)
    ax.axvline(1.0, color="black", linewidth=0.8)
    ax.set_yticks(range(len(rows)))
    ax.set_yticklabels([_whole_label(r) for r in rows], fontsize=8)
    ax.invert_yaxis()
    ax.set_xlabel("facade iteration / torch.amp.GradScaler iteration (median; bars: min-max)")
    ax.set_title("Whole iterations of the documented loop: facade / torch")
    return _save(fig, path)


def plot_host(results: dict[str, Any], path: Path) -> Path:
    """The host-cost table: each scaler's host cost per gradient tensor, in us (its calls timed
    in place, minus the bare loop's ``optimizer.step()``)."""
    plt = _pyplot()
    rows = results["host"]
    fig, ax = plt.subplots(figsize=(8, 0.55 * len(rows) + 1.6))
    labels = [f"{r['tensors']:,} tensors, {r['optimizer']}" for r in rows]
    height = 0.4
    every = []
    for index, (name, color) in enumerate((("torch", "tab:blue"), ("facade", "tab:orange"))):
        medians, errors = _spread([r[f"{name}_us_per_tensor"] for r in rows])
        every += medians
        positions = [i + index * height for i in range(len(rows))]
        label = "torch.amp.GradScaler" if name == "torch" else "facade"
        bars = ax.barh(positions, medians, height, xerr=errors, capsize=2, color=color, label=label)
        ax.bar_label(bars, labels=[f"{m:.2f}" for m in medians], padding=3, fontsize=8)
    _limit(ax, every)
    ax.set_yticks([i + height / 2 for i in range(len(rows))])
    ax.set_yticklabels(labels)
    ax.invert_yaxis()
    ax.set_xlabel(
        "scaler calls minus the bare optimizer.step(), us per gradient tensor "
        "(median; bars: min-max)"
    )
    ax.set_title("Host cost per gradient tensor (one-element gradients)")
    ax.legend(loc="best")
    return _save(fig, path)


def write_plots(results: dict[str, Any], out_dir: Path) -> list[Path]:
    """Writes the plots of the sections that ran into ``out_dir``; returns their paths.

    Example:
        >>> import tempfile
        >>> from pathlib import Path
        >>> from benchmarks.plots import write_plots
        >>> write_plots({"step": None, "whole": [], "host": []}, Path(tempfile.mkdtemp()))
        []
    """
    out_dir.mkdir(parents=True, exist_ok=True)
    written = []
    if results.get("step") and results["step"]["rows"]:
        written.append(plot_step(results, out_dir / STEP_PNG))
    if results.get("whole"):
        written.append(plot_whole(results, out_dir / WHOLE_PNG))
    if results.get("host"):
        written.append(plot_host(results, out_dir / HOST_PNG))
    return written
