"""The frameworks' own loss scalers, as test oracles: DeepSpeed's and Megatron's classes.

* DeepSpeed's ``DynamicLossScaler`` (``deepspeed.runtime.fp16.loss_scaler``, the pinned
  deepspeed of the dev extra). Its ``update_scale`` asks ``deepspeed.comm.get_rank()`` before it
  logs an overflow, which needs an initialised process group: the oracle answers rank 0 instead.
* Megatron's ``DynamicGradScaler`` (megatron-core's ``megatron/core/optimizer/grad_scaler.py``),
  loaded from its file alone: importing ``megatron.core.optimizer`` would import the whole of
  megatron-core. The class keeps its scale in CUDA tensors (``device='cuda'``); the module gets
  a view of ``torch`` whose ``tensor`` puts them on the CPU, the arithmetic unchanged.

Each oracle runs a sequence of overflow flags and returns, after every update, the scale and
the strikes left (DeepSpeed's ``cur_hysteresis``; Megatron's ``_hysteresis_tracker``), and for
DeepSpeed the step at which it raised "Current loss scale already at minimum" (or ``None``).

Spike skipping has no installable framework class to hold it to (OLMo-core's, levanter's and
metaseq's live inside their trainers): :func:`spike_window_decisions` is its rule written
plainly, a ``collections.deque`` of the applied steps' metrics with NumPy's ``mean`` and
``std(ddof=1)`` in float64, for both doors' tests.
"""

from __future__ import annotations

import collections
import importlib.metadata
import importlib.util
import types
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pytest


def deepspeed_trace(
    overflows: Sequence[bool],
    *,
    init_scale: float,
    scale_window: int,
    min_scale: float,
    hysteresis: int,
    consecutive_hysteresis: bool,
) -> tuple[list[tuple[float, int]], int | None]:
    """``([(cur_scale, cur_hysteresis) after each update], the step that raised or None)``."""
    loss_scaler = pytest.importorskip("deepspeed.runtime.fp16.loss_scaler")
    comm = loss_scaler.dist
    get_rank = comm.get_rank
    comm.get_rank = lambda *args, **kwargs: 0
    try:
        scaler = loss_scaler.DynamicLossScaler(
            init_scale=init_scale,
            scale_window=scale_window,
            min_scale=min_scale,
            delayed_shift=hysteresis,
            consecutive_hysteresis=consecutive_hysteresis,
        )
        trace: list[tuple[float, int]] = []
        for step, overflow in enumerate(overflows):
            try:
                scaler.update_scale(bool(overflow))
            except Exception as err:  # DeepSpeed raises a bare Exception
                assert "already at minimum" in str(err)
                return trace, step
            trace.append((float(scaler.cur_scale), int(scaler.cur_hysteresis)))
        return trace, None
    finally:
        comm.get_rank = get_rank


def _megatron_module() -> Any:
    try:
        files = importlib.metadata.files("megatron-core") or []
    except importlib.metadata.PackageNotFoundError:
        pytest.skip("megatron-core is not installed (the dev extra pins it)")
    path = next(
        Path(str(f.locate())) for f in files if str(f).endswith("core/optimizer/grad_scaler.py")
    )
    spec = importlib.util.spec_from_file_location("_megatron_grad_scaler", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    module.torch = _TorchOnTheCpu()
    return module


class _TorchOnTheCpu(types.SimpleNamespace):
    """``torch``, except that ``torch.tensor(..., device='cuda')`` makes a CPU tensor."""

    def __getattr__(self, name: str) -> Any:
        import torch

        return getattr(torch, name)

    @staticmethod
    def tensor(*args: Any, **kwargs: Any) -> Any:
        import torch

        kwargs.pop("device", None)
        return torch.tensor(*args, **kwargs)


def megatron_trace(
    overflows: Sequence[bool],
    *,
    initial_scale: float,
    min_scale: float,
    growth_interval: int,
    hysteresis: int,
) -> list[tuple[float, int]]:
    """``[(scale, _hysteresis_tracker) after each update]`` of Megatron's DynamicGradScaler."""
    module = _megatron_module()
    scaler = module.DynamicGradScaler(
        initial_scale=initial_scale,
        min_scale=min_scale,
        growth_factor=2.0,
        backoff_factor=0.5,
        growth_interval=growth_interval,
        hysteresis=hysteresis,
    )
    trace = []
    for overflow in overflows:
        scaler.update(bool(overflow))
        trace.append((float(scaler.scale.item()), int(scaler._hysteresis_tracker)))
    return trace


def spike_window_decisions(
    metrics: Sequence[float], finite: Sequence[bool], *, window: int, sigma: float, warmup: int
) -> list[tuple[bool, float]]:
    """``[(spike, threshold)]`` per step: a step is a spike when its metric is finite and above
    ``mean + sigma * std`` of the last ``window`` applied steps' metrics, once ``warmup`` steps
    have been applied (threshold ``inf`` before); overflows and spikes are not recorded."""
    recent: collections.deque[float] = collections.deque(maxlen=window)
    applied = 0
    out = []
    for value, ok in zip(metrics, finite, strict=True):
        if applied >= warmup:
            threshold = float(np.mean(recent) + sigma * np.std(recent, ddof=1))
        else:
            threshold = float("inf")
        spike = bool(ok and np.isfinite(value) and value > threshold)
        if ok and np.isfinite(value) and not spike:
            recent.append(value)
            applied += 1
        out.append((spike, threshold))
    return out
