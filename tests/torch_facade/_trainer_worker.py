"""What the trainer workers share, for ``test_trainers_multiprocess.py``.

Each worker trains :func:`make_net` (the tiny MLP that ``test_trainers.py`` uses too) with Adam, under a
trainer on :data:`WORLD` processes (gloo on 127.0.0.1), once with each scaler of
:data:`SCALERS`: the facade's ``cstorch.amp.GradScaler(loss_scale="dynamic")`` and torch's own
``torch.amp.GradScaler``, both from ``2**8`` (nothing overflows by itself) and without growth
within :data:`STEPS` steps. At step :data:`POISON_STEP`, rank :data:`POISON_RANK` alone writes an
inf into one of its gradients after the backward pass, that is after DDP's all-reduce, before
the scaler unscales: only that rank holds a non-finite gradient.

This module imports torch and the facade only (no trainer): it is imported by every worker and
by the test itself.
"""

from __future__ import annotations

import os
import sys
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch

WORLD = 2
STEPS = 5
ROWS_PER_RANK = 4
"""Each rank's batch (the trainers' per-device batch size); a step trains on ``WORLD`` times it."""
POISON_STEP, POISON_RANK = 2, 1
INIT_SCALE = 2.0**8
LEARNING_RATE = 0.01
TIMEOUT = timedelta(seconds=60)
"""Every collective of a worker's process group (init and each call) fails after this long."""
SCALERS = ("facade", "torch")


def make_scaler(name: str) -> Any:
    """The scaler ``name`` of :data:`SCALERS`, from :data:`INIT_SCALE`, halving on overflow.

    torch's scaler gets ``growth_interval=2000``, the facade's default ``steps_per_increase``:
    neither grows within :data:`STEPS` steps.
    """
    if name == "facade":
        import torch_facade as cstorch

        return cstorch.amp.GradScaler(loss_scale="dynamic", init_scale=INIT_SCALE)
    if name == "torch":
        return torch.amp.GradScaler("cpu", init_scale=INIT_SCALE, growth_interval=2000)
    raise ValueError(f"scaler must be one of {SCALERS}; got {name!r}")


def make_net() -> torch.nn.Sequential:
    """A small float32 MLP, the same weights on every rank and every time."""
    generator = torch.Generator().manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
    with torch.no_grad():
        for param in net.parameters():
            param.copy_(torch.randn(param.shape, generator=generator) * 0.5)
    return net


def dataset() -> torch.utils.data.TensorDataset:
    """``STEPS * WORLD * ROWS_PER_RANK`` rows of ``(x[8], y[1])``: every rank's every step."""
    generator = torch.Generator().manual_seed(1)
    rows = STEPS * WORLD * ROWS_PER_RANK
    x = torch.randn(rows, 8, generator=generator)
    y = torch.randn(rows, 1, generator=generator)
    return torch.utils.data.TensorDataset(x, y)


def plant_inf(net: torch.nn.Module) -> None:
    """Writes an inf into the first gradient of ``net`` (already all-reduced by DDP)."""
    first = next(net.parameters())
    assert first.grad is not None
    first.grad.view(-1)[0] = float("inf")


def params_of(net: torch.nn.Module) -> list[torch.Tensor]:
    return [p.detach().clone() for p in net.parameters()]


def same(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return all(torch.equal(x, y) for x, y in zip(a, b, strict=True))


def final_state(net: torch.nn.Module, optimizer: torch.optim.Optimizer, scaler: Any) -> dict:
    """Copies of the model's, the optimizer's and the scaler's state dicts."""
    return {
        "model": {k: v.detach().clone() for k, v in net.state_dict().items()},
        "optimizer": optimizer.state_dict(),
        "scaler": scaler.state_dict(),
    }


def log_to(out: Path, rank: int) -> None:
    """Sends this process's stdout and stderr to ``out / f"rank{rank}.log"`` (the test shows
    every rank's log when a launch fails)."""
    log = os.open(out / f"rank{rank}.log", os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    sys.stdout.flush()
    sys.stderr.flush()
    os.dup2(log, 1)
    os.dup2(log, 2)
    os.close(log)


def save(result: dict[str, Any], out: Path, rank: int) -> None:
    """``torch.save`` to a temporary file, then ``os.replace``: the test never reads half."""
    path = out / f"rank{rank}.pt"
    temporary = path.with_name(f".{path.name}.tmp")
    torch.save(result, temporary)
    os.replace(temporary, path)
