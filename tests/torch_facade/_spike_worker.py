"""One rank of the 2-process DDP job of ``test_facade_spike_skip.py``: spike skipping across ranks.

Run as a script::

    python _spike_worker.py OUT_FILE PORT RANK WORLD_SIZE

Each rank joins a gloo job and trains a small MLP under DDP with
``GradScaler(spike_skip=SpikeSkip(metric=...))`` for both metrics, on its half of a global
batch (the mean loss of its rows); at :data:`BAD_STEP` the targets of rank 1's rows only are
multiplied by :data:`FACTOR` (a bad batch on one rank). It pickles what each step decided to
``OUT_FILE``. The test runs :func:`run` in one process on the full batch: the oracle (DDP
averages the ranks' gradients, and the mean of the two halves' mean losses is the full batch's).
"""

from __future__ import annotations

import pickle
import sys
from typing import Any

import torch

STEPS = 12
BAD_STEP = 9
FACTOR = 300.0
BATCH, FEATURES, HIDDEN, OUTPUTS = 8, 6, 16, 3


def batch(step: int, rank: int | None, world: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The global batch of ``step`` (rank ``None``), or rank ``rank``'s rows of it."""
    generator = torch.Generator().manual_seed(100 + step)
    x = torch.randn(BATCH, FEATURES, generator=generator)
    y = torch.randn(BATCH, OUTPUTS, generator=generator)
    if step == BAD_STEP:
        y[BATCH // 2 :] *= FACTOR  # rank 1's rows of a 2-rank job
    if rank is None:
        return x, y
    rows = BATCH // world
    return x[rank * rows : (rank + 1) * rows], y[rank * rows : (rank + 1) * rows]


def run(metric: str, rank: int | None, world: int) -> dict[str, Any]:
    """Trains; returns per step ``(isfinite, global_norm, num_spike_skips)``, the scaler's
    state_dict and the parameters."""
    import torch_facade as cstorch

    torch.manual_seed(0)
    model: torch.nn.Module = torch.nn.Sequential(
        torch.nn.Linear(FEATURES, HIDDEN), torch.nn.Tanh(), torch.nn.Linear(HIDDEN, OUTPUTS)
    )
    if rank is not None:
        model = torch.nn.parallel.DistributedDataParallel(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    scaler = cstorch.amp.GradScaler(
        loss_scale="dynamic",
        init_scale=2.0**8,
        spike_skip=cstorch.amp.SpikeSkip(metric=metric, window=4, sigma=3.0),
    )
    steps = []
    for step in range(STEPS):
        x, y = batch(step, rank, world)
        optimizer.zero_grad()
        scaler.scale((model(x) - y).square().mean()).backward()
        scaler.step(optimizer)
        scaler.update()
        steps.append(
            (
                bool(scaler.get_isfinite()),
                float(scaler.get_global_norm()),
                int(scaler.get_num_spike_skips()),
            )
        )
    return {
        "steps": steps,
        "state": {k: v.clone() for k, v in scaler.state_dict().items()},
        "params": [p.detach().clone() for p in model.parameters()],
    }


def main(out_file: str, port: str, rank: str, world: str) -> None:
    from _ranks import join_gloo

    join_gloo(port, rank, world)
    results = {metric: run(metric, int(rank), int(world)) for metric in ("grad_norm", "loss")}
    with open(out_file, "wb") as out:
        pickle.dump(results, out)
    import torch.distributed as dist

    dist.destroy_process_group()


if __name__ == "__main__":
    main(*sys.argv[1:])
