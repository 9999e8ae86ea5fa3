"""Host time per call of the documented loop: each call of an iteration timed in place.

The bench's host profile (``python -m benchmarks.host_profile``) and the device check's
``per_call`` timings both time the loops of :mod:`workbench.whole_loop` with these.
"""

from __future__ import annotations

import gc
import statistics
import time

import torch

from workbench.whole_loop import TrainLoop

PHASES = ("loss", "scale", "backward", "unscale_", "step", "update")
"""The calls of one iteration, in order: ``loss`` is ``zero_grad`` and the forward pass; the
bare loop has no ``scale``, ``unscale_`` or ``update`` and its ``step`` is
``optimizer.step()``."""

SCALER_CALLS = ("scale", "unscale_", "step", "update")
"""The scaler's own calls among :data:`PHASES`."""

RUN = 10
"""The loops take turns in runs of this many timed iterations, each run after one untimed
iteration of its loop: every timed iteration follows one of its own loop's, as in training
(see :class:`workbench.timing.Plan`)."""


def time_calls(loop: TrainLoop, unscale: bool = False) -> dict[str, float]:
    """Runs one iteration of ``loop``'s documented loop and times each call on the host.

    On a CUDA device the device is synchronized after ``backward`` and at the end of the
    iteration (both untimed), so that each scaler call is timed with the device idle: host cost,
    not a wait for queued work (``device_check``'s sleep probe measures waiting).

    Args:
        loop: a ``bare``, ``torch`` or ``facade`` variant.
        unscale: call ``scaler.unscale_(optimizer)`` before ``step`` (scaled variants only).

    Returns:
        Seconds per phase of :data:`PHASES` that the variant has.
    """
    scaler, optimizer = loop.scaler, loop.optimizer
    cuda = loop.device.type == "cuda"
    times: dict[str, float] = {}
    start = time.perf_counter()
    loss = loop.loss()
    mark = time.perf_counter()
    times["loss"] = mark - start
    if scaler is not None:
        loss = scaler.scale(loss)
        times["scale"] = time.perf_counter() - mark
    mark = time.perf_counter()
    loss.backward()
    if cuda:
        torch.cuda.synchronize(loop.device)
    times["backward"] = time.perf_counter() - mark
    if scaler is None:
        mark = time.perf_counter()
        optimizer.step()
        times["step"] = time.perf_counter() - mark
    else:
        if unscale:
            mark = time.perf_counter()
            scaler.unscale_(optimizer)
            times["unscale_"] = time.perf_counter() - mark
        mark = time.perf_counter()
        scaler.step(optimizer)
        times["step"] = time.perf_counter() - mark
        mark = time.perf_counter()
        scaler.update()
        times["update"] = time.perf_counter() - mark
    if cuda:
        torch.cuda.synchronize(loop.device)
    return times


def median_calls(
    loops: dict[str, TrainLoop], iters: int, warmup: int, unscale: bool = False
) -> dict[str, dict[str, float]]:
    """Median seconds per call of every loop, the loops taking turns in runs of :data:`RUN`
    iterations (each run after one untimed iteration of its loop).

    Returns:
        ``{variant: {phase: median seconds}}``, plus ``"scaler"``: the sum of the scaler calls'
        medians (the scaled variants only).
    """
    for _ in range(warmup):
        for loop in loops.values():
            time_calls(loop, unscale)
    samples: dict[str, dict[str, list[float]]] = {name: {} for name in loops}
    gc.collect()
    gc.disable()
    try:
        for start in range(0, iters, RUN):
            for name, loop in loops.items():
                time_calls(loop, unscale)  # untimed: follows the other loops' runs
                for _ in range(min(RUN, iters - start)):
                    for phase, seconds in time_calls(loop, unscale).items():
                        samples[name].setdefault(phase, []).append(seconds)
    finally:
        gc.enable()
    medians = {}
    for name, phases in samples.items():
        medians[name] = {phase: statistics.median(values) for phase, values in phases.items()}
        if loops[name].scaler is not None:
            medians[name]["scaler"] = sum(medians[name].get(c, 0.0) for c in SCALER_CALLS)
    return medians
