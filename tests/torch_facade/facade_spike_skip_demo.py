"""One planted bad batch in a torch loop, with and without spike skipping: the held-out loss.

The torch twin of tests/amp_core/spike_skip_demo.py: a small MLP regression computed in bfloat16
(``torch.autocast``) and trained with Adam through ``cstorch.amp.GradScaler(loss_scale=
"dynamic")``. At ``--bad-step`` the batch's targets are multiplied by ``--factor``, so that its
gradients are hundreds of times the usual (finite: no overflow, the loss scaler applies it). The
default run applies that step; the runs with ``spike_skip=cstorch.amp.SpikeSkip(...)`` skip it.
Printed: the held-out loss just before the bad step, just after it, 10 steps after it and at the
end, for each run (docs/pytorch/spike-skip.md quotes them).

    PYTHONPATH=. python tests/torch_facade/facade_spike_skip_demo.py --steps 400 --bad-step 300
"""

from __future__ import annotations

import argparse
import time
from typing import Any

import torch

import torch_facade as cstorch

IN, HIDDEN = 16, 64


def data(generator: torch.Generator, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    x = torch.randn(n, IN, generator=generator)
    teacher = torch.randn(IN, generator=torch.Generator().manual_seed(123)) / IN**0.5
    return x, torch.tanh(x @ teacher)[:, None] + 0.05 * torch.sin(3 * x[:, :1])


def model_and_optimizer() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(IN, HIDDEN), torch.nn.Tanh(), torch.nn.Linear(HIDDEN, 1)
    )
    return model, torch.optim.Adam(model.parameters(), lr=3e-3)


def loss_fn(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    with torch.autocast("cpu", dtype=torch.bfloat16):
        pred = model(x)
    return (pred.float() - y).square().mean()


def train(spike_skip: Any, steps: int, bad_step: int, factor: float) -> dict[str, float | int]:
    """One run; ``spike_skip`` a ``cstorch.amp.SpikeSkip`` or ``None`` (the default scaler)."""
    model, optimizer = model_and_optimizer()
    scaler = cstorch.amp.GradScaler(
        loss_scale="dynamic", init_scale=2.0**10, steps_per_increase=100, spike_skip=spike_skip
    )
    x_test, y_test = data(torch.Generator().manual_seed(1), 512)

    def held_out() -> float:
        with torch.no_grad():
            return float(loss_fn(model, x_test, y_test))

    result: dict[str, float | int] = {}
    for i in range(steps):
        x, y = data(torch.Generator().manual_seed(10_000 + i), 32)
        if i == bad_step:
            result["before"] = held_out()
            y = y * factor
        optimizer.zero_grad()
        scaler.scale(loss_fn(model, x, y)).backward()
        scaler.step(optimizer)
        scaler.update()
        if i == bad_step:
            result["after"] = held_out()
        if i == bad_step + 10:
            result["after10"] = held_out()
    result["end"] = held_out()
    metrics = cstorch.amp.scaler_metrics(scaler)
    result["spike_skips"] = metrics.get("num_spike_skips", 0)
    result["overflow_skips"] = metrics["num_skipped_steps"]
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--steps", type=int, default=400)
    parser.add_argument("--bad-step", type=int, default=300)
    parser.add_argument("--factor", type=float, default=300.0)
    args = parser.parse_args()
    runs = {
        "default": None,
        'SpikeSkip(metric="grad_norm")': cstorch.amp.SpikeSkip(metric="grad_norm"),
        'SpikeSkip(metric="loss")': cstorch.amp.SpikeSkip(metric="loss"),
    }
    print(
        "| run | held-out loss before the bad step | just after | 10 steps after | at the end "
        "| spike skips | overflow skips |"
    )
    print("|---|---|---|---|---|---|---|")
    start = time.perf_counter()
    for name, spike_skip in runs.items():
        r = train(spike_skip, args.steps, args.bad_step, args.factor)
        print(
            f"| {name} | {r['before']:.5f} | {r['after']:.5f} | {r['after10']:.5f} | "
            f"{r['end']:.5f} | {r['spike_skips']} | {r['overflow_skips']} |"
        )
    print(f"({time.perf_counter() - start:.0f} s)")


if __name__ == "__main__":
    main()
