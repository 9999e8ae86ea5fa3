"""The device check's compiled section: the facade around ``torch.compile``'d code.

Each pattern trains a copy of one GPT-like model with the facade's scaler (DLS, fused SGD with
momentum, float16 autocast, ``unscale_`` then ``clip_grad_norm_``), with an inf loss at :data:`FAULT_STEPS`,
and is compared with the same loop run eagerly:

``model``
    ``torch.compile(model)`` (inductor), the loop around it eager.
``model, reduce-overhead``
    ``torch.compile(model, mode="reduce-overhead")``: forward and backward are captured as CUDA
    graphs and replayed; the scaler runs outside them, between the replays. CUDA only.
``train step``
    The whole iteration compiled (``zero_grad``, forward, ``scale(loss).backward()``,
    ``unscale_``, ``clip_grad_norm_``, ``step``, ``update``): the facade's calls run eagerly
    behind graph breaks, the forward and the clipping are compiled.
``train step, reduce-overhead``
    The same with CUDA graphs for its compiled parts. CUDA only.

Per pattern: the skipped steps and the scales (must equal the eager run's), whether the
parameters stayed bit-identical across every skipped step, the largest parameter difference from
the eager run at the end (compiled kernels round differently: at most :data:`PARAM_ATOL`), the
graphs dynamo compiled after warm-up (must be 0), the graph breaks, CUDA graph skips with their
reasons, and the median milliseconds of a whole iteration (eager and compiled, each after its own
warm-up, on the same model; on CUDA every iteration ends with ``torch.cuda.synchronize()``).
"""

from __future__ import annotations

import copy
import dataclasses
import logging
import statistics
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch._dynamo.utils import counters

import torch_facade as cstorch
from workbench.internals import host_side as _host_side
from workbench.sizes import SIZES, SizeSpec, next_token_loss
from workbench.whole_loop import make_workload

PATTERNS = ("model", "model, reduce-overhead", "train step", "train step, reduce-overhead")
"""The compiled patterns, in the order they run."""

CUDA_ONLY = ("model, reduce-overhead", "train step, reduce-overhead")
"""Patterns that need a CUDA device (CUDA graphs)."""

FAULT_STEPS = (3, 6)
"""Steps whose loss is multiplied by inf: every gradient overflows and the step is skipped."""

WARM_UP = 2
"""Steps after which nothing may compile again."""

INIT_SCALE = 2.0**12
STEPS_PER_INCREASE = 2  # the scale grows after warm-up too: a changed scale must not recompile
LEARNING_RATE = 1e-3
CLIP_NORM = 1.0

MOMENTUM = 0.9

PARAM_ATOL = 1e-4
"""The largest parameter difference from the eager run allowed at the end. Compiled float16
kernels round differently from eager ones; SGD moves a parameter by ``LEARNING_RATE`` times its
(clipped, at most ``CLIP_NORM``) gradient and momentum, so six applied steps of slightly
different gradients stay far inside this (2.4e-7 at S on the CPU), while a step applied with a
gradient element off by 0.1 does not.
(AdamW, used before, normalises every update to about ``LEARNING_RATE`` whatever the gradient:
a parameter whose gradient is near zero can move by up to twice that per step in one run
against the other, 6.7e-3 over six steps at S on the CPU, so it checked nothing precise.)"""

QUICK_SPEC = dataclasses.replace(SIZES["S"], name="S/16", d_model=16, vocab=16, context=16)
"""The model of ``--quick`` on the CPU: S's layout at width 16 (inductor compiles it quickly)."""


def _poison(step: int, device: torch.device) -> torch.Tensor:
    """The loss multiplier of ``step``: inf at a fault step, else 1 (a tensor: same graph)."""
    return torch.tensor(float("inf") if step in FAULT_STEPS else 1.0, device=device)


def _make_step(
    pattern: str, model: torch.nn.Module, optimizer: torch.optim.Optimizer, scaler: Any
) -> Callable[[torch.Tensor, torch.Tensor], None]:
    """One training iteration ``step(tokens, poison)`` of ``pattern`` (``"eager"``: none)."""
    mode = "reduce-overhead" if pattern.endswith("reduce-overhead") else "default"
    forward: Callable[..., Any] = model
    if pattern.startswith("model"):
        forward = torch.compile(model, mode=mode)

    def step(tokens: torch.Tensor, poison: torch.Tensor) -> None:
        optimizer.zero_grad()
        with torch.autocast(tokens.device.type, dtype=torch.float16):
            loss = next_token_loss(forward, tokens) * poison
        scaler.scale(loss).backward()
        scaler.unscale_(optimizer)
        torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP_NORM)
        scaler.step(optimizer)
        scaler.update()

    if pattern.startswith("train step"):
        return torch.compile(step, mode=mode)
    return step


class _CudaGraphSkips(logging.Handler):
    """Collects inductor's "skipping cudagraphs" messages (it logs them as warnings)."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.reasons: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        message = record.getMessage()
        if "cudagraph" in message.lower():
            self.reasons.append(message.splitlines()[0][:300])


@contextmanager
def _cudagraph_skips() -> Iterator[_CudaGraphSkips]:
    handler = _CudaGraphSkips()
    logger = logging.getLogger("torch._inductor")
    logger.addHandler(handler)
    try:
        yield handler
    finally:
        logger.removeHandler(handler)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _train(
    pattern: str,
    initial: torch.nn.Module,
    tokens: torch.Tensor,
    steps: int,
    timed: int,
) -> dict[str, Any]:
    """Trains a copy of ``initial`` for ``steps`` checked steps, then ``timed`` timed ones."""
    device = tokens.device
    model = copy.deepcopy(initial)
    optimizer = torch.optim.SGD(model.parameters(), lr=LEARNING_RATE, momentum=MOMENTUM, fused=True)
    scaler = cstorch.amp.GradScaler(
        loss_scale="dynamic",
        init_scale=INIT_SCALE,
        steps_per_increase=STEPS_PER_INCREASE,
        optimizers=[optimizer],
    )
    torch._dynamo.reset()
    counters.clear()
    step = _make_step(pattern, model, optimizer, scaler)
    flags, scales, unchanged_on_skips = [], [], []
    graphs_at_warm_up = 0
    with _cudagraph_skips() as skips:
        for index in range(steps):
            if index == WARM_UP:
                graphs_at_warm_up = counters["stats"]["unique_graphs"]
            before = [p.detach().clone() for p in model.parameters()]
            step(tokens, _poison(index, device))
            flags.append(bool(scaler.get_isfinite()))
            scales.append(float(scaler.get_scale()))
            if not flags[-1]:
                after = model.parameters()
                unchanged_on_skips.append(
                    all(torch.equal(b, a) for b, a in zip(before, after, strict=True))
                )
        params = [p.detach().clone() for p in model.parameters()]
        one = _poison(-1, device)
        times = []
        for _ in range(timed):
            _sync(device)
            start = time.perf_counter()
            step(tokens, one)
            _sync(device)
            times.append((time.perf_counter() - start) * 1e3)
    breaks = dict(counters["graph_break"])
    return {
        "flags": flags,
        "scales": scales,
        "params": params,
        "unchanged_on_skips": unchanged_on_skips,
        "graphs": counters["stats"]["unique_graphs"],
        "compiles_after_warmup": counters["stats"]["unique_graphs"] - graphs_at_warm_up,
        "graph_breaks": sum(breaks.values()),
        "facade_graph_breaks": sum(n for r, n in breaks.items() if _host_side.REASON in r),
        "cudagraph_skips": counters["inductor"]["cudagraph_skips"],
        "cudagraph_skip_reasons": sorted(set(skips.reasons)),
        "median_ms": statistics.median(times) if times else None,
    }


def _spec(device: torch.device, quick: bool) -> SizeSpec:
    return QUICK_SPEC if quick and device.type == "cpu" else SIZES["S"]


def run(device: torch.device, quick: bool, seed: int = 0) -> dict[str, Any]:
    """Runs every pattern on ``device`` against the eager loop; returns the section's result.

    Returns:
        ``passed`` (every applicable pattern matched the eager run and compiled nothing after
        warm-up), the model, the settings, the eager run and one row per pattern (``applicable:
        false`` with a ``reason`` for the CUDA-only patterns elsewhere).
    """
    spec = _spec(device, quick)
    steps = 8
    timed = 3 if quick else 20
    workload = make_workload(spec, seed, device=device)
    eager = _train("eager", workload.model, workload.tokens, steps, timed)
    rows = []
    for pattern in PATTERNS:
        if pattern in CUDA_ONLY and device.type != "cuda":
            rows.append(
                {"pattern": pattern, "applicable": False, "reason": "CUDA graphs need a GPU"}
            )
            continue
        run_ = _train(pattern, workload.model, workload.tokens, steps, timed)
        diff = max(
            float((a.float() - b.float()).abs().max())
            for a, b in zip(run_.pop("params"), eager["params"], strict=True)
        )
        row = {"pattern": pattern, "applicable": True, **run_, "max_param_diff": diff}
        row["same_skips"] = run_["flags"] == eager["flags"]
        row["same_scales"] = run_["scales"] == eager["scales"]
        row["passed"] = (
            row["same_skips"]
            and row["same_scales"]
            and all(run_["unchanged_on_skips"])
            and len(run_["unchanged_on_skips"]) == len(FAULT_STEPS)
            and diff <= PARAM_ATOL
            and run_["compiles_after_warmup"] == 0
        )
        rows.append(row)
    eager.pop("params")
    applicable = [r for r in rows if r["applicable"]]
    return {
        "passed": bool(applicable) and all(r["passed"] for r in applicable),
        "model": {
            "layout": spec.name,
            "d_model": spec.d_model,
            "tensors": workload.tensors,
            "params": workload.params,
            "autocast": "float16",
            "optimizer": "SGD fused, momentum 0.9",
        },
        "settings": {
            "steps": steps,
            "warm_up": WARM_UP,
            "fault_steps": list(FAULT_STEPS),
            "init_scale": INIT_SCALE,
            "steps_per_increase": STEPS_PER_INCREASE,
            "clip_norm": CLIP_NORM,
            "param_atol": PARAM_ATOL,
            "timed_iterations": timed,
        },
        "eager": {k: eager[k] for k in ("flags", "scales", "median_ms")},
        "rows": rows,
    }
