"""Peak memory of whole training iterations: every variant in a fresh process of its own.

A process's resident-set peak (``VmHWM`` in ``/proc/self/status``) never goes down, so a
peak is only a variant's own in a process that ran nothing else: each row here is a new
interpreter that imports the same modules (torch, the facade and with it JAX, the workbench),
builds one model, runs ``steps`` iterations of one loop and reports its peak. The variants
alternate round by round; the facade's decision cores are compiled into the run's own cache
first, so every row is a script's second run (the first compiles in its first iteration). Memory is not load-sensitive: the rows mean the same on a busy
machine. Run alone: ``python -m benchmarks --sections memory``.

Loops (:class:`workbench.whole_loop.TrainLoop`, batch :data:`BATCH` x :data:`TOKENS`, fused
AdamW; ``+clip``: torch's ``unscale_`` and ``clip_grad_norm_``, the facade's
``max_gradient_norm``):

* ``float32``: no scaler; ``torch`` / ``torch+clip``: ``torch.amp.GradScaler``; ``facade`` /
  ``facade+clip``: ``cstorch.amp.GradScaler`` (dynamic);
* ``cbfloat16 preview``: the ``facade`` loop inside ``cstorch.amp.cbfloat16_numerics``;
* ``float16 + master weights``: the model held in float16, the optimizer wrapped by
  ``cstorch.amp.with_master_weights``, the ``facade`` scaler (fewer steps: a float16 iteration
  takes seconds on a CPU without float16 arithmetic).

The ``imports`` rows are what a process holds before any model: ``import torch`` against
``import torch_facade`` with JAX's CPU backend started (what a script that only uses
``torch.amp.GradScaler`` does not pay; every row above pays it alike). On a CUDA device the
peak of torch's allocator (``torch.cuda.max_memory_allocated``) and of JAX's are reported too.
"""

from __future__ import annotations

import json
import resource
import statistics
import subprocess
import sys
import tempfile
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from workbench.processes import REPO_ROOT, repo_environment
from workbench.tables import markdown_table

BATCH = 4
"""Sequences per iteration."""

TOKENS = 128
"""Tokens per sequence (at most the model's context)."""

STEPS = 10
"""Iterations per process (the optimizer's state exists from the first; the peak is reached
by the second)."""

MASTER_STEPS = 3
"""Iterations of the float16-held model (seconds each on a CPU without float16 arithmetic)."""

OPTIMIZER = "AdamW fused"

LOOPS = ("float32", "torch", "facade", "torch+clip", "facade+clip")
PREVIEW = "cbfloat16 preview"
MASTER = "float16 + master weights"
VARIANTS = (*LOOPS, PREVIEW, MASTER)
"""Every variant, in report order (``python -m benchmarks --full``)."""

QUICK_VARIANTS = ("float32", "torch", "facade", PREVIEW)
"""The quick run's variants (``make bench``), with :data:`QUICK_STEPS` iterations."""

QUICK_STEPS = 3

REFERENCES = {
    "torch": "float32",
    "facade": "torch",
    "torch+clip": "float32",
    "facade+clip": "torch+clip",
    PREVIEW: "float32",
    MASTER: "facade",
}
"""The row each variant's ratio is taken to (the preview's to plain float32; the table also
gives it to the float32 facade loop it runs)."""

IMPORTS = {
    "import torch": "import torch",
    "import torch_facade, JAX's backend started": (
        "import torch, torch_facade, jax; jax.devices()"
    ),
}

_MB = 2.0**20


def _status() -> dict[str, float]:
    """``/proc/self/status``'s ``VmRSS``, ``VmHWM``, ``RssAnon`` and ``RssFile`` in MiB (the
    peak from ``ru_maxrss`` where there is no ``/proc``)."""
    values: dict[str, float] = {}
    try:
        with open("/proc/self/status", encoding="utf-8") as status:
            for line in status:
                key, _, value = line.partition(":")
                if key in ("VmRSS", "VmHWM", "RssAnon", "RssFile"):
                    values[key] = int(value.split()[0]) * 1024 / _MB
    except OSError:
        pass
    # Without /proc: ru_maxrss, which may include the parent's peak (see _HWM_PROBE).
    values.setdefault("VmHWM", resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / _MB)
    return values


def _minor_faults() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


def _loop(variant: str, size: str, device: str, seed: int) -> Any:
    """The variant's training loop (:class:`workbench.whole_loop.TrainLoop`), ready to step."""
    import torch_facade as cstorch
    from workbench import whole_loop
    from workbench.sizes import SIZES

    spec = SIZES[size]
    workload = whole_loop.make_workload(spec, seed, batch=BATCH, tokens=TOKENS, device=device)
    name = {"float32": "bare", PREVIEW: "facade", MASTER: "facade"}.get(variant, variant)
    loop = whole_loop.TrainLoop(name, OPTIMIZER, True, workload)
    del workload  # the loop trains a copy: one copy of the model stays
    if variant == PREVIEW:
        numerics = cstorch.amp.cbfloat16_numerics(loop.model)
        numerics.__enter__()
        loop.numerics = numerics  # kept (and so entered) for the process's life
    if variant == MASTER:
        loop.model.half()
        loop.params = list(loop.model.parameters())
        inner = whole_loop.OPTIMIZERS[OPTIMIZER](loop.params)
        loop.optimizer = cstorch.amp.with_master_weights(inner)
    return loop


def measure(variant: str, size: str, steps: int, device: str = "cpu", seed: int = 0) -> dict:
    """Runs ``steps`` iterations of ``variant`` at ``size`` in this process and returns its
    memory: RSS after the imports, before the first iteration and at the end, the peak, the
    minor page faults per iteration after the first, and on CUDA the allocators' peaks (MiB).

    Meant for a fresh process (:func:`run` starts one per variant): the peak is the process's.

    Raises:
        ValueError: an unknown variant.
    """
    if variant not in VARIANTS:
        raise ValueError(f"variant must be one of {VARIANTS}; got {variant!r}")
    import torch

    imported = _status()
    loop = _loop(variant, size, device, seed)
    step = loop.step
    ready = _status()
    if device.startswith("cuda"):
        torch.cuda.reset_peak_memory_stats(device)
    step()
    faults = _minor_faults()
    for _ in range(steps - 1):
        step()
    faults = _minor_faults() - faults
    end = _status()
    result = {
        "variant": variant,
        "size": size,
        "steps": steps,
        "params": sum(p.numel() for p in loop.params),
        "import_rss_mb": imported.get("VmRSS"),
        "ready_rss_mb": ready.get("VmRSS"),
        "end_rss_mb": end.get("VmRSS"),
        "end_anon_mb": end.get("RssAnon"),
        "peak_rss_mb": end["VmHWM"],
        "minor_faults_per_step": faults / max(1, steps - 1),
    }
    if device.startswith("cuda"):
        result["cuda_peak_mb"] = torch.cuda.max_memory_allocated(device) / _MB
        result["jax_peak_mb"] = _jax_peak()
    return result


def _jax_peak() -> float | None:
    import jax

    stats = jax.devices()[0].memory_stats() or {}
    peak = stats.get("peak_bytes_in_use")
    return None if peak is None else peak / _MB


def _child(
    variant: str, size: str, steps: int, device: str, seed: int, cache: str
) -> dict[str, Any]:
    """:func:`measure` in a fresh interpreter that runs this file as a script: it imports the
    library and ``workbench``, not the ``benchmarks`` package (the bench's other sections);
    ``cache``: the facade's core cache (``CSTORCH_AMP_CACHE_DIR``)."""
    arguments = json.dumps([variant, size, steps, device, seed])
    done = subprocess.run(
        [sys.executable, "-P", str(Path(__file__).resolve()), arguments],  # -P: no script dir
        check=True,
        capture_output=True,
        text=True,
        cwd=REPO_ROOT,
        env=repo_environment(CSTORCH_AMP_CACHE_DIR=cache),
        timeout=1800,
    )
    return dict(json.loads(done.stdout.strip().splitlines()[-1]))


def _import_peak(code: str) -> float:
    """The peak RSS (MiB) of a fresh interpreter that runs ``code`` alone."""
    probe = f"{code}\n{_HWM_PROBE}"
    done = subprocess.run(
        [sys.executable, "-c", probe],
        check=True,
        capture_output=True,
        text=True,
        cwd=REPO_ROOT,
        env=repo_environment(),
        timeout=600,
    )
    return float(done.stdout.strip().splitlines()[-1]) / 1024


_HWM_PROBE = """
with open("/proc/self/status") as status:
    print(next(int(line.split()[1]) for line in status if line.startswith("VmHWM:")))
"""
"""Prints ``VmHWM`` in KiB. Not ``ru_maxrss``: a child started by ``vfork`` (Python's
``subprocess``) inherits its parent's peak in it, across ``exec``."""


CORES = {"facade": "facade", PREVIEW: "facade", "facade+clip": "facade+clip", MASTER: MASTER}
"""The facade variants, by the decision core they compile: the preview's loop is the ``facade``
loop (the same float32 gradients, the same scaler), so one warm-up process serves both."""


def warm_up_variants(variants: Sequence[str]) -> list[str]:
    """One variant per decision core among ``variants``, to compile it into the run's cache:
    the preview rather than the plain facade where both are run (its process also compiles
    the preview's rounding loop into inductor's cache).

    Example:
        >>> warm_up_variants(["float32", "torch", "facade", "cbfloat16 preview"])
        ['cbfloat16 preview']
        >>> warm_up_variants(["facade", "torch+clip", "facade+clip"])
        ['facade', 'facade+clip']
    """
    chosen: dict[str, str] = {}
    for variant in variants:
        core = CORES.get(variant)
        if core is not None and chosen.get(core) != PREVIEW:
            chosen[core] = variant
    return list(chosen.values())


def run(
    sizes: Sequence[str],
    rounds: int = 1,
    steps: int = STEPS,
    variants: Sequence[str] = VARIANTS,
    device: str = "cpu",
    seed: int = 0,
    tick: Callable[[], None] = lambda: None,
    warm: bool = True,
) -> dict[str, Any]:
    """Measures every variant at every size, one fresh process each, ``rounds`` times
    (variants alternating); returns the medians, the ratios and every sample.

    ``warm``: first compile the facade's decision cores into the run's own cache (a process per
    core and size: :func:`warm_up_variants`), so that every row is a script's second run; ``False`` leaves
    that out, and the facade rows are first runs (the core compiled in the first iteration).

    Raises:
        ValueError: an unknown variant, no size, or ``rounds``/``steps`` below 1.
    """
    unknown = [v for v in variants if v not in VARIANTS]
    if unknown or not variants or not sizes or rounds < 1 or steps < 1:
        raise ValueError(
            f"variants among {VARIANTS}, at least one size, rounds and steps >= 1; got "
            f"variants {list(variants)}, sizes {list(sizes)}, rounds {rounds}, steps {steps}"
        )
    samples: dict[tuple[str, str], list[dict[str, Any]]] = {}
    imports: dict[str, list[float]] = {name: [] for name in IMPORTS}
    with tempfile.TemporaryDirectory(prefix="cstorch-amp-memory-") as cache:
        # As a script's second run: each facade loop's decision core compiled first, into this
        # run's own cache (a first run also compiles it, in the first iteration: tens of MB
        # more at M, docs/performance-notes.md).
        for size in sizes if warm else ():
            for variant in warm_up_variants(variants):
                _child(variant, size, 1, device, seed, cache)
        for _ in range(rounds):
            for name, code in IMPORTS.items():
                imports[name].append(_import_peak(code))
            for size in sizes:
                for variant in variants:
                    count = min(steps, MASTER_STEPS) if variant == MASTER else steps
                    samples.setdefault((size, variant), []).append(
                        _child(variant, size, count, device, seed, cache)
                    )
            tick()
    rows = []
    for runs in samples.values():
        peak = statistics.median(r["peak_rss_mb"] for r in runs)
        row = {
            **runs[0],
            "peak_rss_mb": peak,
            "peak_rss_samples_mb": [r["peak_rss_mb"] for r in runs],
            "minor_faults_per_step": statistics.median(r["minor_faults_per_step"] for r in runs),
        }
        if "cuda_peak_mb" in runs[0]:
            row["cuda_peak_mb"] = statistics.median(r["cuda_peak_mb"] for r in runs)
        rows.append(row)
    by_key = {(r["size"], r["variant"]): r for r in rows}
    for row in rows:
        for key, reference in (
            ("ratio", REFERENCES.get(row["variant"])),
            ("ratio_to_facade", "facade"),
        ):
            other = by_key.get((row["size"], reference)) if reference else None
            row[key] = None if other is None else row["peak_rss_mb"] / other["peak_rss_mb"]
            if key == "ratio":
                row["reference"] = reference if other is not None else None
    return {
        "rounds": rounds,
        "steps": steps,
        "batch": BATCH,
        "tokens": TOKENS,
        "optimizer": OPTIMIZER,
        "device": device,
        "imports": [
            {"case": name, "peak_rss_mb": statistics.median(values), "samples_mb": values}
            for name, values in imports.items()
        ],
        "rows": rows,
    }


def _ratio_cell(variant: str, ratio: float) -> str:
    """The ratio, or, below 1 where the variant holds all its reference holds and more (every
    variant but the float16-held model's), the floor with the measurement beside: the heap's
    layout, not a result.

    Example:
        >>> _ratio_cell("torch", 1.0123), _ratio_cell("torch", 0.9971)
        ('1.012', 'at its 1.00x floor (measured 0.997: noise)')
    """
    if ratio < 1 and variant != MASTER:
        return f"at its 1.00x floor (measured {ratio:.3f}: noise)"
    return f"{ratio:.3f}"


def markdown(result: dict[str, Any], number: int) -> list[str]:
    """The report's memory section."""
    cuda = any("cuda_peak_mb" in row for row in result["rows"])
    header = ["size", "variant", "peak RSS MiB", "ratio", "to", "faults / iteration"]
    header += ["CUDA peak MiB"] if cuda else []
    body = []
    for row in result["rows"]:
        ratio = row["ratio"]
        cells = [
            row["size"],
            row["variant"],
            f"{row['peak_rss_mb']:.0f}",
            "" if ratio is None else _ratio_cell(row["variant"], ratio),
            row["reference"] or "",
            f"{row['minor_faults_per_step']:.0f}",
        ]
        cells += [f"{row.get('cuda_peak_mb', float('nan')):.0f}"] if cuda else []
        body.append(cells)
    preview = [r for r in result["rows"] if r["variant"] == PREVIEW and r["ratio_to_facade"]]
    out = [
        f"## {number}. Memory",
        "",
        f"Peak resident set (`VmHWM`) of {result['steps']} iterations, batch "
        f"{result['batch']} x {result['tokens']} tokens (at most the context), "
        f"{result['optimizer']}, each variant in a fresh process importing the same modules, "
        f"median of {result['rounds']} round(s) (`python -m benchmarks --sections memory`). "
        "Ratio: to the row named (the facade to torch's scaler, each scaler and the preview "
        "to plain float32, the master weights to the float32 facade loop).",
        "",
        *markdown_table(header, body, ["l", "l", "r", "r", "l", "r"] + (["r"] if cuda else [])),
        "",
    ]
    if preview:
        out += [
            "The cbfloat16 preview against the float32 loop with the same scaler (`facade`): "
            + ", ".join(f"{r['size']} {r['ratio_to_facade']:.3f}x" for r in preview)
            + ".",
            "",
        ]
    out += [
        "What a process holds before any model (fresh processes; every row above holds the "
        "second):",
        "",
        *markdown_table(
            ["imports", "peak RSS MiB"],
            [[row["case"], f"{row['peak_rss_mb']:.0f}"] for row in result["imports"]],
            ["l", "r"],
        ),
        "",
    ]
    return out


if __name__ == "__main__":  # the child of _child
    print(json.dumps(measure(*json.loads(sys.argv[1]))))
