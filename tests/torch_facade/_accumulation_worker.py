"""torch's gradient accumulation loop, shared by ``test_facade_accumulation.py`` and its 2-rank job.

One linear model (4 -> 2, float32) trains for ``STEPS`` accumulated steps of ``K`` micro-batches
with torch's documented loop: ``scaler.scale(loss / K).backward()`` K times, then
``scaler.step(optimizer)``, ``scaler.update()``, ``optimizer.zero_grad()``. The losses of the
micro-batches in ``POISONED`` are multiplied by inf. The same scenario runs through the facade
(``cstorch.amp.GradScaler``), through ``torch.amp.GradScaler``, and, run as a script by the
test, as a 2-rank gloo job whose model is wrapped in DDP and whose first K - 1 backward passes
run under ``no_sync()``; the poisoned micro-batches are then poisoned on rank 0 only.

Usage as a script: ``python _accumulation_worker.py OUT_FILE PORT RANK WORLD``.
"""

from __future__ import annotations

import contextlib
import os
import pickle
import sys
from typing import Any

import numpy as np
import torch
from _ranks import join_gloo

K = 4  # micro-batches per accumulated step
STEPS = 4  # accumulated steps
BATCH, IN, OUT = 8, 4, 2
LR = 0.1
INIT_SCALE = 1024.0
STEPS_PER_INCREASE = 1  # torch's growth_interval = steps_per_increase + 1
_RNG = np.random.default_rng(33)
XS = _RNG.standard_normal((STEPS * K, BATCH, IN)).astype(np.float32)
YS = _RNG.standard_normal((STEPS * K, BATCH, OUT)).astype(np.float32)
W0 = (_RNG.standard_normal((IN, OUT)) * 0.5).astype(np.float32)
B0 = (_RNG.standard_normal((OUT,)) * 0.1).astype(np.float32)
POISONED = (1, 14)  # micro-batches whose loss is multiplied by inf: in steps 0 and 3
POISON = np.array([np.inf if i in POISONED else 1.0 for i in range(STEPS * K)], np.float32)


def new_model() -> torch.nn.Linear:
    model = torch.nn.Linear(IN, OUT)
    with torch.no_grad():
        model.weight.copy_(torch.from_numpy(W0.T.copy()))
        model.bias.copy_(torch.from_numpy(B0))
    return model


def new_scaler(kind: str) -> Any:
    if kind == "facade":
        import torch_facade as cstorch

        return cstorch.amp.GradScaler(
            loss_scale="dynamic", init_scale=INIT_SCALE, steps_per_increase=STEPS_PER_INCREASE
        )
    return torch.amp.GradScaler(
        "cpu",
        init_scale=INIT_SCALE,
        growth_factor=2.0,
        backoff_factor=0.5,
        growth_interval=STEPS_PER_INCREASE + 1,
    )


def train(kind: str, rank: int | None = None, world: int = 1) -> dict[str, list[Any]]:
    """Runs the scenario; returns per accumulated step the scale used and after, and (W, b).

    ``rank`` set: this process is one rank of a ``world``-rank job (DDP, ``no_sync()``), fed
    its share of every micro-batch's rows.
    """
    model: torch.nn.Module = new_model()
    linear = model
    if rank is not None:
        model = torch.nn.parallel.DistributedDataParallel(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    scaler = new_scaler(kind)
    rows = (
        slice(None) if rank is None else slice(rank * BATCH // world, (rank + 1) * BATCH // world)
    )
    record: dict[str, list[Any]] = {"scale_used": [], "scale_after": [], "w": [], "b": []}
    for step in range(STEPS):
        record["scale_used"].append(float(scaler.get_scale()))
        for i in range(step * K, (step + 1) * K):
            x, y = torch.from_numpy(XS[i][rows]), torch.from_numpy(YS[i][rows])
            poison = float(POISON[i]) if rank in (None, 0) else 1.0
            last = i == (step + 1) * K - 1
            sync = contextlib.nullcontext() if rank is None or last else model.no_sync()
            with sync:
                loss = torch.mean((model(x) - y) ** 2) * poison / K
                scaler.scale(loss).backward()
        scaler.step(optimizer)
        scaler.update()
        optimizer.zero_grad()
        record["scale_after"].append(float(scaler.get_scale()))
        record["w"].append(linear.weight.detach().numpy().T.copy())
        record["b"].append(linear.bias.detach().numpy().copy())
    if kind == "facade":
        record["num_skipped_steps"] = [int(scaler.get_num_skipped_steps())]
    return record


def main(out_file: str, port: str, rank: str, world: str) -> None:
    """One rank of the job: the facade's run under DDP with ``no_sync()``; pickles the record."""
    import torch.distributed as dist

    join_gloo(port, rank, world)
    record = train("facade", int(rank), int(world))
    dist.barrier()
    dist.destroy_process_group()
    with open(out_file, "wb") as out:
        pickle.dump(record, out)
    os._exit(0)  # skip interpreter teardown (gloo and XLA threads): the record is written


if __name__ == "__main__":
    main(*sys.argv[1:])
