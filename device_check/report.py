"""The markdown report of :mod:`device_check` (the JSON file holds every number)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from workbench.tables import markdown_table, number, yes
from workbench.whole_loop import comparison_table

GIB = 2.0**30


def _gib(value: float | None) -> str:
    return "n/a" if value is None else f"{value / GIB:.2f}"


def _sci(value: float | None) -> str:
    """A small relative error in scientific notation: ``3.2e-07``."""
    return "n/a" if value is None else f"{value:.1e}"


def _seconds(section: dict[str, Any]) -> str:
    return f"{section.get('seconds', 0.0):.1f} s"


def _environment(results: dict[str, Any]) -> list[str]:
    env = results["environment"]
    rows = [
        ["python", env.get("python")],
        ["platform", env.get("platform")],
        ["CPUs / torch threads", f"{env.get('cpu_count')} / {env.get('torch_threads')}"],
        ["torch (CUDA)", f"{env.get('torch')} ({env.get('torch_cuda')})"],
        ["packages", ", ".join(f"{k} {v}" for k, v in env.get("packages", {}).items())],
    ]
    if "gpu_name" in env:
        rows += [
            [
                "GPU",
                f"{env['gpu_name']}, capability {env['gpu_capability']}, "
                f"{_gib(env['gpu_memory_bytes'])} GiB, {env['gpu_multiprocessors']} SMs",
            ],
            ["driver / cuDNN", f"{env.get('driver')} / {env.get('cudnn')}"],
        ]
    rows += [
        ["JAX backend", env.get("jax_backend", env.get("jax_backend_error"))],
        ["JAX devices", ", ".join(env.get("jax_devices") or [])],
    ]
    if env.get("jax_backend_errors") and results["device"] != "cpu":
        rows.append(
            [
                "JAX backend errors",
                "; ".join(f"{k}: {v}" for k, v in env["jax_backend_errors"].items()),
            ]
        )
    settings = {k: v for k, v in (env.get("env") or {}).items() if v is not None}
    rows.append(["environment", ", ".join(f"`{k}={v}`" for k, v in settings.items()) or "none set"])
    changed = {
        k: v for k, v in (env.get("env_at_end") or {}).items() if v != (env.get("env") or {}).get(k)
    }
    if changed:
        rows.append(["changed during the run", ", ".join(f"`{k}={v}`" for k, v in changed.items())])
    return [
        "## Environment",
        "",
        *markdown_table(["", "value"], [[k, str(v)] for k, v in rows], ["l", "l"]),
        "",
    ]


def _memory(section: dict[str, Any]) -> list[str]:
    out = markdown_table(
        ["checkpoint", "JAX backends initialized", "free GiB", "torch reserved GiB"],
        [
            [
                c["at"],
                str(c["jax_backends_initialized"]),
                _gib(c.get("free_bytes")),
                _gib(c.get("torch_reserved_bytes")),
            ]
            for c in section["checkpoints"]
        ],
        ["l", "l", "r", "r"],
    )
    out.append("")
    if section.get("outside_torch_bytes") is not None:
        out.append(
            f"Free memory taken outside torch's allocator since the facade started: "
            f"{_gib(section['outside_torch_bytes'])} GiB "
            f"({section['outside_torch_fraction']:.1%} of {_gib(section['total_bytes'])} GiB)."
        )
    else:
        out.append(f"Free-memory readings: n/a ({section.get('reason')}).")
    stats = section.get("jax_memory_stats")
    out += [
        "",
        f"JAX device {section.get('jax_device')}: "
        + (
            ", ".join(
                f"{k} {_gib(v)} GiB" if "bytes" in k or "size" in k else f"{k} {v}"
                for k, v in stats.items()
            )
            if stats
            else f"n/a ({section.get('jax_memory_stats_reason')})"
        )
        + f". The scale lives on `{section.get('scale_device')}`; JAX initialized before the "
        f"first decision: {section.get('jax_initialized_before_first_decision')}. DLPack "
        f"crossing: `{section.get('crossing')}`"
        + (
            f" (the CUDA one {section['cuda_crossing_failure']})"
            if section.get("cuda_crossing_failure")
            else ""
        )
        + ".",
    ]
    return out


def _trajectory(scales: list[float]) -> str:
    """``4096 x2, 8192, 4096 ...``: the scale after each update, runs collapsed."""
    parts: list[str] = []
    for scale in scales:
        text = number(scale)
        if parts and parts[-1].split(" x")[0] == text:
            count = int(parts[-1].split(" x")[1]) + 1 if " x" in parts[-1] else 2
            parts[-1] = f"{text} x{count}"
        else:
            parts.append(text)
    return ", ".join(parts)


def _correctness(section: dict[str, Any]) -> list[str]:
    model = section["model"]
    out = [
        f"**{'PASSED' if section['passed'] else 'FAILED'}**, {section['compared_steps']} compared "
        f"steps. Model: M's layout at width {model['d_model']} ({model['tensors']} tensors, "
        f"{model['params']:,} params), {model['batch']} x {model['tokens']} tokens, "
        f"{model['autocast']} autocast. `static`: no faults (torch's scaler skips on inf even at "
        "a fixed scale, static cstorch never checks: the semantics coincide on finite steps "
        "only); `dls`: growth interval = steps_per_increase + 1, faults injected, bit for bit; "
        "`dls_gcc`: clipping at half the first norm, parameters within tolerance. Norm errors are "
        "relative to a float64 norm of the same gradients.",
        "",
    ]
    out += markdown_table(
        [
            "mode",
            "optimizer",
            "passed",
            "steps",
            "skipped (natural)",
            "scale after each step",
            "facade norm err",
            "torch norm err",
            "grads from torch",
            "clipped steps",
        ],
        [
            [
                r["mode"],
                r["optimizer"],
                yes(r["passed"]),
                str(r["steps"]),
                f"{r['skipped_steps']} ({r['natural_overflows']})",
                _trajectory(r["scales"]),
                _sci(r["facade_norm_max_rel_err"]),
                _sci(r["torch_norm_max_rel_err"]),
                str(r["gradients_from_torch_steps"]),
                str(r["clipped_steps"]) if r["mode"] == "dls_gcc" else "",
            ]
            for r in section["runs"]
        ],
        ["l", "l", "l", "r", "r", "l", "r", "r", "r", "r"],
    )
    for r in section["runs"]:
        for text in r["mismatches"]:
            out.append(f"- {r['mode']}, {r['optimizer']}: {text}")
    return out


def _host_syncs(section: dict[str, Any]) -> list[str]:
    if not section.get("applicable"):
        return [f"n/a: {section.get('reason')}."]
    out = [
        f"Model S. Syncs: synchronising operations torch reports per iteration in `scale`, "
        f'`step` and `update` (`set_sync_debug_mode("warn")`). Sleep probe: '
        f"{number(section['sleep_ms'])} ms of device work queued after backward; `step` + "
        "`update` host time (median); a scaler that waits for the device takes about that long.",
        "",
    ]
    out += markdown_table(
        ["optimizer", "scaler", "syncs / iteration", "where", "host ms with sleep", "waited"],
        [
            [
                r["optimizer"],
                r["scaler"],
                number(r["sync_debug"]["median"]),
                "; ".join(f"`{s['where']}` x{s['count']}" for s in r["sync_debug"]["sites"]),
                number(r["sleep_probe"]["median_host_ms"]) if r["sleep_probe"] else "n/a",
                yes(r["sleep_probe"]["waited_for_device"]) if r["sleep_probe"] else "n/a",
            ]
            for r in section["rows"]
        ],
        ["l", "l", "r", "l", "r", "l"],
    )
    return out


def _timings(section: dict[str, Any]) -> list[str]:
    whole, calls = section["whole"], section["per_call"]
    sizes = "; ".join(
        f"{n}: {s['tensors']} tensors, {s['params']:,} params" for n, s in whole["sizes"].items()
    )
    out = [
        "Whole iterations (ms, medians over rounds; ratios facade / torch, median [min, max]); "
        f"`zero_grad()` with torch's default. Sizes: {sizes}.",
        "",
        *comparison_table(whole["rows"], with_set_to_none=False),
        "",
        "Compilations after warm-up (must be 0): "
        + ", ".join(
            f"{g['size']} {g['optimizer']} {sum(g['compiles_after_warmup'].values())}"
            for g in whole.get("groups", [])
        )
        + ".",
        "",
        f"Host microseconds per scaler call (medians of {calls['iterations']} iterations, "
        f"{calls['tensors']} tensors, device idle at each call):",
        "",
    ]
    names = ("scale", "unscale_", "step", "update", "scaler")
    out += markdown_table(
        ["optimizer", "loop", "scaler", *names],
        [
            [
                r["optimizer"],
                r["loop"],
                r["scaler"],
                *(number(r["us"].get(n)) if n in r["us"] else "" for n in names),
            ]
            for r in calls["rows"]
        ],
        ["l", "l", "l"] + ["r"] * len(names),
    )
    return out


def _compiled(section: dict[str, Any]) -> list[str]:
    model, settings, eager = section["model"], section["settings"], section["eager"]
    out = [
        f"Model {model['layout']} ({model['tensors']} tensors, {model['params']:,} params), "
        f"{model['optimizer']}, {model['autocast']} autocast, `unscale_` + `clip_grad_norm_`; "
        f"inf losses at steps {settings['fault_steps']}. Each pattern against the eager loop: "
        f"skips and scales equal, parameters unchanged on skipped steps, at most "
        f"{_sci(settings['param_atol'])} from eager at the end, no graph compiled after "
        f"{settings['warm_up']} warm-up steps. Eager: {number(eager['median_ms'])} ms per "
        f"iteration (median of {settings['timed_iterations']}). "
        f"Verdict: {'passed' if section['passed'] else '**FAILED**'}.",
        "",
    ]
    rows = []
    for row in section["rows"]:
        if not row["applicable"]:
            rows.append([row["pattern"], f"n/a: {row['reason']}", *[""] * 7])
            continue
        rows.append(
            [
                row["pattern"],
                yes(row["passed"]),
                yes(row["same_skips"] and row["same_scales"]),
                yes(all(row["unchanged_on_skips"])),
                _sci(row["max_param_diff"]),
                str(row["compiles_after_warmup"]),
                f"{row['graph_breaks']} ({row['facade_graph_breaks']})",
                str(row["cudagraph_skips"]),
                number(row["median_ms"]),
            ]
        )
    out += markdown_table(
        [
            "pattern",
            "passed",
            "skips, scales",
            "skipped unchanged",
            "max diff",
            "compiles after warm-up",
            "breaks (facade's)",
            "CUDA graph skips",
            "ms / iteration",
        ],
        rows,
        ["l", "l", "l", "l", "r", "r", "r", "r", "r"],
    )
    reasons = sorted({r for row in section["rows"] for r in row.get("cudagraph_skip_reasons", [])})
    if reasons:
        out += ["", "CUDA graph skip reasons: " + "; ".join(f"`{r}`" for r in reasons) + "."]
    return out


SECTIONS: tuple[tuple[str, str, Callable[[dict[str, Any]], list[str]]], ...] = (
    ("memory", "Memory", _memory),
    ("correctness", "Correctness against torch.amp.GradScaler", _correctness),
    ("host_syncs_per_iteration", "Host synchronisations per iteration", _host_syncs),
    ("timings", "Timings", _timings),
    ("compiled", "The facade around torch.compile", _compiled),
)
"""JSON key, heading and renderer of each section, in report order."""


def markdown(results: dict[str, Any]) -> str:
    """The report: the verdict, the environment, then every section that ran."""
    env = results["environment"]
    device = results["device"] + (f" ({env['gpu_name']})" if "gpu_name" in env else "")
    verdict = {True: "passed", False: "**FAILED**", None: "not finished"}[results["passed"]]
    wall = results.get("wall_seconds")
    out = [
        f"# Device check: {device}{', quick' if results['quick'] else ''}",
        "",
        f"Verdict: {verdict} (correctness and the compiled patterns passed, no section raised). `{results['command']}` "
        f"on {results['date']}, wall time {number(wall)} s.",
        "",
        *_environment(results),
    ]
    heading = 0
    for key, title, render in SECTIONS:
        section = results.get(key)
        if section is None:
            continue
        heading += 1
        out += [f"## {heading}. {title} ({_seconds(section)})", ""]
        if "error" in section:
            out += [
                f"**The section raised**: `{section['error']}` (traceback in the JSON file).",
                "",
            ]
            continue
        out += [*render(section), ""]
    return "\n".join(out).rstrip("\n") + "\n"
