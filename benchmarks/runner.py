"""Runs every section for the requested sizes and collects the raw numbers and derived rows."""

from __future__ import annotations

import dataclasses
import datetime
import gc
import math
import os
import platform
import sys
import time
from collections.abc import Sequence
from typing import Any

import jax
import optax
import torch
from tqdm import tqdm

from benchmarks import bandwidth, jax_bench, torch_bench
from benchmarks.sizes import SIZES, make_gradients
from benchmarks.timing import (
    CompileCounter,
    CpuShare,
    FirstStep,
    Plan,
    Stats,
    Timing,
    difference,
    per_round,
    ratio,
)

MS = 1e3
DEFAULT_ROUNDS = 5


@dataclasses.dataclass(frozen=True)
class BenchOptions:
    """What to run.

    Attributes:
        sizes: size names (keys of :data:`benchmarks.sizes.SIZES`), in order.
        rounds: timed rounds per group.
        iters: timed steps per variant and round, exactly; ``None``: each size's own count, fewer
            when steps are slow (see :func:`benchmarks.timing.choose_iters`).
        warmup: untimed steps per variant after its first step.
        seed: seed of the gradients.
        progress: show a progress bar.
    """

    sizes: tuple[str, ...]
    rounds: int = DEFAULT_ROUNDS
    iters: int | None = None
    warmup: int = torch_bench.WARMUP_STEPS
    seed: int = 0
    progress: bool = True


# Minimal traffic per parameter for the scaler's own work, by (optimizer, clip).
FLOOR_MODELS: dict[tuple[str, bool], tuple[int, str]] = {
    ("SGD foreach", False): (8, "unscale+check in one read+write pass"),
    ("SGD foreach", True): (12, "read for the norm, then one read+write pass for unscale+clip"),
    ("SGD fused", False): (4, "one read-only pass; the scale goes to the fused optimizer"),
    ("SGD fused", True): (4, "one read-only pass; scale and clip go to the fused optimizer"),
    ("AdamW fused", False): (4, "one read-only pass; the scale goes to the fused optimizer"),
    ("AdamW fused", True): (4, "one read-only pass; scale and clip go to the fused optimizer"),
}
"""Bytes per float32 parameter that the scaler's overhead must at least move, and why."""


def _case(
    section: str,
    size: str,
    group: str,
    variant: str,
    timing: Timing,
    first: FirstStep | None,
) -> dict[str, Any]:
    return {
        "section": section,
        "size": size,
        "group": group,
        "variant": variant,
        "unit": "s",
        "iters": timing.iters,
        "rounds": timing.rounds,
        "samples": timing.samples,
        "stats": timing.stats.as_dict(),
        "compiles_after_warmup": timing.compiles,
        "first_step": None if first is None else dataclasses.asdict(first),
    }


def _ms(values: Sequence[float]) -> list[float]:
    return [v * MS for v in values]


def _stats(values: Sequence[float]) -> dict[str, float]:
    return Stats.of(values).as_dict()


def _torch_rows(size: str, group: torch_bench.TorchGroup) -> list[dict[str, Any]]:
    t = {name: timing.rounds for name, timing in group.timings.items()}
    rows = []
    for clip in (False, True):
        suffix = "+clip" if clip else ""
        torch_r, facade_r, bare_r = t["torch" + suffix], t["facade" + suffix], t["bare"]
        torch_over = per_round(difference, torch_r, bare_r)
        facade_over = per_round(difference, facade_r, bare_r)
        rows.append(
            {
                "size": size,
                "optimizer": group.optimizer,
                "clip": clip,
                "bare_ms": _stats(_ms(bare_r)),
                "torch_ms": _stats(_ms(torch_r)),
                "facade_ms": _stats(_ms(facade_r)),
                "step_ratio": _stats(per_round(ratio, facade_r, torch_r)),
                "torch_overhead_ms": _stats(_ms(torch_over)),
                "facade_overhead_ms": _stats(_ms(facade_over)),
                "overhead_ratio": _stats(per_round(ratio, facade_over, torch_over)),
            }
        )
    return rows


def _jax_row(size: str, group: jax_bench.JaxGroup) -> dict[str, Any]:
    plain, dls, gcc, fused = (group.timings[name].rounds for name in jax_bench.VARIANTS)
    return {
        "size": size,
        "adamw_ms": _stats(_ms(plain)),
        "dls_ms": _stats(_ms(dls)),
        "dls_gcc_ms": _stats(_ms(gcc)),
        "dls_fused_ms": _stats(_ms(fused)),
        "dls_ratio": _stats(per_round(ratio, dls, plain)),
        "dls_gcc_ratio": _stats(per_round(ratio, gcc, plain)),
        "dls_fused_ratio": _stats(per_round(ratio, fused, plain)),
    }


def _bandwidth_row(size: str, group: bandwidth.BandwidthGroup) -> dict[str, Any]:
    return {
        "size": size,
        "params": group.numel,
        "inplace_gbps": _stats([r / 1e9 for r in group.rates(bandwidth.INPLACE)]),
        "read_gbps": _stats([r / 1e9 for r in group.rates(bandwidth.READ)]),
    }


def _floor_rows(bw_row: dict[str, Any], torch_rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    rate = bw_row["inplace_gbps"]["median"] * 1e9
    rows = []
    for row in torch_rows:
        per_param, model = FLOOR_MODELS[(row["optimizer"], row["clip"])]
        floor_ms = per_param * bw_row["params"] / rate * MS if rate > 0 else math.nan
        torch_over = row["torch_overhead_ms"]["median"]
        facade_over = row["facade_overhead_ms"]["median"]
        rows.append(
            {
                "size": row["size"],
                "optimizer": row["optimizer"],
                "clip": row["clip"],
                "bytes_per_param": per_param,
                "model": model,
                "floor_ms": floor_ms,
                "torch_overhead_ms": torch_over,
                "facade_overhead_ms": facade_over,
                "torch_fraction": ratio(floor_ms, torch_over),
                "facade_fraction": ratio(floor_ms, facade_over),
            }
        )
    return rows


def _compile_rows(
    size: str, section: str, group: str, first: dict[str, FirstStep], timings: dict[str, Timing]
) -> list[dict[str, Any]]:
    return [
        {
            "size": size,
            "section": section,
            "case": f"{variant}, {group}" if group else variant,
            "first_step_s": step.seconds,
            "first_step_compiles": step.compiles,
            "first_step_compile_s": step.compile_seconds,
            "compiles_after_warmup": timings[variant].compiles,
        }
        for variant, step in first.items()
    ]


def _load() -> list[float] | None:
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except OSError:  # not available on this platform
        return None


THREAD_SETTINGS = ("OMP_NUM_THREADS", "OMP_WAIT_POLICY", "GOMP_SPINCOUNT", "XLA_FLAGS")
"""Environment variables that change the thread pools' behaviour; the report lists those set."""


def _meta(options: BenchOptions, argv: Sequence[str] | None) -> dict[str, Any]:
    return {
        "date": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
        "command": " ".join(["python -m benchmarks", *(argv or [])]),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "jax": jax.__version__,
        "optax": optax.__version__,
        "platform": platform.platform(),
        "cpu_count": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "torch_interop_threads": torch.get_num_interop_threads(),
        "jax_devices": [str(d) for d in jax.devices()],
        "env": {k: os.environ[k] for k in THREAD_SETTINGS if k in os.environ},
        "load_average_start": _load(),
        "rounds": options.rounds,
        "warmup_steps": options.warmup,
        "loss_scale": torch_bench.LOSS_SCALE,
        "learning_rate": torch_bench.LEARNING_RATE,
        "clip_norm": torch_bench.BIG_NORM,
        "time_unit": "seconds in cases; milliseconds in *_ms rows",
    }


def run(options: BenchOptions, argv: Sequence[str] | None = None) -> dict[str, Any]:
    """Runs every section for every size in ``options`` and returns the results.

    The returned dict holds ``meta``, ``sizes``, ``cases`` (every variant's raw rounds and
    samples in seconds, its statistics, first step and compilations after warm-up), and the
    derived rows ``torch``, ``jax``, ``bandwidth``, ``floor`` and ``compile`` that the tables show.

    Args:
        options: what to run.
        argv: the command-line arguments, recorded in ``meta.command``.

    Raises:
        ValueError: an unknown size name or a non-positive round count.
    """
    unknown = [s for s in options.sizes if s not in SIZES]
    if unknown or not options.sizes:
        raise ValueError(f"unknown sizes {unknown}; choose from {sorted(SIZES)}")
    if options.rounds < 1 or (options.iters is not None and options.iters < 1):
        raise ValueError("rounds and iters must be positive")
    started = time.perf_counter()
    results: dict[str, Any] = {
        "meta": _meta(options, argv),
        "sizes": {},
        "cases": [],
        "torch": [],
        "jax": [],
        "bandwidth": [],
        "floor": [],
        "compile": [],
    }
    groups_per_size = 2 + len(torch_bench.OPTIMIZERS)  # bandwidth, optimizers, jax
    total = len(options.sizes) * (1 + groups_per_size * (options.rounds + 1))
    counter = CompileCounter()
    whole_run = CpuShare()
    bar = tqdm(total=total, disable=not options.progress, unit="round", file=sys.stderr)
    with counter.listening(), bar:

        def tick() -> None:
            bar.update(1)

        for size in options.sizes:
            spec = SIZES[size]
            plan = Plan(
                rounds=options.rounds,
                max_iters=options.iters or spec.iters,
                fixed_iters=options.iters is not None,
                warmup=options.warmup,
            )
            size_share = CpuShare()
            bar.set_description(f"{size}: gradients")
            grad_start = time.perf_counter()
            grads = make_gradients(spec, options.seed)
            results["sizes"][size] = {
                "tensors": grads.tensors,
                "params": grads.numel,
                "max_iters": plan.max_iters,
                "loss": grads.loss,
                "flushed_small_grads": grads.flushed,
                "gradient_seconds": time.perf_counter() - grad_start,
            }
            tick()

            bar.set_description(f"{size}: bandwidth")
            bw = bandwidth.run_group(grads.numel, plan, counter, tick)
            tick()
            for name, timing in bw.timings.items():
                results["cases"].append(_case("bandwidth", size, "stream", name, timing, None))
            bw_row = _bandwidth_row(size, bw)
            results["bandwidth"].append(bw_row)
            del bw
            gc.collect()

            size_torch_rows = []
            for optimizer in torch_bench.OPTIMIZERS:
                bar.set_description(f"{size}: torch {optimizer}")
                group = torch_bench.run_group(grads, optimizer, plan, counter, tick)
                tick()
                for name, timing in group.timings.items():
                    results["cases"].append(
                        _case("torch", size, optimizer, name, timing, group.first[name])
                    )
                size_torch_rows += _torch_rows(size, group)
                results["compile"] += _compile_rows(
                    size,
                    "torch",
                    optimizer,
                    {k: v for k, v in group.first.items() if k.startswith("facade")},
                    group.timings,
                )
                del group
                gc.collect()
            results["torch"] += size_torch_rows
            results["floor"] += _floor_rows(bw_row, size_torch_rows)

            bar.set_description(f"{size}: jax optax")
            jgroup = jax_bench.run_group(grads, plan, counter, tick)
            tick()
            for name, timing in jgroup.timings.items():
                results["cases"].append(
                    _case("jax", size, "optax", name, timing, jgroup.first[name])
                )
            results["jax"].append(_jax_row(size, jgroup))
            results["compile"] += _compile_rows(size, "jax", "", jgroup.first, jgroup.timings)
            results["sizes"][size]["other_cpu_cores"] = size_share.other_cores()
            del jgroup, grads
            gc.collect()
    results["meta"]["compiles_after_warmup_total"] = sum(
        case["compiles_after_warmup"] for case in results["cases"]
    )
    results["meta"]["wall_seconds"] = time.perf_counter() - started
    results["meta"]["load_average_end"] = _load()
    results["meta"]["other_cpu_cores"] = whole_run.other_cores()
    return results
