"""Markdown tables and the JSON file of a benchmark run."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from benchmarks import cbfloat16_bench, memory_bench, startup_bench, step_bench
from workbench.jsonsafe import write_json
from workbench.tables import markdown_table, number, stats_cell, yes
from workbench.whole_loop import comparison_table, spike_skip_table

MARKDOWN_NAME = "bench.md"
JSON_NAME = "bench.json"


def _iters(results: dict[str, Any], section: str) -> str:
    """Timed calls per round of ``section``'s cases, by size: ``"S 20, M 2/5"``."""
    by_size: dict[str, set[int]] = {}
    for case in results["cases"]:
        if case["section"] == section:
            by_size.setdefault(case["size"], set()).add(case["iters"])
    return ", ".join(f"{size} {'/'.join(map(str, sorted(n)))}" for size, n in by_size.items())


BUSY_CORES = 0.25
"""Other processes using more than this many cores on average make the report carry a warning."""


def _thread_note(meta: dict[str, Any]) -> str:
    """The thread-pool settings of the run: they move the facade/torch ratios (docs/performance.md)."""
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
    by_size = f" (by size: {per_size})" if per_size else ""
    text = (
        f"Other processes kept {other:.2f} of {meta['cpu_count']} cores busy on average "
        f"during the run{by_size}; load average at start {meta.get('load_average_start')}."
    )
    if other > BUSY_CORES:
        text += (
            " **The machine was shared**: torch's OpenMP threads then wait at barriers for "
            "descheduled peers, and steps can be several (even tens of) times slower and far "
            "noisier; treat this run's numbers, ratios included, with caution."
        )
    return [text, ""]


def _size_text(name: str, size: dict[str, Any]) -> str:
    text = f"{name} = {size['tensors']} tensors, {size['params']:,} params"
    whole = size.get("whole")
    if whole and (whole["tensors"], whole["params"]) != (size["tensors"], size["params"]):
        text += f" (whole-iteration model: {whole['tensors']} tensors, {whole['params']:,} params)"
    return text


def _cpu_note(meta: dict[str, Any]) -> str:
    """The CPU and the features that decide half precision's speed on it.

    Example:
        >>> from benchmarks.report import _cpu_note
        >>> _cpu_note({"cpu_model": "AMD EPYC", "cpu_features": {"AMX": False, "AVX-512": True}})
        'CPU: AMD EPYC; AVX-512: yes; AMX: no.'
    """
    features = meta.get("cpu_features")
    model = meta.get("cpu_model", "model not recorded")
    if not features:
        return f"CPU: {model}; its features could not be read."
    listed = sorted(features.items(), key=lambda item: not item[1])
    return f"CPU: {model}; " + "; ".join(f"{k}: {yes(v)}" for k, v in listed) + "."


def _section_times(meta: dict[str, Any]) -> list[str]:
    """Where the run's time went: each section's wall seconds and CPU seconds (this process's
    and its child processes', together).

    Example:
        >>> seconds = {"whole": {"wall": 61.2, "cpu": 100.4, "children_cpu": 0.0}}
        >>> _section_times({"section_seconds": seconds})
        ['Section times, wall / CPU s (child processes included): whole 61 / 100.', '']
    """
    seconds = meta.get("section_seconds") or {}
    if not seconds:
        return []
    cells = ", ".join(
        f"{name} {s['wall']:.0f} / {s['cpu'] + s['children_cpu']:.0f}"
        for name, s in seconds.items()
    )
    return [f"Section times, wall / CPU s (child processes included): {cells}.", ""]


def _header(results: dict[str, Any]) -> list[str]:
    meta = results["meta"]
    sizes = results["sizes"]
    return [
        "# Benchmarks",
        "",
        f"`{meta['command']}` on {meta['date']}: {meta['cpu_count']} CPUs "
        f"({meta.get('cpu_model', 'CPU model not recorded')}), torch "
        f"{meta['torch']} ({meta['torch_threads']} threads), jax {meta['jax']}, optax "
        f"{meta['optax']}; {meta['rounds']} rounds, variants interleaved round by round in one "
        f"process; a round's value is the median of its timed calls, and cells are medians over "
        f"rounds ([min, max] where shown); wall time {meta.get('wall_seconds', math.nan):.0f} s.",
        "",
        _cpu_note(meta),
        "",
        _thread_note(meta),
        "",
        *_section_times(meta),
        *(
            ["Sizes: " + "; ".join(_size_text(name, s) for name, s in sizes.items()) + ".", ""]
            if sizes
            else []
        ),
        *_load_note(meta, sizes),
    ]


def _overflow_note(rows: list[dict[str, Any]]) -> str:
    """Says that no timed step overflowed, or which variants skipped steps."""
    bad = [
        f"{r['size']} {r['optimizer']}{' clip' if r['clip'] else ''}"
        f"{'' if r.get('set_to_none', True) else ' set_to_none=False'}: "
        f"torch {r['torch_skipped_steps']}, facade {r['facade_skipped_steps']}"
        for r in rows
        if r["torch_skipped_steps"] or r["facade_skipped_steps"]
    ]
    if not bad:
        return (
            "No step overflowed: the facade's `get_num_skipped_steps()` is 0 and torch's scale "
            "is unchanged in every variant."
        )
    return (
        "**Steps were skipped for an overflow** (those rows time skipped steps): "
        + "; ".join(bad)
        + "."
    )


def _subnormal_note(sizes: dict[str, Any]) -> str:
    """Subnormal counts of the probe iterations; torch's kernels slow down on subnormals."""
    counts = {name: s["whole"]["subnormals"] for name, s in sizes.items() if s.get("whole")}
    text = "Subnormal float32 values after two probe iterations (gradients / fused AdamW state): "
    text += ", ".join(f"{n} {c['gradients']} / {c['adamw_state']}" for n, c in counts.items())
    if any(c["gradients"] or c["adamw_state"] for c in counts.values()):
        text += " **(not 0: torch's kernels slow down on subnormals, XLA's flush them)**"
    return text + "."


def _whole_section(results: dict[str, Any], heading: int) -> list[str]:
    rows = results["whole"]
    meta = results["meta"]
    tokens = ", ".join(
        f"{name} {s['whole']['batch']} x {s['whole']['tokens']}"
        for name, s in results["sizes"].items()
        if s.get("whole")
    )
    out = [
        f"## {heading}. Whole iteration of the documented loop: the facade against "
        '`torch.amp.GradScaler("cpu")` (ms per iteration)',
        "",
        "Loop: `optimizer.zero_grad(set_to_none=...)`; forward of the size's GPT-2-like model and "
        f"a next-token loss on fixed random tokens (batch x tokens: {tokens}); "
        "`scaler.scale(loss).backward()`; `scaler.step(optimizer)`; `scaler.update()`. With "
        "clipping, torch adds `scaler.unscale_(optimizer)` + `clip_grad_norm_(params, "
        f"{meta.get('whole_clip_norm')})` before `step`; the facade is "
        f'`GradScaler(loss_scale="dynamic", max_gradient_norm={meta.get("whole_clip_norm")})` '
        "(DLS + GCC). Bare: no scaler (`loss.backward(); optimizer.step()`). "
        "`set_to_none=True` is torch's default: backward makes fresh gradient tensors every "
        "iteration. Loss scale 1 + 2^-23 (no value moves, no overflow), learning rate "
        f"{meta.get('learning_rate')}. Overhead: iteration minus the bare iteration of the same "
        "round. XLA-read floor: the least any design that reads the gradients with XLA adds to "
        "the bare loop (import every gradient through DLPack, one jitted sum of squares, then a "
        "non-fused optimizer's gradients multiplied in place or a fused one given `grad_scale` "
        "and `found_inf`; no decision logic): the facade's overhead minus it is what its own "
        "decision costs; it is the same with or without clipping, which needs no other pass. "
        "Ratios: median [min, max] over rounds of the per-round ratio; other cells: "
        f"medians in ms. Iterations per round: {_iters(results, 'whole')}; where a round has "
        f"{2 * results['meta'].get('whole_run', 0)} or more, the variants take turns in runs "
        f"of {results['meta'].get('whole_run')} (each after an untimed iteration), else "
        "variant by variant.",
        "",
        _overflow_note(rows),
        "",
        _subnormal_note(results["sizes"]),
        "",
    ]
    out += [*comparison_table(rows, with_set_to_none=True), ""]
    return out + _spike_skip_part(results.get("spike_skip") or [])


def _spike_skip_part(rows: list[dict[str, Any]]) -> list[str]:
    """The facade with ``spike_skip`` against the plain facade (nothing if it was not timed)."""
    if not rows:
        return []
    skipped = [f"{r['size']}: {r['skipped_steps']}" for r in rows if r["skipped_steps"]]
    note = (
        "No step was skipped."
        if not skipped
        else "**Steps were skipped** (those rows time skipped steps): " + "; ".join(skipped) + "."
    )
    return [
        "Spike skipping: the facade's loop with `GradScaler(..., spike_skip=SpikeSkip())` "
        "(the defaults: the global gradient norm, a window of 128 applied steps, sigma 6) "
        "against the same loop without it, timed in the same rounds as the table above. "
        "The decision is branch-free: the window's mean and deviation are computed at every "
        "step, during the warm-up (the first 128 applied steps) too, so a run too short to "
        f"arm the check times the same work as a longer one. {note} Ratio: median [min, max] "
        "over rounds of "
        "the per-round ratio; other cells: medians in ms.",
        "",
        *spike_skip_table(rows),
        "",
    ]


def _scaler_section(results: dict[str, Any], heading: int) -> list[str]:
    out = [
        f"## {heading}. Scaler only, gradients refilled in place: the facade against "
        '`torch.amp.GradScaler("cpu")` (ms per step)',
        "",
        "Not the loop users run: the gradients of one backward pass are copied back into the "
        "existing `.grad` tensors (`torch._foreach_copy_`, untimed) before every step, as "
        "`zero_grad(set_to_none=False)` would keep them. Step: `optimizer.step()` (bare), "
        "`scaler.scale(loss); scaler.step(opt); scaler.update()` for both scalers (`loss` a "
        "constant: the gradients come from the refill); with clipping torch adds "
        "`unscale_` + `clip_grad_norm_`, the facade uses DLS + GCC (`max_gradient_norm`), "
        "with a threshold the gradients never reach. Overhead: step minus the bare step of the "
        f"same round. Steps per round: {_iters(results, 'torch')}.",
        "",
    ]
    out += markdown_table(
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
                yes(r["clip"]),
                stats_cell(r["bare_ms"]),
                stats_cell(r["torch_ms"]),
                stats_cell(r["facade_ms"]),
                stats_cell(r["step_ratio"], "x"),
                stats_cell(r["torch_overhead_ms"]),
                stats_cell(r["facade_overhead_ms"]),
                stats_cell(r["overhead_ratio"], "x"),
            ]
            for r in results["torch"]
        ],
        ["l", "l", "l"] + ["r"] * 7,
    )
    return [*out, ""]


def _ddp_section(results: dict[str, Any], heading: int) -> list[str]:
    ddp = results["ddp"]
    out = [
        f"## {heading}. Whole iteration under DistributedDataParallel, 2 ranks on the CPU "
        "(small and noisy on 2 cores)",
        "",
    ]
    if ddp.get("error"):
        last = ddp["error"].strip().splitlines()[-1]
        return [*out, f"**The DDP section failed**: `{last}` (full text in the JSON file).", ""]
    out += [
        f"Two processes (gloo on loopback, one torch thread each), each training its own "
        f"`DistributedDataParallel` copy of the {ddp['size']} model ({ddp['tensors']} tensors, "
        f"{ddp['params']:,} params) per variant, on its own tokens; {ddp['optimizer']}, "
        f"`zero_grad()` with torch's default; the whole-iteration loop, interleaved with the same "
        f"{ddp['iters']} iterations per round on both ranks; rank 0's times. The ranks, their "
        f"XLA threads and gloo share the machine's cores: a yardstick, not a headline. Section "
        f"wall time {number(ddp['seconds'])} s.",
        "",
        _overflow_note(ddp["rows"]),
        "",
    ]
    return out + comparison_table(ddp["rows"], with_set_to_none=False) + [""]


def _ratio_cell(stats: dict[str, Any], floor: float | None = None) -> str:
    """A ratio cell, or ``n/a`` where the ratio is undefined (``None`` in the JSON, NaN before).

    ``floor``: the least the ratio can truly be (a variant that does all of its reference's
    work, and more, cannot take less time). A median below it, with a round at or above it, is
    the machine's noise, not a result: the cell says the variant is at its floor and shows the
    measurement beside, so that no ratio below a floor is printed as a result. Where every round
    is below, the reference does work this variant does not (a fusion): that is a result, and
    the cell says the reference is not a floor there.

    Example:
        >>> from benchmarks.report import _ratio_cell
        >>> _ratio_cell({"median": 0.95, "min": 0.9, "max": 1.1}, floor=1.0)
        'at its 1.00x floor (measured 0.950x [0.900, 1.10]: noise)'
        >>> _ratio_cell({"median": 0.5, "min": 0.4, "max": 0.6}, floor=1.0)
        '0.500x [0.400, 0.600] (every round below 1.00x: the reference is not a floor here)'
        >>> _ratio_cell({"median": 1.05, "min": 0.9, "max": 1.1}, floor=1.0)
        '1.05x [0.900, 1.10]'
    """
    if number(stats["median"]) == "n/a":
        return "n/a"
    cell = stats_cell(stats, "x")
    if floor is not None and stats["median"] < floor:
        if stats["max"] is not None and stats["max"] >= floor:
            return f"at its {floor:.2f}x floor (measured {cell}: noise)"
        # every round below: the reference does work this variant does not (a fusion)
        cell += f" (every round below {floor:.2f}x: the reference is not a floor here)"
    return cell


STEP_FLOORS: dict[str, dict[str, float]] = {
    "ratio_plain": {
        name: 1.0
        for name in (
            step_bench.FLOOR,
            step_bench.GATED_FLOOR,
            step_bench.WITH_LOSS_SCALING,
            step_bench.APPLY_SCALED,
            step_bench.JMP,
            step_bench.FLAX,
            step_bench.MPX,
        )
    },
    "ratio_floor": {
        name: 1.0
        for name in (step_bench.GATED_FLOOR, step_bench.WITH_LOSS_SCALING, step_bench.APPLY_SCALED)
    },
    "ratio_gated_floor": {
        name: 1.0 for name in (step_bench.WITH_LOSS_SCALING, step_bench.APPLY_SCALED)
    },
}
"""The step section's floors, per ratio column and variant: every scaler's step does all of plain
optax's work and more; the floor adds the global norm to plain's, the gated floor makes the
update wait for it, and ``amp_core`` does both (and its decision)."""


def _step_section(results: dict[str, Any], heading: int) -> list[str]:
    step = results["step"]
    versions = ", ".join(f"{name} {v or 'not installed'}" for name, v in step["versions"].items())
    out = [
        f"## {heading}. The JAX train step as users write it: `amp_core` against plain optax, "
        "the floor and the other JAX loss scalers (ms per step)",
        "",
        "One `jax.jit` over forward, backward and update, parameters and optimizer state "
        "donated; float32 master weights, float16 compute, `optax.adamw`; the parameters of "
        f"{step['size']}'s GPT-2 layout ({step['tensors']} leaves, {step['params']:,} params). "
        f"Real forward: an MLP over the layout on {step['tokens']} tokens (float32 "
        "cross-entropy). Synthetic loss: `0.5*sum(p16**2)`, whose backward XLA fuses into "
        "AdamW's passes (the step is the optimizer's memory traffic). Real forward, "
        f"{step['micro_batches']} micro-batches: gradient accumulation in one jit, the real "
        "forward's gradients summed over the micro-batches in a `lax.scan`, then one update "
        "(flax's DynamicScale and mpx decide inside their own `value_and_grad`, once per "
        "micro-batch, so they cannot accumulate). Floor: plain AdamW plus "
        "the gradients' global sum of squares, returned and unused (what a global norm costs "
        "by itself). Gated floor: the same sum of squares, taken one leaf after the other as "
        "`amp_core` takes it, with the gradients multiplied by `1 + min(norm**2, 0)` (exactly 1) "
        "before AdamW: every update waits for the whole backward and the norm, as any decision "
        "taken before the update makes it wait; no skip, no scaler state. Peers as their "
        "documentation writes them "
        f"({versions}), with the same loss scale 1 + 2^-23 (no overflow, no growth); jmp with a "
        "float32 scale (its README's float16 one fails, below). Ratios: median [min, max] "
        "over rounds of the per-round ratio; a variant that does all of a reference's work and "
        "more cannot be faster than it, so a median below 1.00x there is noise, not a result: "
        "the cell reads 'at its 1.00x floor' with the measurement beside (where every round is "
        "below, the reference did work that XLA fused away in "
        "the variant, and is marked as no floor there). Traces: how often the step was traced "
        "(1 = one "
        f"compilation). Steps per round: {_iters(results, 'step')}; where a round has "
        f"{2 * results['meta'].get('whole_run', 0)} or more, the variants take turns in runs "
        f"of {results['meta'].get('whole_run')} (each after an untimed step), else variant by "
        "variant.",
        "",
    ]
    by_variant: dict[str, dict[str, dict[str, Any]]] = {}
    for row in step["rows"]:
        by_variant.setdefault(row["variant"], {})[row["loss"]] = row
    losses = list(dict.fromkeys(row["loss"] for row in step["rows"]))
    header = ["variant", "to skip a step, the user writes", "counts skips"]
    for loss in losses:
        header += [f"{loss} ms", f"{loss} / plain", f"{loss} / floor", f"{loss} / gated floor"]
    header.append("traces")
    body = []
    for name, cells in by_variant.items():
        first = next(iter(cells.values()))
        line = [name, first["skip"], yes(first["counts_skips"])]
        for loss in losses:
            row = cells.get(loss)
            if row is None:
                line += ["n/a"] * 4
                continue
            line += [number(row["ms"]["median"])]
            line += [
                _ratio_cell(row[column], STEP_FLOORS[column].get(name))
                for column in ("ratio_plain", "ratio_floor", "ratio_gated_floor")
            ]
        line.append("/".join(str(cells[loss]["traces"]) for loss in losses if loss in cells))
        body.append(line)
    out += markdown_table(header, body, ["l", "l", "l"] + ["r"] * (len(header) - 3))
    out += [
        "",
        "Skip and growth check of every scaler (`benchmarks/scaler_checks.py`): a 2-leaf model "
        "whose true gradient is exact at power-of-two scales, SGD with momentum, scale 2^10 "
        "with growth every 2 finite steps in each library's own terms, batches "
        "`1, 1, 1, inf, 1, 1, 1` (an overflow at step 4). The optimizer's received gradient is "
        "read back from its momentum.",
        "",
    ]
    check_rows = []
    for c in step["checks"]:
        if c["error"]:
            check_rows.append([c["scaler"], f"failed: {c['error']}", "", "", "", "", ""])
            continue
        check_rows.append(
            [
                c["scaler"],
                yes(c["skip_bit_identical"]),
                yes(c["scale_halved"]),
                yes(c["counts_skips"]),
                "never" if c["growth_step"] is None else str(c["growth_step"]),
                "yes" if c["gradients_exact"] else "no: " + "; ".join(c["mismatches"]),
                str(c["traces"]),
            ]
        )
    out += markdown_table(
        [
            "scaler",
            "overflow skipped bit-identically",
            "scale halved",
            "skip counted",
            "scale first doubles on finite step",
            "optimizer got the true gradient on every applied step",
            "traces",
        ],
        check_rows,
        ["l"] * 7,
    )
    out += ["", "Notes (misbehaviours found by these checks, with a reproduction):", ""]
    if not step["findings"]:
        out += ["None.", ""]
    for finding in step["findings"]:
        out += [
            f"* **{finding['scaler']}**: {finding['title']}. Observed: {finding['observed']}.",
            "",
            "  ```python",
            *(f"  {line}" for line in finding["reproduction"].splitlines()),
            "  ```",
            "",
        ]
    return out


def _jax_section(results: dict[str, Any], heading: int) -> list[str]:
    out = [
        f"## {heading}. Second view, gradients as inputs: jitted optax AdamW update, alone and "
        "loss-scaled through `amp_core` (ms)",
        "",
        "Not the step users write (that is the train-step table): the gradients of one torch "
        "backward pass are passed in, already in memory, and only the update is timed. "
        "Each is `jax.jit(update, donate_argnums=(0, 1))` over (params, opt_state, grads). "
        "DLS and DLS+GCC: `with_loss_scaling` then `optax.apply_updates`; fused: "
        "`apply_scaled_gradients`. Floor: plain AdamW gated by one read of the gradients "
        "(multiplied by `1 + min(sum(g**2), 0)`, exactly 1), the least a step able to skip must "
        "add: the check reads every gradient before the update may start. "
        f"Steps per round: {_iters(results, 'jax')}.",
        "",
    ]
    out += markdown_table(
        [
            "size",
            "optax adamw",
            "floor",
            "+ DLS",
            "+ DLS+GCC",
            "+ DLS fused",
            "floor/plain",
            "DLS/plain",
            "DLS+GCC/plain",
            "fused/plain",
            "DLS/floor",
            "fused/floor",
        ],
        [
            [
                r["size"],
                stats_cell(r["adamw_ms"]),
                stats_cell(r["floor_ms"]),
                stats_cell(r["dls_ms"]),
                stats_cell(r["dls_gcc_ms"]),
                stats_cell(r["dls_fused_ms"]),
                stats_cell(r["floor_ratio"], "x"),
                stats_cell(r["dls_ratio"], "x"),
                stats_cell(r["dls_gcc_ratio"], "x"),
                stats_cell(r["dls_fused_ratio"], "x"),
                stats_cell(r["dls_over_floor"], "x"),
                stats_cell(r["dls_fused_over_floor"], "x"),
            ]
            for r in results["jax"]
        ],
        ["l"] + ["r"] * 11,
    )
    return [*out, ""]


def _bandwidth_section(results: dict[str, Any], heading: int) -> list[str]:
    out = [
        f"## {heading}. Bandwidth floor",
        "",
        "Streaming rates on a float32 buffer of the size's parameter count: torch "
        "`buf.mul_(1.0)` (read+write, 8 B/element) and a jitted JAX `sum` over the same memory "
        "(read, 4 B/element), in GB/s.",
        "",
    ]
    out += markdown_table(
        ["size", "params", "in-place GB/s", "read-only GB/s"],
        [
            [
                r["size"],
                f"{r['params']:,}",
                stats_cell(r["inplace_gbps"]),
                stats_cell(r["read_gbps"]),
            ]
            for r in results["bandwidth"]
        ],
        ["l", "r", "r", "r"],
    )
    out += [
        "",
        "Floor = minimal bytes per parameter / in-place rate (median), against the scaler-only "
        "overheads. Minimal-traffic model: "
        "8 B/param for unscale+check (one read+write pass), 12 B/param with clipping (a read "
        "for the norm, then one read+write), 4 B/param when the scale is handed to a fused "
        "optimizer (one read-only pass). Fraction = floor / median overhead over the bare "
        "step (1.0 = at the floor; n/a if the overhead is not positive).",
        "",
    ]
    out += markdown_table(
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
                yes(r["clip"]),
                str(r["bytes_per_param"]),
                number(r["floor_ms"]),
                number(r["torch_overhead_ms"]),
                number(r["torch_fraction"]),
                number(r["facade_overhead_ms"]),
                number(r["facade_fraction"]),
            ]
            for r in results["floor"]
        ],
        ["l", "l", "l"] + ["r"] * 6,
    )
    return [*out, ""]


def _host_section(results: dict[str, Any], heading: int) -> list[str]:
    rows = results["host"]
    out = [
        f"## {heading}. Host cost per gradient tensor: one-element gradients, nothing to compute "
        "(ms per iteration)",
        "",
        "The CPU's stand-in for a launch-bound GPU loop. Model: N one-element parameters, loss "
        "`torch.stack(params).sum()` (backward gives each a fresh, independent gradient); the "
        "documented loop (`zero_grad()` with torch's default, `scale(loss).backward()`, `step`, "
        '`update`) with `torch.amp.GradScaler("cpu")` and the facade\'s '
        '`GradScaler(loss_scale="dynamic")`; bare: no scaler. The loops take turns in runs of '
        f"{results['meta'].get('host_run')} iterations, so that each timed iteration follows one "
        "of its own loop's, as in training. Host cost (the headline): the scaler's calls "
        "(`scale`, `step`, `update`), timed in place inside every iteration, minus the bare "
        "loop's `optimizer.step()`; us per tensor: that / N. Iterations: each loop's whole "
        "iteration, and the overhead as iteration minus the bare iteration of the same round, "
        "which includes anything the scaler leaves behind for the forward and backward passes "
        "but is noisier (those passes are most of the iteration). Ratios: median [min, max] "
        "over rounds of the per-round ratio. Where the facade's time goes: "
        "`python -m benchmarks.host_profile --tensors N`. Iterations per round: "
        f"{_iters(results, 'host')}.",
        "",
        _overflow_note([{**r, "size": f"{r['tensors']} x 1", "clip": False} for r in rows]),
        "",
    ]
    out += markdown_table(
        [
            "tensors",
            "optimizer",
            "facade/torch host cost",
            "torch host cost",
            "facade host cost",
            "torch us/tensor",
            "facade us/tensor",
            "bare iteration",
            "torch iteration",
            "facade iteration",
            "facade/torch overhead, whole iterations",
        ],
        [
            [
                f"{r['tensors']:,}",
                r["optimizer"],
                stats_cell(r["calls_overhead_ratio"], "x"),
                *(
                    number(r[key]["median"])
                    for key in (
                        "torch_calls_overhead_ms",
                        "facade_calls_overhead_ms",
                        "torch_us_per_tensor",
                        "facade_us_per_tensor",
                        "bare_ms",
                        "torch_ms",
                        "facade_ms",
                    )
                ),
                stats_cell(r["overhead_ratio"], "x"),
            ]
            for r in rows
        ],
        ["r", "l"] + ["r"] * 9,
    )
    return [*out, ""]


def _compile_section(results: dict[str, Any], heading: int) -> list[str]:
    out = [
        f"## {heading}. Compilation",
        "",
        "First step: wall time of the first call (for the facade: after constructing the "
        "scaler; includes its first look at the gradients). Compiles: XLA backend compilations during "
        "construction and the first call (a configuration already compiled in this process "
        "compiles nothing), and during all timed rounds after warm-up (must be 0). "
        "Total compilations after warm-up, all cases: "
        f"{results['meta'].get('compiles_after_warmup_total')}.",
        "",
    ]
    out += markdown_table(
        ["size", "section", "case", "first step s", "compiles (s)", "compiles after warm-up"],
        [
            [
                r["size"],
                r["section"],
                r["case"],
                number(r["first_step_s"]),
                f"{r['first_step_compiles']} ({number(r['first_step_compile_s'])})",
                str(r["compiles_after_warmup"]),
            ]
            for r in results["compile"]
        ],
        ["l", "l", "l", "r", "r", "r"],
    )
    return [*out, ""]


def _startup_section(results: dict[str, Any], heading: int) -> list[str]:
    return startup_bench.markdown(results["startup"], heading)


def _cbfloat16_section(results: dict[str, Any], heading: int) -> list[str]:
    return cbfloat16_bench.markdown(results["cbfloat16"], heading)


def _memory_section(results: dict[str, Any], heading: int) -> list[str]:
    return memory_bench.markdown(results["memory"], heading)


def markdown(results: dict[str, Any]) -> str:
    """The report: run facts, then one numbered section per part that ran, in this order."""
    sections = [
        (bool(results["whole"]), _whole_section),
        (bool(results["torch"]), _scaler_section),
        (results["ddp"] is not None, _ddp_section),
        (results.get("step") is not None, _step_section),
        (bool(results["jax"]), _jax_section),
        (bool(results["bandwidth"]), _bandwidth_section),
        (bool(results.get("host")), _host_section),
        (bool(results["compile"]), _compile_section),
        (results.get("startup") is not None, _startup_section),
        (results.get("cbfloat16") is not None, _cbfloat16_section),
        (results.get("memory") is not None, _memory_section),
    ]
    out = _header(results)
    heading = 0
    for present, render in sections:
        if present:
            heading += 1
            out += render(results, heading)
    return "\n".join(out).rstrip("\n") + "\n"


def write(results: dict[str, Any], out_dir: Path) -> tuple[Path, Path]:
    """Writes ``bench.md`` and ``bench.json`` (every raw number; ``null`` for undefined) into ``out_dir``.

    Returns:
        The markdown and JSON paths.
    """
    out_dir.mkdir(parents=True, exist_ok=True)
    md_path = out_dir / MARKDOWN_NAME
    json_path = out_dir / JSON_NAME
    md_path.write_text(markdown(results))
    write_json(json_path, results)
    return md_path, json_path
