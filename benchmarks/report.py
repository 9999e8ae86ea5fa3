"""Markdown tables and the JSON file of a benchmark run."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

MARKDOWN_NAME = "bench.md"
JSON_NAME = "bench.json"


def _num(value: float | None) -> str:
    """Three significant digits, without an exponent.

    Example:
        >>> from benchmarks.report import _num
        >>> _num(12.345), _num(0.012345), _num(1234.5), _num(float("nan")), _num(None)
        ('12.3', '0.0123', '1234', 'n/a', 'n/a')
    """
    if value is None or not math.isfinite(value):  # None: undefined (null in the JSON)
        return "n/a"
    if abs(value) < 1e-9:
        return "0"
    digits = max(0, 2 - math.floor(math.log10(abs(value))))
    return f"{value:.{digits}f}"


def _cell(stats: dict[str, float], suffix: str = "") -> str:
    """``median [min, max]``."""
    return f"{_num(stats['median'])}{suffix} [{_num(stats['min'])}, {_num(stats['max'])}]"


def _table(header: list[str], rows: list[list[str]], align: list[str]) -> list[str]:
    lines = ["| " + " | ".join(header) + " |"]
    lines.append("|" + "|".join("---:" if a == "r" else "---" for a in align) + "|")
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return lines


def _yes(flag: bool) -> str:
    return "yes" if flag else "no"


def _iters(results: dict[str, Any], size: str) -> str:
    counts = sorted({c["iters"] for c in results["cases"] if c["size"] == size})
    return "/".join(map(str, counts)) or "0"


BUSY_CORES = 0.25
"""Other processes using more than this many cores on average make the report carry a warning."""


def _thread_note(meta: dict[str, Any]) -> str:
    """The thread-pool settings of the run: they move the facade/torch ratios (README)."""
    env = meta.get("env") or {}
    if not env:
        return "Thread settings: none in the environment (OpenMP and XLA defaults)."
    return "Thread settings: " + ", ".join(f"`{k}={v}`" for k, v in sorted(env.items())) + "."


def _load_note(meta: dict[str, Any], sizes: dict[str, Any]) -> list[str]:
    """How busy the machine was with other processes, and a warning when it was."""
    other = meta.get("other_cpu_cores")
    if other is None:
        return []
    per_size = ", ".join(
        f"{name} {s['other_cpu_cores']:.2f}"
        for name, s in sizes.items()
        if s.get("other_cpu_cores") is not None
    )
    text = (
        f"Other processes kept {other:.2f} of {meta['cpu_count']} cores busy on average "
        f"during the run (by size: {per_size}); load average at start "
        f"{meta.get('load_average_start')}."
    )
    if other > BUSY_CORES:
        text += (
            " **The machine was shared**: torch's OpenMP threads then wait at barriers for "
            "descheduled peers, and steps can be several (even tens of) times slower and far "
            "noisier; treat this run's numbers, ratios included, with caution."
        )
    return [text, ""]


def markdown(results: dict[str, Any]) -> str:
    """The report: run facts and one table per section; cells are ``median [min, max]``."""
    meta = results["meta"]
    sizes = results["sizes"]
    out = [
        "# Benchmarks",
        "",
        f"`{meta['command']}` on {meta['date']}: {meta['cpu_count']} CPUs, torch "
        f"{meta['torch']} ({meta['torch_threads']} threads), jax {meta['jax']}, optax "
        f"{meta['optax']}; {meta['rounds']} rounds, variants interleaved round by round in one "
        f"process; every cell is median [min, max] over rounds, a round being the median of "
        f"its steps; wall time {meta.get('wall_seconds', math.nan):.0f} s.",
        "",
        _thread_note(meta),
        "",
        "Sizes: "
        + "; ".join(
            f"{name} = {s['tensors']} tensors, {s['params']:,} params" for name, s in sizes.items()
        )
        + ". Steps per round: "
        + ", ".join(f"{name} {_iters(results, name)}" for name in sizes)
        + ".",
        "",
        *_load_note(meta, sizes),
        '## 1. torch: the facade against `torch.amp.GradScaler("cpu")` (ms per step)',
        "",
        "Step: `optimizer.step()` (bare), `scaler.step(opt); scaler.update()` for both "
        "scalers; with clipping torch adds `unscale_` + `clip_grad_norm_`, the facade uses "
        "DLS + GCC (`max_gradient_norm`). Overhead: step minus the bare step of the same round.",
        "",
    ]
    out += _table(
        [
            "size",
            "optimizer",
            "clip",
            "bare",
            "torch",
            "facade",
            "facade/torch step",
            "torch overhead",
            "facade overhead",
            "facade/torch overhead",
        ],
        [
            [
                r["size"],
                r["optimizer"],
                _yes(r["clip"]),
                _cell(r["bare_ms"]),
                _cell(r["torch_ms"]),
                _cell(r["facade_ms"]),
                _cell(r["step_ratio"], "x"),
                _cell(r["torch_overhead_ms"]),
                _cell(r["facade_overhead_ms"]),
                _cell(r["overhead_ratio"], "x"),
            ]
            for r in results["torch"]
        ],
        ["l", "l", "l"] + ["r"] * 7,
    )
    out += [
        "",
        "## 2. JAX-native: jitted optax AdamW step, alone and loss-scaled through `amp_core` (ms)",
        "",
        "Each is `jax.jit(update, donate_argnums=(0, 1))` over (params, opt_state, grads). "
        "DLS and DLS+GCC: `with_loss_scaling` then `optax.apply_updates`; fused: "
        "`apply_scaled_gradients` (DLS, the update applied inside the skip branch).",
        "",
    ]
    out += _table(
        [
            "size",
            "optax adamw",
            "+ DLS",
            "+ DLS+GCC",
            "+ DLS fused",
            "DLS/plain",
            "DLS+GCC/plain",
            "fused/plain",
        ],
        [
            [
                r["size"],
                _cell(r["adamw_ms"]),
                _cell(r["dls_ms"]),
                _cell(r["dls_gcc_ms"]),
                _cell(r["dls_fused_ms"]),
                _cell(r["dls_ratio"], "x"),
                _cell(r["dls_gcc_ratio"], "x"),
                _cell(r["dls_fused_ratio"], "x"),
            ]
            for r in results["jax"]
        ],
        ["l"] + ["r"] * 7,
    )
    out += [
        "",
        "## 3. Bandwidth floor",
        "",
        "Streaming rates on a float32 buffer of the size's parameter count: torch "
        "`buf.mul_(1.0)` (read+write, 8 B/element) and a jitted JAX `sum` over the same memory "
        "(read, 4 B/element), in GB/s.",
        "",
    ]
    out += _table(
        ["size", "params", "in-place GB/s", "read-only GB/s"],
        [
            [r["size"], f"{r['params']:,}", _cell(r["inplace_gbps"]), _cell(r["read_gbps"])]
            for r in results["bandwidth"]
        ],
        ["l", "r", "r", "r"],
    )
    out += [
        "",
        "Floor = minimal bytes per parameter / in-place rate (median). Minimal-traffic model: "
        "8 B/param for unscale+check (one read+write pass), 12 B/param with clipping (a read "
        "for the norm, then one read+write), 4 B/param when the scale is handed to a fused "
        "optimizer (one read-only pass). Fraction = floor / median overhead over the bare "
        "step (1.0 = at the floor; n/a if the overhead is not positive).",
        "",
    ]
    out += _table(
        [
            "size",
            "optimizer",
            "clip",
            "B/param",
            "floor ms",
            "torch overhead ms",
            "torch fraction",
            "facade overhead ms",
            "facade fraction",
        ],
        [
            [
                r["size"],
                r["optimizer"],
                _yes(r["clip"]),
                str(r["bytes_per_param"]),
                _num(r["floor_ms"]),
                _num(r["torch_overhead_ms"]),
                _num(r["torch_fraction"]),
                _num(r["facade_overhead_ms"]),
                _num(r["facade_fraction"]),
            ]
            for r in results["floor"]
        ],
        ["l", "l", "l"] + ["r"] * 6,
    )
    out += [
        "",
        "## 4. Compilation",
        "",
        "First step: wall time of the first call (for the facade: after constructing the "
        "scaler; includes building its arena). Compiles: XLA backend compilations during "
        "construction and the first call (a configuration already compiled in this process "
        "compiles nothing), and during all timed rounds after warm-up (must be 0). "
        f"Total compilations after warm-up, all cases: {meta.get('compiles_after_warmup_total')}.",
        "",
    ]
    out += _table(
        ["size", "case", "first step s", "compiles (s)", "compiles after warm-up"],
        [
            [
                r["size"],
                r["case"],
                _num(r["first_step_s"]),
                f"{r['first_step_compiles']} ({_num(r['first_step_compile_s'])})",
                str(r["compiles_after_warmup"]),
            ]
            for r in results["compile"]
        ],
        ["l", "l", "r", "r", "r"],
    )
    return "\n".join(out) + "\n"


def _finite(value: Any) -> Any:
    """``value`` with every non-finite float replaced by ``None`` (strict JSON has no NaN)."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_finite(v) for v in value]
    return value


def write(results: dict[str, Any], out_dir: Path) -> tuple[Path, Path]:
    """Writes ``bench.md`` and ``bench.json`` (every raw number; ``null`` for undefined) into ``out_dir``.

    Returns:
        The markdown and JSON paths.
    """
    out_dir.mkdir(parents=True, exist_ok=True)
    md_path = out_dir / MARKDOWN_NAME
    json_path = out_dir / JSON_NAME
    md_path.write_text(markdown(results))
    json_path.write_text(json.dumps(_finite(results), indent=1, allow_nan=False) + "\n")
    return md_path, json_path
