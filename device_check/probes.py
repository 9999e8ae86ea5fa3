"""The device check's measuring sections: memory, host synchronisations, and timings.

Each public function is one section of :mod:`device_check` and returns its JSON
dict; a part that cannot run on the device is ``None`` with a ``reason`` beside it. The loops are
:class:`workbench.whole_loop.TrainLoop` variants on the device (the documented loop, fresh
gradients every iteration), so every number here is measured on the loop users run.
"""

from __future__ import annotations

import collections
import gc
import os
import statistics
import time
import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch

from workbench import whole_loop
from workbench.call_timers import median_calls
from workbench.internals import crossing_cuda as _crossing_cuda
from workbench.internals import dlpack as _dlpack
from workbench.internals import placed_for
from workbench.sizes import SIZES
from workbench.timing import CompileCounter, Plan

MEMORY_ITERATIONS = 5
"""Facade iterations after the first decision before memory is read again."""

MEMORY_KEYS = (
    "bytes_in_use",
    "peak_bytes_in_use",
    "bytes_limit",
    "bytes_reserved",
    "peak_bytes_reserved",
    "largest_alloc_size",
    "num_allocs",
    "pool_bytes",
    "peak_pool_bytes",
)
"""The entries of ``jax.Device.memory_stats()`` recorded (those the backend reports)."""

SLEEP_MS = 50.0
"""Device time queued (``torch.cuda._sleep``) after backward in the sleep probe."""

PROBE_OPTIMIZERS = ("AdamW fused", "SGD foreach")
"""The optimizers of the host-sync probes: the facade's fused path and its in-place multiply."""

SCALED = ("torch", "facade")
"""The scaled whole-iteration variants the probes compare."""

TIMING_OPTIMIZERS = ("SGD foreach", "AdamW fused")
"""The optimizers of the whole-iteration timings."""


def _backends_initialized() -> bool | None:
    """Whether JAX has initialized its backends (a private flag; ``None`` where it is absent)."""
    try:
        from jax._src import xla_bridge

        return bool(xla_bridge.backends_are_initialized())
    except Exception:  # a jax without the flag: the free-memory readings still tell
        return None


def _memory_checkpoint(label: str, device: torch.device) -> dict[str, Any]:
    entry: dict[str, Any] = {"at": label, "jax_backends_initialized": _backends_initialized()}
    if device.type == "cuda":
        free, total = torch.cuda.mem_get_info(device)
        entry.update(
            free_bytes=free,
            total_bytes=total,
            torch_reserved_bytes=torch.cuda.memory_reserved(device),
            torch_allocated_bytes=torch.cuda.memory_allocated(device),
        )
    return entry


def _jax_memory(device: torch.device) -> tuple[dict[str, int] | None, str | None, str | None]:
    """``(selected memory_stats, reason when None, the JAX device)`` for ``device``."""
    from hardware.devices import jax_device_for

    try:
        jax_device = jax_device_for(device)
        stats = jax_device.memory_stats()
    except Exception as error:  # e.g. JAX fell back to the CPU: keep the torch readings
        return None, f"{type(error).__name__}: {error}", None
    if not stats:
        reason = f"{jax_device.platform} device {jax_device} reports no memory_stats()"
        return None, reason, str(jax_device)
    return {k: int(stats[k]) for k in MEMORY_KEYS if k in stats}, None, str(jax_device)


def memory(device: torch.device, seed: int = 0) -> dict[str, Any]:
    """What JAX takes beside torch, with the defaults a user gets.

    Must run before anything else initializes JAX's backends in this process. Steps: a torch-only
    warm-up (two bare iterations of the S model, so that torch's libraries and allocator pools
    exist), then the facade variant is built (``GradScaler()``), takes its first decision and
    runs :data:`MEMORY_ITERATIONS` more iterations. At each checkpoint: whether JAX's backends
    are initialized and, on CUDA, ``torch.cuda.mem_get_info`` and torch's own reserved bytes.
    ``outside_torch_bytes`` is the drop in free memory from before the facade to the end that
    torch's allocator does not account for: JAX's preallocation or pool, its modules and
    handles.
    """
    cuda = device.type == "cuda"
    env_before = _xla_env()
    checkpoints = [_memory_checkpoint("start (torch only)", device)]
    workload = whole_loop.make_workload(SIZES["S"], seed, device=device)
    bare = whole_loop.TrainLoop("bare", "AdamW fused", True, workload)
    for _ in range(2):
        bare.step()
    checkpoints.append(_memory_checkpoint("after 2 bare torch iterations", device))
    loop = whole_loop.TrainLoop("facade", "AdamW fused", True, workload)
    checkpoints.append(_memory_checkpoint("after GradScaler()", device))
    loop.step()
    checkpoints.append(_memory_checkpoint("after the first decision", device))
    for _ in range(MEMORY_ITERATIONS):
        loop.step()
    checkpoints.append(
        _memory_checkpoint(f"after {MEMORY_ITERATIONS + 1} facade iterations", device)
    )
    assert loop.facade is not None
    result: dict[str, Any] = {
        "model": "S, AdamW fused",
        "checkpoints": checkpoints,
        "jax_initialized_before_first_decision": checkpoints[2]["jax_backends_initialized"],
        "scale_device": str(loop.facade.get_scale().device),
        "crossing": _dlpack.crossing_for(placed_for(loop.facade) or torch.device(device)).name,
        "cuda_crossing_failure": _crossing_cuda.last_failure,
        "xla_env_before": env_before,
        "xla_env_after": _xla_env(),
    }
    stats, reason, jax_device = _jax_memory(device)
    result.update(jax_device=jax_device, jax_memory_stats=stats, jax_memory_stats_reason=reason)
    if cuda:
        before, end = checkpoints[1], checkpoints[-1]
        drop = before["free_bytes"] - end["free_bytes"]
        torch_growth = end["torch_reserved_bytes"] - before["torch_reserved_bytes"]
        result.update(
            total_bytes=end["total_bytes"],
            free_drop_bytes=drop,
            torch_reserved_growth_bytes=torch_growth,
            outside_torch_bytes=drop - torch_growth,
            outside_torch_fraction=(drop - torch_growth) / end["total_bytes"],
            reason=None,
        )
    else:
        result.update(
            total_bytes=None,
            free_drop_bytes=None,
            torch_reserved_growth_bytes=None,
            outside_torch_bytes=None,
            outside_torch_fraction=None,
            reason="torch.cuda.mem_get_info needs a CUDA device; on the CPU both frameworks "
            "use the process's heap",
        )
    return result


XLA_ENV = (
    "XLA_PYTHON_CLIENT_PREALLOCATE",
    "XLA_CLIENT_MEM_FRACTION",
    "XLA_PYTHON_CLIENT_MEM_FRACTION",
    "XLA_PYTHON_CLIENT_ALLOCATOR",
    "CUDA_VISIBLE_DEVICES",
    "JAX_PLATFORMS",
    "XLA_FLAGS",
    "OMP_NUM_THREADS",
)
"""Environment variables that decide how JAX and torch use the device."""


def _xla_env() -> dict[str, str | None]:
    return {name: os.environ.get(name) for name in XLA_ENV}


@contextmanager
def _sync_warnings() -> Iterator[list[warnings.WarningMessage]]:
    """Collects torch's synchronising-operation warnings (``set_sync_debug_mode("warn")``)."""
    torch.cuda.set_sync_debug_mode("warn")
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            yield caught
    finally:
        torch.cuda.set_sync_debug_mode("default")


def _is_sync(warning: warnings.WarningMessage) -> bool:
    return "synchroniz" in str(warning.message)


def _sync_counts(loop: whole_loop.TrainLoop, iters: int) -> dict[str, Any]:
    """Synchronising operations torch reports in the scaler calls of ``iters`` iterations."""
    scaler, optimizer = loop.scaler, loop.optimizer
    assert scaler is not None
    counts, sites = [], collections.Counter()
    for _ in range(iters):
        loss = loop.loss()
        with _sync_warnings() as caught:
            scaled = scaler.scale(loss)
        scaled.backward()
        with _sync_warnings() as after:
            scaler.step(optimizer)
            scaler.update()
        syncs = [w for w in caught + after if _is_sync(w)]
        counts.append(len(syncs))
        sites.update(f"{os.path.relpath(w.filename)}:{w.lineno}" for w in syncs)
        torch.cuda.synchronize(loop.device)
    return {
        "per_iteration": counts,
        "median": statistics.median(counts),
        "sites": [{"where": where, "count": n} for where, n in sites.most_common(5)],
    }


def _sleep_cycles(device: torch.device, ms: float) -> int:
    """The ``torch.cuda._sleep`` argument that keeps ``device`` busy for about ``ms``."""
    calibration = 10_000_000
    per_ms = []
    for _ in range(2):  # the first call may include a launch warm-up
        start = torch.cuda.Event(enable_timing=True)
        end = torch.cuda.Event(enable_timing=True)
        torch.cuda.synchronize(device)
        start.record()
        torch.cuda._sleep(calibration)
        end.record()
        end.synchronize()
        per_ms.append(calibration / max(start.elapsed_time(end), 1e-3))
    return int(ms * per_ms[-1])


def _sleep_probe(loop: whole_loop.TrainLoop, iters: int, cycles: int) -> dict[str, Any]:
    """Host time of ``step`` + ``update`` with about :data:`SLEEP_MS` of device work queued."""
    scaler, optimizer = loop.scaler, loop.optimizer
    assert scaler is not None
    host, wall = [], []
    for _ in range(iters):
        scaler.scale(loop.loss()).backward()
        torch.cuda.synchronize(loop.device)
        torch.cuda._sleep(cycles)
        start = time.perf_counter()
        scaler.step(optimizer)
        scaler.update()
        host.append((time.perf_counter() - start) * 1e3)
        torch.cuda.synchronize(loop.device)
        wall.append((time.perf_counter() - start) * 1e3)
    median = statistics.median(host)
    return {
        "host_ms": host,
        "wall_ms": wall,
        "median_host_ms": median,
        "waited_for_device": median > SLEEP_MS / 2,
    }


def host_syncs(device: torch.device, quick: bool, seed: int = 0) -> dict[str, Any]:
    """Host synchronisations per iteration of the scaler calls, facade and torch.

    CUDA only: ``torch.cuda.set_sync_debug_mode("warn")`` around ``scale`` and ``step`` +
    ``update`` counts the synchronising operations torch itself reports (``.item()``, blocking
    copies; not JAX's waits), and the sleep probe catches any wait: after backward, about
    :data:`SLEEP_MS` of device time is queued (``torch.cuda._sleep``) and ``step`` + ``update``
    are timed on the host; a scaler that returns in much less did not wait for the device.
    """
    if device.type != "cuda":
        reason = "not applicable on the CPU: there is no device stream to wait for"
        return {"applicable": False, "reason": reason, "rows": None}
    iters = 3 if quick else 10
    workload = whole_loop.make_workload(SIZES["S"], seed, device=device)
    can_sleep = hasattr(torch.cuda, "_sleep")  # private, in torch since 1.x: checked anyway
    cycles = _sleep_cycles(device, SLEEP_MS) if can_sleep else None
    rows = []
    for optimizer in PROBE_OPTIMIZERS:
        for name in SCALED:
            loop = whole_loop.TrainLoop(name, optimizer, True, workload)
            for _ in range(3):  # fused AdamW takes the facade's fused path from step 2
                loop.step()
            rows.append(
                {
                    "optimizer": optimizer,
                    "scaler": name,
                    "sync_debug": _sync_counts(loop, iters),
                    "sleep_probe": None if cycles is None else _sleep_probe(loop, 3, cycles),
                }
            )
    return {
        "applicable": True,
        "reason": None,
        "model": "S",
        "sleep_ms": SLEEP_MS,
        "sleep_cycles": cycles,
        "sleep_probe_reason": None if can_sleep else "this torch has no torch.cuda._sleep",
        "rows": rows,
    }


def per_call(device: torch.device, quick: bool, seed: int = 0) -> dict[str, Any]:
    """Median host microseconds of each scaler call in the steady state, facade and torch.

    On the ``tiny`` model (M's 148 tensors at width 16: the tensor count of M, almost no
    arithmetic), for both loops (``scale``/``step``/``update``, and with ``unscale_``) and
    both timing optimizers; see :func:`workbench.call_timers.time_calls`.
    """
    iters, warmup = (5, 3) if quick else (30, 5)
    workload = whole_loop.make_workload(SIZES["tiny"], seed, device=device)
    rows = []
    for optimizer in TIMING_OPTIMIZERS:
        loops = {name: whole_loop.TrainLoop(name, optimizer, True, workload) for name in SCALED}
        for unscale in (False, True):
            medians = median_calls(loops, iters, warmup, unscale)
            for name in SCALED:
                rows.append(
                    {
                        "optimizer": optimizer,
                        "loop": "unscale_" if unscale else "default",
                        "scaler": name,
                        "us": {call: s * 1e6 for call, s in medians[name].items()},
                    }
                )
    return {"model": "tiny", "tensors": workload.tensors, "iterations": iters, "rows": rows}


def whole_iterations(
    device: torch.device,
    sizes: tuple[str, ...],
    plan_for: Callable[[str], Plan],
    counter: CompileCounter,
    seed: int = 0,
    progress: Callable[[str], None] = lambda text: None,
) -> dict[str, Any]:
    """Whole iterations, facade against torch, with and without clipping, per size.

    :func:`workbench.whole_loop.run_group` on the device (its timed calls end with
    ``torch.cuda.synchronize()`` on CUDA), torch's default ``zero_grad``; rows as
    ``make bench``'s whole-iteration table (:func:`workbench.whole_loop.whole_rows`), and per group
    the timed iterations per round, the first steps and the compilations after warm-up (0).
    """
    rows: list[dict[str, Any]] = []
    groups: list[dict[str, Any]] = []
    info = {}
    for size in sizes:
        progress(f"timings: whole iterations at {size}")
        workload = whole_loop.make_workload(SIZES[size], seed, device=device)
        info[size] = {"tensors": workload.tensors, "params": workload.params}
        for optimizer in TIMING_OPTIMIZERS:
            group = whole_loop.run_group(
                workload, optimizer, True, plan_for(size), counter, variants=whole_loop.VARIANTS
            )
            rows += whole_loop.whole_rows(size, group)
            groups.append(
                {
                    "size": size,
                    "optimizer": optimizer,
                    "iters": {name: t.iters for name, t in group.timings.items()},
                    "first_step_s": {name: f.seconds for name, f in group.first.items()},
                    "compiles_after_warmup": {n: t.compiles for n, t in group.timings.items()},
                }
            )
            del group
            gc.collect()  # a TrainLoop refers to itself (its step): free the model copies now
        del workload
        gc.collect()
    return {"sizes": info, "rows": rows, "groups": groups}
