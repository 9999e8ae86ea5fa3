"""Where the facade's host time goes, per iteration and per gradient tensor.

``python -m benchmarks.host_profile`` trains the host-cost model of :mod:`benchmarks.host_bench`
(``--tensors`` one-element parameters, nothing to compute) with the documented loop and reports:

1. **Call timers**: the median host time of every call of an iteration (``zero_grad`` and the
   forward pass, ``scale``, ``backward``, ``unscale_`` with ``--unscale``, ``step``, ``update``)
   for the bare loop, ``torch.amp.GradScaler`` and the facade, the loops taking turns in runs
   of :data:`~workbench.call_timers.RUN` iterations, in us per call and per tensor; these are the real costs.
2. **Stage timers inside the facade, in the loop**: the median time of each stage of the
   facade's decision and multiply (reading the gradients, the DLPack import, the jitted core
   call, the export of its result, the in-place multiply), measured by wrapping them while the
   three loops run as above; and, on alternate iterations in place of timing the
   core, a bare jitted sum of squares of the core's first gradient array (one input, one output): what
   any call into XLA costs at that point of the loop, where caches are cold after the backward
   pass (several times a tight loop's cost). Import + bare call + export is the floor of any
   design that decides in XLA; the multiply is a kernel torch's own scaler runs too.
3. **cProfile of the facade's calls** (``scale``, ``unscale_``, ``step``, ``update``; the
   forward and backward passes are not profiled): the functions with the most self time and the
   most cumulative time, and self time by package, each in us per iteration and per tensor.
   cProfile adds a few hundred ns to every Python call, so its totals exceed the timers'; read
   its shares, not its absolute numbers.

Examples::

    python -m benchmarks.host_profile --tensors 1000
    python -m benchmarks.host_profile --tensors 148 --optimizer "SGD foreach" --top 30
    python -m benchmarks.host_profile --tensors 1000 --out host_profile_output

:func:`workbench.call_timers.time_calls` times the calls (the device check's per-call timer
too).
"""

from __future__ import annotations

import argparse
import cProfile
import datetime
import json
import math
import os
import pstats
import statistics
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import jax
import torch

from benchmarks import host_bench
from workbench import whole_loop
from workbench.call_timers import PHASES, RUN, median_calls, time_calls
from workbench.jsonsafe import finite
from workbench.tables import markdown_table, number
from workbench.whole_loop import OPTIMIZERS

VARIANTS = ("bare", "torch", "facade")
"""The loops timed (names of :class:`workbench.whole_loop.TrainLoop` variants)."""

JSON_NAME = "host_profile.json"
MARKDOWN_NAME = "host_profile.md"
_REPO = Path(__file__).resolve().parent.parent


STAGES = ("read", "import", "core", "export", "multiply", "bare jit")
"""The facade's stages timed by :func:`stage_timers`, in the order they run."""


def stage_timers(
    loops: dict[str, whole_loop.TrainLoop], iters: int, warmup: int, unscale: bool = False
) -> dict[str, float]:
    """Median seconds of each of :data:`STAGES` inside the facade's calls, in the loop.

    The loops take turns in runs as in :func:`median_calls`, with the facade's internal stages
    wrapped by timers (and restored afterwards). On even iterations the core call is timed; on
    odd ones a bare jitted ``sum(x * x)`` of the core's first gradient array is
    timed just before it instead (so each is measured cold, not right after the other).
    """
    from unittest import mock

    from workbench.internals import carry as _carry
    from workbench.internals import cores as _cores
    from workbench.internals import dlpack as _dlpack
    from workbench.internals import gradients as _gradients

    samples: dict[str, list[float]] = {stage: [] for stage in STAGES}
    recording = [False]
    iteration = [0]
    bare = jax.jit(lambda x: jax.numpy.sum(x * x))

    def timed(stage: str, fn: Any) -> Any:
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            start = time.perf_counter()
            result = fn(*args, **kwargs)
            if recording[0]:
                samples[stage].append(time.perf_counter() - start)
            return result

        return wrapper

    local_core = _cores.local_core

    def core_of(*args: Any) -> Any:
        core = local_core(*args)

        def call(state: Any, arrays: Any, count: Any) -> Any:
            if iteration[0] % 2 and arrays:
                start = time.perf_counter()
                jax.block_until_ready(bare(arrays[0]))
                if recording[0]:
                    samples["bare jit"].append(time.perf_counter() - start)
                return core(state, arrays, count)
            return timed("core", core)(state, arrays, count)

        return call

    patches = [
        mock.patch.object(_gradients.Reader, "read", timed("read", _gradients.Reader.read)),
        mock.patch.object(_dlpack, "import_tensors", timed("import", _dlpack.import_tensors)),
        mock.patch.object(_carry, "exported_carry", timed("export", _carry.exported_carry)),
        mock.patch.object(_gradients, "multiply_", timed("multiply", _gradients.multiply_)),
        # the gradients the decision just read (one optimizer holding them all)
        mock.patch.object(
            _gradients, "multiply_read_", timed("multiply", _gradients.multiply_read_)
        ),
        mock.patch.object(_cores, "local_core", core_of),
    ]
    for patch in patches:
        patch.start()
    try:
        for start in range(0, warmup + iters, RUN):
            for loop in loops.values():
                time_calls(loop, unscale)  # untimed: follows the other loops' runs
                for index in range(start, min(start + RUN, warmup + iters)):
                    recording[0] = index >= warmup
                    iteration[0] = index
                    time_calls(loop, unscale)
    finally:
        for patch in patches:
            patch.stop()
    return {stage: statistics.median(v) if v else math.nan for stage, v in samples.items()}


def _where(filename: str) -> str:
    """A source path relative to ``site-packages`` or to the repository; ``""`` for built-ins."""
    if filename.startswith("~") or filename.startswith("<"):
        return ""
    path = Path(filename)
    if "site-packages" in path.parts:
        return "/".join(path.parts[path.parts.index("site-packages") + 1 :])
    try:
        return str(path.resolve().relative_to(_REPO))
    except ValueError:
        return filename


def _package(filename: str) -> str | None:
    """A Python function's package (``torch.optim`` apart from the rest of torch); ``None`` for
    built-ins, which are charged to their callers."""
    where = _where(filename)
    if not where:
        return None
    if where.startswith("/"):
        return "Python stdlib"
    parts = where.split("/")
    if parts[0] == "torch" and len(parts) > 1 and parts[1] == "optim":
        return "torch.optim (the optimizer step)"
    if parts[0] in ("jax", "jaxlib"):
        return "jax"
    if parts[0].endswith(".py") or len(parts) == 1:
        return "other"
    return parts[0]


def _by_package(raw: dict[Any, Any]) -> dict[str, float]:
    """Self seconds by package, a built-in's self time charged to its callers' packages."""
    packages: dict[str, float] = {}
    for (filename, _, _), (_, _, self_s, _, callers) in raw.items():
        package = _package(filename)
        if package is not None:
            packages[package] = packages.get(package, 0.0) + self_s
            continue
        charged = 0.0
        for caller, stats in callers.items():
            owner = _package(caller[0]) or "built-ins called by built-ins"
            packages[owner] = packages.get(owner, 0.0) + stats[2]
            charged += stats[2]
        if self_s > charged:  # called from outside the profile (the top level)
            packages["other"] = packages.get("other", 0.0) + self_s - charged
    return packages


def _rows(entries: list[dict[str, Any]], key: str, top: int) -> list[dict[str, Any]]:
    return sorted(entries, key=lambda e: e[key], reverse=True)[:top]


def profile_facade(
    loop: whole_loop.TrainLoop, iters: int, tensors: int, top: int, unscale: bool = False
) -> dict[str, Any]:
    """cProfile of the facade's calls over ``iters`` iterations of ``loop`` (a facade variant).

    Returns:
        ``total_us_per_iteration`` (as cProfile measured it), and the ``top`` functions by self
        time (``by_self``) and by cumulative time (``by_cumulative``), and self time by package
        (``by_package``; a built-in's time goes to the package that called it, and
        ``torch.optim`` is the optimizer step that torch's scaler pays too): each with
        ``us_per_iteration``, ``us_per_tensor`` and, for functions, ``calls_per_iteration``.
    """
    scaler, optimizer = loop.scaler, loop.optimizer
    assert scaler is not None
    profiler = cProfile.Profile()
    for _ in range(iters):
        loss = loop.loss()
        profiler.enable()
        scaled = scaler.scale(loss)
        profiler.disable()
        scaled.backward()
        profiler.enable()
        if unscale:
            scaler.unscale_(optimizer)
        scaler.step(optimizer)
        scaler.update()
        profiler.disable()
    raw = pstats.Stats(profiler).stats  # type: ignore[attr-defined]
    entries = []
    for (filename, line, function), (_cc, calls, self_s, cumulative_s, _) in raw.items():
        where = _where(filename)
        name = f"{where}:{line}({function})" if where else function
        entries.append(
            {
                "function": name,
                "calls_per_iteration": calls / iters,
                "self_us_per_iteration": self_s / iters * 1e6,
                "cumulative_us_per_iteration": cumulative_s / iters * 1e6,
            }
        )
    total_us = sum(e["self_us_per_iteration"] for e in entries)
    for entry in entries:
        entry["self_us_per_tensor"] = entry["self_us_per_iteration"] / tensors
        entry["cumulative_us_per_tensor"] = entry["cumulative_us_per_iteration"] / tensors
    by_package = [
        {
            "package": package,
            "self_us_per_iteration": seconds / iters * 1e6,
            "self_us_per_tensor": seconds / iters * 1e6 / tensors,
            "share": seconds / iters * 1e6 / total_us if total_us > 0 else None,
        }
        for package, seconds in sorted(_by_package(raw).items(), key=lambda kv: kv[1], reverse=True)
    ]
    return {
        "iterations": iters,
        "total_us_per_iteration": total_us,
        "total_us_per_tensor": total_us / tensors,
        "by_self": _rows(entries, "self_us_per_iteration", top),
        "by_cumulative": _rows(entries, "cumulative_us_per_iteration", top),
        "by_package": by_package,
    }


def run(
    tensors: int,
    optimizer: str,
    iters: int,
    warmup: int,
    top: int,
    unscale: bool = False,
    seed: int = 0,
) -> dict[str, Any]:
    """Times the calls of the bare, torch and facade loops and profiles the facade's calls.

    Returns:
        ``meta``, ``calls`` (``{variant: {phase: {"us", "us_per_tensor"}}}``, medians) and
        ``profile`` (see :func:`profile_facade`).
    """
    workload = host_bench.make_workload(tensors, seed)
    loops = {name: whole_loop.TrainLoop(name, optimizer, True, workload) for name in VARIANTS}
    medians = median_calls(loops, iters, warmup, unscale)
    calls = {
        name: {
            phase: {"us": seconds * 1e6, "us_per_tensor": seconds * 1e6 / tensors}
            for phase, seconds in phases.items()
        }
        for name, phases in medians.items()
    }
    stages = {
        stage: {"us": seconds * 1e6, "us_per_tensor": seconds * 1e6 / tensors}
        for stage, seconds in stage_timers(loops, iters, warmup, unscale).items()
    }
    profile = profile_facade(loops["facade"], iters, tensors, top, unscale)
    meta = {
        "date": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
        "tensors": tensors,
        "optimizer": optimizer,
        "unscale": unscale,
        "iterations": iters,
        "warmup": warmup,
        "torch": torch.__version__,
        "jax": jax.__version__,
        "cpu_count": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
    }
    return {"meta": meta, "calls": calls, "stages": stages, "profile": profile}


def markdown(result: dict[str, Any]) -> str:
    """The report of :func:`run` as markdown tables."""
    meta, calls, profile = result["meta"], result["calls"], result["profile"]
    n = meta["tensors"]
    phases = [p for p in (*PHASES, "scaler") if any(p in c for c in calls.values())]
    out = [
        f"# Host profile: {n:,} one-element gradients, {meta['optimizer']}"
        + (", explicit unscale_" if meta["unscale"] else ""),
        "",
        f"{meta['date']}; torch {meta['torch']} ({meta['torch_threads']} threads), jax "
        f"{meta['jax']}, {meta['cpu_count']} CPUs; {meta['iterations']} iterations per loop "
        f"after {meta['warmup']} of warm-up, the loops taking turns in runs of {RUN}.",
        "",
        "## Call timers (median us per call; us per tensor in brackets)",
        "",
        "`loss` = `zero_grad()` + forward; `scaler` = the sum of the scaler calls' medians.",
        "",
    ]
    out += markdown_table(
        ["call", *VARIANTS, "facade - torch"],
        [
            [
                phase,
                *(
                    f"{number(calls[v][phase]['us'])} [{number(calls[v][phase]['us_per_tensor'])}]"
                    if phase in calls[v]
                    else ""
                    for v in VARIANTS
                ),
                number(calls["facade"][phase]["us"] - calls["torch"][phase]["us"])
                if phase in calls["facade"] and phase in calls["torch"]
                else "",
            ]
            for phase in phases
        ],
        ["l", "r", "r", "r", "r"],
    )
    stages = result["stages"]
    # No import stage at all when every gradient is read through kept packs (imported once).
    floor = sum(
        stages[k]["us"] for k in ("import", "bare jit", "export") if math.isfinite(stages[k]["us"])
    )
    torch_overhead = calls["torch"]["scaler"]["us"] - calls["bare"]["step"]["us"]
    out += [
        "",
        "## Stage timers inside the facade, in the loop (median us per call)",
        "",
        "Timed in a second pass, the loops again taking turns in runs. `bare jit`: a jitted "
        "`sum(x * x)` of the core's first gradient array (one input, one output) at the core's "
        "place, on alternate iterations: any call into XLA at that point of the loop. `import`: "
        "n/a when every gradient is small, read through buffers imported once. The floor of a "
        "design that decides in XLA (import + bare jit + export): "
        f"{number(floor)} us, against torch's whole scaler overhead "
        f"of {number(torch_overhead)} us (its scaler calls minus the bare optimizer step, from the "
        "call timers).",
        "",
    ]
    out += markdown_table(
        ["stage", "us", "us / tensor"],
        [
            [stage, number(stages[stage]["us"]), number(stages[stage]["us_per_tensor"])]
            for stage in STAGES
        ],
        ["l", "r", "r"],
    )
    out += [
        "",
        f"## cProfile of the facade's calls ({profile['iterations']} iterations)",
        "",
        f"Profiled total {number(profile['total_us_per_iteration'])} us per iteration "
        f"({number(profile['total_us_per_tensor'])} per tensor), cProfile's overhead included.",
        "",
        "Self time by package (built-ins charged to their callers; `torch.optim` is the "
        "optimizer step itself, which torch's scaler pays too):",
        "",
    ]
    out += markdown_table(
        ["package", "us / iteration", "us / tensor", "share"],
        [
            [
                p["package"],
                number(p["self_us_per_iteration"]),
                number(p["self_us_per_tensor"]),
                f"{p['share']:.0%}" if p["share"] is not None else "n/a",
            ]
            for p in profile["by_package"]
        ],
        ["l", "r", "r", "r"],
    )
    for key, title in (("by_self", "self"), ("by_cumulative", "cumulative")):
        out += ["", f"Top functions by {title} time:", ""]
        out += markdown_table(
            ["function", "calls / iteration", f"{title} us / iteration", f"{title} us / tensor"],
            [
                [
                    f"`{e['function']}`",
                    number(e["calls_per_iteration"]),
                    number(e[f"{title}_us_per_iteration"]),
                    number(e[f"{title}_us_per_tensor"]),
                ]
                for e in profile[key]
            ],
            ["l", "r", "r", "r"],
        )
    return "\n".join(out) + "\n"


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of ``python -m benchmarks.host_profile``."""
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.host_profile",
        description="Break the facade's host time per iteration down by call and by function, "
        "on one-element gradients (nothing to compute).",
    )
    parser.add_argument("--tensors", type=int, default=1000, help="gradient tensors (default 1000)")
    parser.add_argument(
        "--optimizer",
        choices=tuple(OPTIMIZERS),
        default="AdamW fused",
        help="the optimizer (default 'AdamW fused')",
    )
    parser.add_argument("--iters", type=int, default=200, help="iterations per loop (default 200)")
    parser.add_argument("--warmup", type=int, default=5, help="untimed iterations (default 5)")
    parser.add_argument("--top", type=int, default=25, help="functions listed (default 25)")
    parser.add_argument(
        "--unscale", action="store_true", help="call unscale_(optimizer) before step"
    )
    parser.add_argument("--seed", type=int, default=0, help="seeds the parameter values")
    parser.add_argument(
        "--out", type=Path, default=None, help=f"also write {MARKDOWN_NAME} and {JSON_NAME} here"
    )
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Runs the profile and prints the markdown report (and writes it with ``--out``).

    Returns:
        The exit status (0).
    """
    args = build_parser().parse_args(argv)
    if args.tensors < 1 or args.iters < 1 or args.warmup < 0 or args.top < 1:
        raise SystemExit("--tensors, --iters and --top must be positive, --warmup non-negative")
    result = run(args.tensors, args.optimizer, args.iters, args.warmup, args.top, args.unscale)
    text = markdown(result)
    print(text, end="")
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / MARKDOWN_NAME).write_text(text)
        (args.out / JSON_NAME).write_text(json.dumps(finite(result), indent=1) + "\n")
        print(f"\nWrote {args.out / MARKDOWN_NAME} and {args.out / JSON_NAME}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
