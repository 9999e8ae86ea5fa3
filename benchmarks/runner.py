"""Runs the selected sections for the requested sizes and collects raw numbers and derived rows."""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import gc
import math
import os
import platform
import resource
import sys
import time
from collections.abc import Iterator, Sequence
from typing import Any

import jax
import optax
import torch
from tqdm import tqdm

from benchmarks import (
    bandwidth,
    cbfloat16_bench,
    ddp_bench,
    host_bench,
    jax_bench,
    memory_bench,
    scaler_checks,
    startup_bench,
    step_bench,
    torch_bench,
)
from workbench import whole_loop
from workbench.sizes import (
    SIZES,
    GradientSet,
    SizeSpec,
    make_gradients,
    next_token_loss,
    parameter_count,
    shape_list,
)
from workbench.timing import (
    MS,
    CompileCounter,
    CpuShare,
    FirstStep,
    Plan,
    Timing,
    difference,
    milliseconds,
    per_round,
    ratio,
    stats_dict,
)
from workbench.whole_loop import scaler_pair, spike_skip_row, whole_rows

FULL_ROUNDS = 5
"""Timed rounds per group of ``python -m benchmarks --full``."""
QUICK_ROUNDS = 3
"""Timed rounds per group of ``python -m benchmarks`` (``make bench``)."""
DEFAULT_ROUNDS = FULL_ROUNDS

HOST_ITERS = 100
"""Timed iterations per variant and round in the ``host`` section (fewer when steps are slow)."""

WHOLE_RUN = 5
"""The whole-iteration and JAX train-step sections' variants take turns in runs of this many
timed iterations (each run after one untimed iteration) where a round holds at least two runs
(:meth:`_Run.whole_plan`): the machine's
speed drifts over a round, and each timed iteration then still follows one of its own loop's
(see :class:`workbench.timing.Plan`)."""

HOST_RUN = 10
"""The ``host`` section's loops take turns in runs of this many timed iterations (each run after
one untimed iteration), so that each timed iteration follows one of its own loop's, as in
training (see :class:`workbench.timing.Plan`)."""

SECTIONS = ("whole", "scaler", "ddp", "step", "jax", "host", "startup", "cbfloat16", "memory")
"""The sections, in report order: whole iterations of the documented loop; the scaler alone on
gradients refilled in place (with the bandwidth floor); whole iterations under DDP (2 ranks);
the JAX train step as users write it, with the floor and the other JAX scalers; the jitted optax
step on gradients passed in as inputs (a narrower second view); the host cost per gradient
tensor (one-element gradients); start-up; the cbfloat16 preview; peak memory, a fresh process
per variant."""

QUICK_STARTUP_ROUNDS = 2
"""At most this many rounds of fresh processes in the quick run's start-up section (six
processes a round, each paying the imports; ``--full``: ``--rounds``). Start-up has no ratio
with a floor, and its rows differ by seconds, not by a few percent."""

QUICK_SET_TO_NONE = (True,)
"""The quick run's whole-iteration groups: torch's default ``zero_grad()`` only, the loop users
run (``--full`` adds ``set_to_none=False``, whose picture the documented runs show is the same)."""

QUICK_STEP_LOSSES = step_bench.LOSSES[:2]
"""The quick run's JAX train-step groups: the real forward and the synthetic loss (``--full``
adds the accumulated step, six more compilations of a ``lax.scan`` over micro-batches)."""

QUICK_CBFLOAT16_ITERS = 4
"""Alternating iterations per round of the quick run's cbfloat16 section (``--full``:
:data:`benchmarks.cbfloat16_bench.ITERS`), and as many in blocks."""

MEMORY_ROUNDS = {False: 1, True: 3}
"""Fresh processes per variant and size of the memory section: the quick run (its four main
variants, 3 iterations each), the full run (every variant, 10 iterations; a peak varies by tens
of MiB from process to process with the heap's layout, not with the machine's load)."""

PER_SIZE_SECTIONS = ("whole", "scaler", "jax")
"""The sections run once per size of ``--sizes``."""


@dataclasses.dataclass(frozen=True)
class BenchOptions:
    """What to run.

    Attributes:
        sizes: size names (keys of :data:`workbench.sizes.SIZES`), in order.
        rounds: timed rounds per group.
        iters: timed steps per variant and round, exactly; ``None``: each size's own count, fewer
            when steps are slow (see :func:`workbench.timing.choose_iters`).
        warmup: untimed steps per variant after its first step.
        seed: seed of the models, tokens and gradients.
        progress: show a progress bar.
        sections: which of :data:`SECTIONS` to run (the sizes apply to all but ``ddp`` and
            ``host``).
        ddp_size: the model size of the DDP section.
        step_size: the layout of the ``step`` section's parameters.
        host_tensors: the gradient tensor counts of the ``host`` section.
        full: the documented run: also the cbfloat16 section's float16 autocast rows (on a
            CPU without float16 arithmetic, seconds per iteration); ``False``, the quick run:
            the cuts of :data:`QUICK_STARTUP_ROUNDS`, :data:`QUICK_SET_TO_NONE`,
            :data:`QUICK_STEP_LOSSES`, :data:`QUICK_CBFLOAT16_ITERS`, :data:`MEMORY_ROUNDS`, and
            the cbfloat16 section's models at
            :data:`benchmarks.cbfloat16_bench.QUICK_MODEL` and
            :data:`benchmarks.cbfloat16_bench.QUICK_JAX_MODEL`.
    """

    sizes: tuple[str, ...]
    rounds: int = DEFAULT_ROUNDS
    iters: int | None = None
    warmup: int = torch_bench.WARMUP_STEPS
    seed: int = 0
    progress: bool = True
    sections: tuple[str, ...] = SECTIONS
    ddp_size: str = "S"
    step_size: str = "M"
    host_tensors: tuple[int, ...] = host_bench.TENSORS
    full: bool = True


def _set_to_none(options: BenchOptions) -> tuple[bool, ...]:
    return whole_loop.SET_TO_NONE if options.full else QUICK_SET_TO_NONE


def _startup_rounds(options: BenchOptions) -> int:
    return options.rounds if options.full else min(options.rounds, QUICK_STARTUP_ROUNDS)


def _step_losses(options: BenchOptions) -> tuple[str, ...]:
    return step_bench.LOSSES if options.full else QUICK_STEP_LOSSES


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


def whole_variants(spec: SizeSpec, optimizer: str, set_to_none: bool) -> tuple[str, ...]:
    """The variants of one whole-iteration group: :data:`whole_loop.WHOLE_VARIANTS`, and the
    facade with ``spike_skip`` in :data:`whole_loop.SPIKE_SKIP_GROUP` of a sized model (one
    group per size: ``tiny``'s one-element tensors would time the host alone)."""
    if spec.tiny or (optimizer, set_to_none) != whole_loop.SPIKE_SKIP_GROUP:
        return whole_loop.WHOLE_VARIANTS
    return (*whole_loop.WHOLE_VARIANTS, whole_loop.SPIKE_SKIP)


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


def _torch_rows(size: str, group: torch_bench.TorchGroup) -> list[dict[str, Any]]:
    return [
        {"size": size, "optimizer": group.optimizer, **scaler_pair(group.timings, clip)}
        for clip in (False, True)
    ]


def host_row(tensors: int, group: whole_loop.WholeGroup) -> dict[str, Any]:
    """A host-cost row: the scaler pair without clipping (whole iterations), and the headline:
    each scaler's calls timed in place inside those iterations, minus the bare loop's
    ``optimizer.step()``, their ratio, and each per tensor in us."""
    pair = scaler_pair(group.timings, clip=False)
    bare_calls = group.timings["bare"].part_rounds
    calls = {}
    over = {}
    for name in ("torch", "facade"):
        over[name] = per_round(difference, group.timings[name].part_rounds, bare_calls)
        calls[f"{name}_calls_overhead_ms"] = stats_dict(milliseconds(over[name]))
        calls[f"{name}_us_per_tensor"] = stats_dict([v * 1e6 / tensors for v in over[name]])
    return {
        "tensors": tensors,
        "optimizer": group.optimizer,
        **pair,
        **calls,
        "calls_overhead_ratio": stats_dict(per_round(ratio, over["facade"], over["torch"])),
        "torch_skipped_steps": group.skipped_steps["torch"],
        "facade_skipped_steps": group.skipped_steps["facade"],
    }


def step_rows(group: step_bench.StepGroup) -> list[dict[str, Any]]:
    """One row per variant of a whole-step group: ms, and per-round ratios to plain optax, to
    the floor and to the gated floor (``nan`` where that variant was not timed)."""
    plain = group.timings[step_bench.PLAIN].rounds

    def ratios(rounds: list[float], name: str) -> dict[str, float]:
        if name not in group.timings:
            return stats_dict([math.nan])
        return stats_dict(per_round(ratio, rounds, group.timings[name].rounds))

    rows = []
    for name, timing in group.timings.items():
        usage = step_bench.USAGE[name]
        rows.append(
            {
                "loss": group.loss,
                "variant": name,
                "ms": stats_dict(milliseconds(timing.rounds)),
                "ratio_plain": stats_dict(per_round(ratio, timing.rounds, plain)),
                "ratio_floor": ratios(timing.rounds, step_bench.FLOOR),
                "ratio_gated_floor": ratios(timing.rounds, step_bench.GATED_FLOOR),
                "traces": group.traces[name],
                "skip": usage.skip,
                "counts_skips": usage.counts_skips,
            }
        )
    return rows


def _jax_row(size: str, group: jax_bench.JaxGroup) -> dict[str, Any]:
    plain, dls, gcc, fused, floor = (group.timings[name].rounds for name in jax_bench.VARIANTS)
    return {
        "size": size,
        "adamw_ms": stats_dict(milliseconds(plain)),
        "dls_ms": stats_dict(milliseconds(dls)),
        "dls_gcc_ms": stats_dict(milliseconds(gcc)),
        "dls_fused_ms": stats_dict(milliseconds(fused)),
        "floor_ms": stats_dict(milliseconds(floor)),
        "dls_ratio": stats_dict(per_round(ratio, dls, plain)),
        "dls_gcc_ratio": stats_dict(per_round(ratio, gcc, plain)),
        "dls_fused_ratio": stats_dict(per_round(ratio, fused, plain)),
        "floor_ratio": stats_dict(per_round(ratio, floor, plain)),
        "dls_over_floor": stats_dict(per_round(ratio, dls, floor)),
        "dls_fused_over_floor": stats_dict(per_round(ratio, fused, floor)),
    }


def _bandwidth_row(size: str, group: bandwidth.BandwidthGroup) -> dict[str, Any]:
    return {
        "size": size,
        "params": group.numel,
        "inplace_gbps": stats_dict([r / 1e9 for r in group.rates(bandwidth.INPLACE)]),
        "read_gbps": stats_dict([r / 1e9 for r in group.rates(bandwidth.READ)]),
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


def _facades(first: dict[str, FirstStep]) -> dict[str, FirstStep]:
    """The facade variants' first steps (their compilations are the ones to watch)."""
    return {name: step for name, step in first.items() if name.startswith("facade")}


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


def _cpuinfo(key: str) -> str | None:
    """The first non-empty value of ``key`` in ``/proc/cpuinfo``, or ``None`` (no such line, or no
    ``/proc`` on this platform)."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as info:
            for line in info:
                name, _, value = line.partition(":")
                if name.strip() == key and value.strip():
                    return value.strip()
    except OSError:
        pass
    return None


def cpu_model() -> str:
    """The CPU's model name (``/proc/cpuinfo``'s first ``model name``; else the platform's word).

    Example:
        >>> isinstance(cpu_model(), str)
        True
    """
    return _cpuinfo("model name") or platform.processor() or platform.machine() or "unknown"


CPU_FEATURES = {
    "AMX": ("amx_tile",),
    "AVX-512 FP16": ("avx512_fp16",),
    "AVX-512 BF16": ("avx512_bf16",),
    "AVX-512": ("avx512f",),
}
"""The CPU features that decide half-precision speed on the CPU, by their ``/proc/cpuinfo``
flags: float16 matrix units (AMX, AVX-512 FP16) or none."""


def cpu_features() -> dict[str, bool] | None:
    """Which of :data:`CPU_FEATURES` the CPU has (``/proc/cpuinfo``'s first ``flags``), or
    ``None`` where it cannot be read.

    Example:
        >>> features = cpu_features()
        >>> features is None or set(features) == set(CPU_FEATURES)
        True
    """
    flags = _cpuinfo("flags")
    if flags is None:
        return None
    present = set(flags.split())
    return {name: any(f in present for f in names) for name, names in CPU_FEATURES.items()}


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
        "cpu_model": cpu_model(),
        "cpu_features": cpu_features(),
        "full": options.full,
        "torch_threads": torch.get_num_threads(),
        "torch_interop_threads": torch.get_num_interop_threads(),
        "jax_devices": [str(d) for d in jax.devices()],
        "env": {k: os.environ[k] for k in THREAD_SETTINGS if k in os.environ},
        "load_average_start": _load(),
        "rounds": options.rounds,
        "warmup_steps": options.warmup,
        "sections": list(options.sections),
        "loss_scale": whole_loop.LOSS_SCALE,
        "learning_rate": whole_loop.LEARNING_RATE,
        "clip_norm": torch_bench.BIG_NORM,
        "whole_clip_norm": whole_loop.CLIP_NORM,
        "whole_batch": whole_loop.BATCH,
        "host_tensors": list(options.host_tensors),
        "host_run": HOST_RUN,
        "whole_run": WHOLE_RUN,
        "step_size": options.step_size,
        "section_seconds": {},
        "time_unit": "seconds in cases; milliseconds in *_ms rows",
    }


def _validate(options: BenchOptions) -> None:
    unknown = [s for s in options.sizes if s not in SIZES]
    if unknown or not options.sizes:
        raise ValueError(f"unknown sizes {unknown}; choose from {sorted(SIZES)}")
    sections = [s for s in options.sections if s not in SECTIONS]
    if sections or not options.sections:
        raise ValueError(f"unknown sections {sections}; choose from {list(SECTIONS)}")
    if options.ddp_size not in SIZES:
        raise ValueError(f"unknown DDP size {options.ddp_size!r}; choose from {sorted(SIZES)}")
    if options.step_size not in SIZES or SIZES[options.step_size].tiny:
        raise ValueError(
            f"unknown step size {options.step_size!r}; choose from "
            f"{sorted(name for name, spec in SIZES.items() if not spec.tiny)}"
        )
    if options.rounds < 1 or (options.iters is not None and options.iters < 1):
        raise ValueError("rounds and iters must be positive")
    if "host" in options.sections and (not options.host_tensors or min(options.host_tensors) < 1):
        raise ValueError(f"host tensor counts must be positive; got {options.host_tensors}")


def _ticks(options: BenchOptions) -> int:
    """Progress-bar steps: one per timed round and one per group, gradients and DDP."""
    group = options.rounds + 1
    per_size = 0
    if "whole" in options.sections:
        per_size += len(whole_loop.OPTIMIZERS) * len(_set_to_none(options)) * group
    if "scaler" in options.sections:
        per_size += (1 + len(whole_loop.OPTIMIZERS)) * group  # bandwidth, optimizers
    if "jax" in options.sections:
        per_size += group
    if "scaler" in options.sections or "jax" in options.sections:
        per_size += 1  # gradients
    host = len(options.host_tensors) * len(host_bench.OPTIMIZERS) * group
    step = len(_step_losses(options)) * group + 1  # the timed groups, then the checks
    return (
        len(options.sizes) * per_size
        + ("ddp" in options.sections)
        + ("step" in options.sections) * step
        + ("host" in options.sections) * host
        + ("startup" in options.sections) * _startup_rounds(options)
        + ("cbfloat16" in options.sections) * options.rounds
        + ("memory" in options.sections) * MEMORY_ROUNDS[options.full]
    )


class _Run:
    """One run in progress: the options, the compile counter, the progress bar and the results."""

    def __init__(
        self, options: BenchOptions, meta: dict[str, Any], counter: CompileCounter, bar: tqdm
    ) -> None:
        self.options = options
        self.counter = counter
        self.bar = bar
        self.results: dict[str, Any] = {
            "meta": meta,
            "sizes": {},
            "cases": [],
            "whole": [],
            "spike_skip": [],
            "torch": [],
            "ddp": None,
            "step": None,
            "jax": [],
            "bandwidth": [],
            "floor": [],
            "host": [],
            "compile": [],
            "startup": None,
            "cbfloat16": None,
            "memory": None,
        }

    def tick(self) -> None:
        """Advances the progress bar by one step."""
        self.bar.update(1)

    def clocked(self, section: str) -> contextlib.AbstractContextManager[None]:
        """Adds the block's wall and CPU seconds to ``meta.section_seconds[section]``."""
        return _clocked(self.results["meta"]["section_seconds"], section)

    def plan(self, spec: SizeSpec) -> Plan:
        """Rounds, steps per round and warm-up for ``spec``."""
        return Plan(
            rounds=self.options.rounds,
            max_iters=self.options.iters or spec.iters,
            fixed_iters=self.options.iters is not None,
            warmup=self.options.warmup,
        )

    def whole_plan(self, spec: SizeSpec) -> Plan:
        """:meth:`plan`, with the variants taking turns in runs of :data:`WHOLE_RUN` iterations
        where a round has room for two runs (S and tiny; M's few long iterations stay variant
        by variant). The whole-iteration and JAX train-step sections use it: at S their steps
        take milliseconds, and a round variant by variant (seconds) lets the machine's drift
        put one variant's median below the floor another variant sets."""
        plan = self.plan(spec)
        if plan.max_iters < 2 * WHOLE_RUN:
            return plan
        return dataclasses.replace(plan, run=WHOLE_RUN)

    def add_cases(
        self,
        section: str,
        size: str,
        group: str,
        timings: dict[str, Timing],
        first: dict[str, FirstStep] | None,
    ) -> None:
        """Records every variant of a group in ``cases``."""
        for name, timing in timings.items():
            step = None if first is None else first[name]
            self.results["cases"].append(_case(section, size, group, name, timing, step))

    def size(self, size: str) -> None:
        """Runs the selected per-size sections for ``size``."""
        spec = SIZES[size]
        share = CpuShare()
        info: dict[str, Any] = {
            "tensors": len(shape_list(spec)),
            "params": parameter_count(spec),
            "max_iters": self.plan(spec).max_iters,
            "whole": None,
            "gradients": None,
        }
        self.results["sizes"][size] = info
        sections = self.options.sections
        if "whole" in sections:
            with self.clocked("whole"):
                info["whole"] = self.whole(size, spec)
        if "scaler" in sections or "jax" in sections:
            self.bar.set_description(f"{size}: gradients")
            grad_start = time.perf_counter()
            grads = make_gradients(spec, self.options.seed)
            info["gradients"] = {
                "loss": grads.loss,
                "flushed_small_grads": grads.flushed,
                "seconds": time.perf_counter() - grad_start,
            }
            self.tick()
            if "scaler" in sections:
                with self.clocked("scaler"):
                    self.scaler_only(size, spec, grads)
            if "jax" in sections:
                with self.clocked("jax"):
                    self.jax(size, spec, grads)
            del grads
            gc.collect()
        info["other_cpu_cores"] = share.other_cores()

    def whole(self, size: str, spec: SizeSpec) -> dict[str, Any]:
        """Whole iterations of the documented loop, every optimizer and ``zero_grad`` setting."""
        workload = whole_loop.make_workload(spec, self.options.seed)
        with torch.no_grad():
            loss = float(next_token_loss(workload.model, workload.tokens))
        subnormals = whole_loop.count_subnormals(workload)
        for optimizer in whole_loop.OPTIMIZERS:
            for set_to_none in _set_to_none(self.options):
                self.bar.set_description(f"{size}: whole {optimizer}, set_to_none={set_to_none}")
                group = whole_loop.run_group(
                    workload,
                    optimizer,
                    set_to_none,
                    self.whole_plan(spec),
                    self.counter,
                    self.tick,
                    variants=whole_variants(spec, optimizer, set_to_none),
                )
                self.tick()
                self.add_cases("whole", size, group.label, group.timings, group.first)
                self.results["whole"] += whole_rows(size, group)
                spike_row = spike_skip_row(size, group)
                if spike_row is not None:
                    self.results["spike_skip"].append(spike_row)
                self.results["compile"] += _compile_rows(
                    size, "whole", group.label, _facades(group.first), group.timings
                )
                del group
                gc.collect()
        return {
            "tensors": workload.tensors,
            "params": workload.params,
            "batch": workload.tokens.shape[0],
            "tokens": workload.tokens.shape[1] - 1,
            "initial_loss": loss,
            "subnormals": subnormals,
        }

    def scaler_only(self, size: str, spec: SizeSpec, grads: GradientSet) -> None:
        """The scaler alone on gradients refilled in place, and the bandwidth floor."""
        plan = self.plan(spec)
        self.bar.set_description(f"{size}: bandwidth")
        bw = bandwidth.run_group(grads.numel, plan, self.counter, self.tick)
        self.tick()
        self.add_cases("bandwidth", size, "stream", bw.timings, None)
        bw_row = _bandwidth_row(size, bw)
        self.results["bandwidth"].append(bw_row)
        del bw
        rows = []
        for optimizer in whole_loop.OPTIMIZERS:
            self.bar.set_description(f"{size}: scaler only, {optimizer}")
            group = torch_bench.run_group(grads, optimizer, plan, self.counter, self.tick)
            self.tick()
            self.add_cases("torch", size, optimizer, group.timings, group.first)
            rows += _torch_rows(size, group)
            self.results["compile"] += _compile_rows(
                size, "torch", optimizer, _facades(group.first), group.timings
            )
            del group
            gc.collect()
        self.results["torch"] += rows
        self.results["floor"] += _floor_rows(bw_row, rows)

    def jax(self, size: str, spec: SizeSpec, grads: GradientSet) -> None:
        """The jitted optax step, alone and loss-scaled."""
        self.bar.set_description(f"{size}: jax optax")
        group = jax_bench.run_group(grads, self.plan(spec), self.counter, self.tick)
        self.tick()
        self.add_cases("jax", size, "optax", group.timings, group.first)
        self.results["jax"].append(_jax_row(size, group))
        self.results["compile"] += _compile_rows(size, "jax", "", group.first, group.timings)

    def step(self) -> None:
        """The JAX train step as users write it: both losses, then the scalers' checks."""
        size = self.options.step_size
        spec = SIZES[size]
        info: dict[str, Any] = {
            "size": size,
            "tensors": len(shape_list(spec)),
            "params": parameter_count(spec),
            "tokens": step_bench.TOKENS,
            "micro_batches": step_bench.MICRO_BATCHES,
            "versions": step_bench.peer_versions(),
            "rows": [],
            "checks": [],
            "findings": [],
        }
        self.results["step"] = info
        for loss in _step_losses(self.options):
            self.bar.set_description(f"{size}: JAX train step, {loss}")
            group = step_bench.run_group(
                spec, loss, self.whole_plan(spec), self.counter, self.tick, self.options.seed
            )
            self.tick()
            self.add_cases("step", size, loss, group.timings, group.first)
            info["rows"] += step_rows(group)
            self.results["compile"] += _compile_rows(size, "step", loss, group.first, group.timings)
            del group
            gc.collect()
        self.bar.set_description("JAX scalers: skip and growth checks")
        checks, findings = scaler_checks.run_checks()
        info["checks"] = [dataclasses.asdict(c) for c in checks]
        info["findings"] = [dataclasses.asdict(f) for f in findings]
        self.tick()

    def host(self) -> None:
        """The host cost per gradient tensor: one-element gradients, every optimizer."""
        plan = Plan(
            rounds=self.options.rounds,
            max_iters=self.options.iters or HOST_ITERS,
            fixed_iters=self.options.iters is not None,
            warmup=self.options.warmup,
            run=HOST_RUN,
        )
        for tensors in self.options.host_tensors:
            for optimizer in host_bench.OPTIMIZERS:
                self.bar.set_description(f"host: {tensors} tensors, {optimizer}")
                group = host_bench.run_group(
                    tensors, optimizer, plan, self.counter, self.tick, self.options.seed
                )
                self.tick()
                name = host_bench.label(tensors)
                self.add_cases("host", name, optimizer, group.timings, group.first)
                self.results["host"].append(host_row(tensors, group))
                self.results["compile"] += _compile_rows(
                    name, "host", optimizer, _facades(group.first), group.timings
                )
                del group
                gc.collect()

    def ddp(self) -> None:
        """Whole iterations under DDP, 2 ranks; a failure is recorded, not raised."""
        self.bar.set_description(f"DDP: {ddp_bench.WORLD_SIZE} ranks, {self.options.ddp_size}")
        settings = ddp_bench.DdpSettings(
            size=self.options.ddp_size,
            rounds=self.options.rounds,
            iters=self.options.iters or ddp_bench.ITERS,
            warmup=self.options.warmup,
            seed=self.options.seed,
        )
        info: dict[str, Any] = {**dataclasses.asdict(settings), "error": None}
        self.results["ddp"] = info
        try:
            result = ddp_bench.run(settings)
        except ddp_bench.FAILURES as error:
            info["error"] = f"{type(error).__name__}: {error}"
            return
        finally:
            self.tick()
        group = result.group
        size = settings.size
        info.update(
            world_size=ddp_bench.WORLD_SIZE,
            optimizer=group.optimizer,
            set_to_none=group.set_to_none,
            tensors=result.tensors,
            params=result.params,
            seconds=result.seconds,
            rows=whole_rows(size, group),
        )
        self.add_cases("ddp", size, group.label, group.timings, group.first)
        self.results["compile"] += _compile_rows(
            size, "ddp", f"DDP, {group.label}", _facades(group.first), group.timings
        )


def _cpu_seconds() -> tuple[float, float]:
    """This process's CPU seconds (user + system) and its finished children's."""
    own = resource.getrusage(resource.RUSAGE_SELF)
    children = resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime, children.ru_utime + children.ru_stime


@contextlib.contextmanager
def _clocked(seconds: dict[str, dict[str, float]], name: str) -> Iterator[None]:
    """Adds the block's wall time, this process's CPU time and its children's (fresh processes,
    DDP ranks) to ``seconds[name]``: where a run's minutes go, section by section."""
    wall = time.perf_counter()
    own, children = _cpu_seconds()
    try:
        yield
    finally:
        own_end, children_end = _cpu_seconds()
        entry = seconds.setdefault(name, {"wall": 0.0, "cpu": 0.0, "children_cpu": 0.0})
        entry["wall"] += time.perf_counter() - wall
        entry["cpu"] += own_end - own
        entry["children_cpu"] += children_end - children


@contextlib.contextmanager
def _frozen_heap() -> Iterator[None]:
    """Keeps what the process holds before the run (torch, JAX, their modules) out of the
    garbage collector's sight: the full collections before every timed round then look only at
    what the run made (about 0.1 s each otherwise, a quarter of a minute over a quick run)."""
    gc.collect()
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()


def run(options: BenchOptions, argv: Sequence[str] | None = None) -> dict[str, Any]:
    """Runs the selected sections for every size in ``options`` and returns the results.

    The returned dict holds ``meta``, ``sizes``, ``cases`` (every variant's raw rounds and
    samples in seconds, its statistics, first step and compilations after warm-up), and the
    derived rows the tables show: ``whole`` (whole iterations), ``spike_skip`` (the facade with
    ``spike_skip`` against the plain facade, whole iterations), ``torch`` (scaler only,
    gradients refilled in place), ``ddp`` (settings, rows or error; ``None`` if not run),
    ``step`` (the JAX train step: size, peer versions, rows, the scalers' checks and the peers'
    misbehaviours; ``None`` if not run), ``jax``, ``bandwidth``, ``floor``, ``host`` (host cost
    per gradient tensor) and ``compile``.

    Args:
        options: what to run.
        argv: the command-line arguments, recorded in ``meta.command``.

    Raises:
        ValueError: an unknown size or section name, or a non-positive round count.
    """
    _validate(options)
    started = time.perf_counter()
    counter = CompileCounter()
    whole_run = CpuShare()
    bar = tqdm(total=_ticks(options), disable=not options.progress, unit="round", file=sys.stderr)
    state = _Run(options, _meta(options, argv), counter, bar)
    results = state.results
    with counter.listening(), bar, _frozen_heap():
        if set(options.sections) & set(PER_SIZE_SECTIONS):
            for size in options.sizes:
                state.size(size)
        if "ddp" in options.sections:
            with state.clocked("ddp"):
                state.ddp()
        if "step" in options.sections:
            with state.clocked("step"):
                state.step()
        if "host" in options.sections:
            with state.clocked("host"):
                state.host()
        if "startup" in options.sections:
            bar.set_description("start-up: fresh processes")
            with state.clocked("startup"):
                results["startup"] = startup_bench.run(_startup_rounds(options), state.tick)
        if "cbfloat16" in options.sections:
            bar.set_description("cbfloat16 preview: GPT-2")
            with state.clocked("cbfloat16"):
                results["cbfloat16"] = cbfloat16_bench.run(
                    options.rounds,
                    iters=cbfloat16_bench.ITERS if options.full else QUICK_CBFLOAT16_ITERS,
                    seed=options.seed,
                    tick=state.tick,
                    float16_autocast=options.full,
                    quick=not options.full,
                )
        if "memory" in options.sections:
            bar.set_description("memory: fresh processes")
            sizes = [s for s in options.sizes if not SIZES[s].tiny] or ["S"]
            with state.clocked("memory"):
                results["memory"] = memory_bench.run(
                    sizes,
                    MEMORY_ROUNDS[options.full],
                    steps=memory_bench.STEPS if options.full else memory_bench.QUICK_STEPS,
                    variants=memory_bench.VARIANTS if options.full else memory_bench.QUICK_VARIANTS,
                    seed=options.seed,
                    tick=state.tick,
                )
    meta = results["meta"]
    meta["compiles_after_warmup_total"] = sum(
        case["compiles_after_warmup"] for case in results["cases"]
    )
    meta["skipped_steps_total"] = _skipped_total(results)
    meta["wall_seconds"] = time.perf_counter() - started
    meta["load_average_end"] = _load()
    meta["other_cpu_cores"] = whole_run.other_cores()
    return results


def _skipped_total(results: dict[str, Any]) -> int:
    """Steps skipped for an overflow (or as a spike) in every whole-iteration, DDP and host
    variant (must be 0)."""
    rows = results["whole"] + ((results["ddp"] or {}).get("rows") or []) + results["host"]
    spikes = sum(r["skipped_steps"] for r in results["spike_skip"])
    return spikes + sum(r["torch_skipped_steps"] + r["facade_skipped_steps"] for r in rows)
