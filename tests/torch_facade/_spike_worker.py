"""One rank of the 2-process job of ``test_facade_spike_skip.py``: spike skipping across ranks.

Run as a script::

    python _spike_worker.py OUT_FILE PORT RANK WORLD_SIZE

Each rank joins a gloo job and trains a small MLP under each wrapper of :data:`WRAPPERS` (DDP,
and FSDP2's ``fully_shard`` on every layer and the root) with
``GradScaler(spike_skip=SpikeSkip(metric=...))`` for both metrics, on its half of a global
batch (the mean loss of its rows); at :data:`BAD_STEP` the targets of rank 1's rows only are
multiplied by :data:`FACTOR` (a bad batch on one rank). It pickles what each step decided to
``OUT_FILE``. The test runs :func:`run` in one process on the full batch: the oracle (DDP and
FSDP2 on gloo average the ranks' gradients, and the mean of the two halves' mean losses is the
full batch's).
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
METRICS = ("grad_norm", "loss")
WRAPPERS = ("ddp", "fsdp2")


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


def mlp() -> torch.nn.Sequential:
    """The model, its parameters drawn from seed 0."""
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Linear(FEATURES, HIDDEN), torch.nn.Tanh(), torch.nn.Linear(HIDDEN, OUTPUTS)
    )


def wrap(model: torch.nn.Sequential, wrapper: str) -> torch.nn.Module:
    """``model`` under DDP, or under FSDP2 (each ``Linear`` sharded on its own, then the root)."""
    if wrapper == "ddp":
        return torch.nn.parallel.DistributedDataParallel(model)
    from torch.distributed.fsdp import fully_shard

    for layer in model:
        if isinstance(layer, torch.nn.Linear):
            fully_shard(layer)
    return fully_shard(model)


def whole(tensor: torch.Tensor) -> torch.Tensor:
    """The whole tensor (an FSDP2 shard is gathered: every rank calls this in the same order)."""
    full_tensor = getattr(tensor, "full_tensor", None)
    return tensor if full_tensor is None else full_tensor()


def run(metric: str, rank: int | None, world: int, wrapper: str = "ddp") -> dict[str, Any]:
    """Trains (under ``wrapper`` when ``rank`` is given); returns per step ``(isfinite,
    global_norm, num_spike_skips)``, the scaler's state_dict and the whole parameters."""
    import torch_facade as cstorch

    model = mlp() if rank is None else wrap(mlp(), wrapper)
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
        "params": [whole(p.detach()).clone() for p in model.parameters()],
        "sharded": [hasattr(p, "full_tensor") for p in model.parameters()],  # DTensors
    }


DISAGREEMENTS: dict[str, dict[str, Any]] = {
    "agree": {},
    "spike_window": {"spike_window": torch.full((4,), 2.0)},
    "spike_applied": {"spike_applied": 3},
    "absorbed_overflows": {"absorbed_overflows": 1},
}
"""What rank 1 loads into its scaler before one joint step, by check (rank 0 loads nothing)."""


def disagreements(rank: int, world: int) -> dict[str, str]:
    """One DDP step per check of :data:`DISAGREEMENTS`, with a scaler that has hysteresis and a
    spike window: ``"ok"``, or what the step raised."""
    import torch_facade as cstorch

    found = {}
    for name, change in DISAGREEMENTS.items():
        model = wrap(mlp(), "ddp")
        optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
        scaler = cstorch.amp.GradScaler(
            loss_scale="dynamic",
            init_scale=2.0**8,
            hysteresis=2,
            spike_skip=cstorch.amp.SpikeSkip(window=4, sigma=3.0),
        )
        if rank == 1:
            scaler.load_state_dict(change)
        x, y = batch(0, rank, world)
        try:
            scaler.scale((model(x) - y).square().mean()).backward()
            scaler.step(optimizer)
            scaler.update()
            found[name] = "ok"
        except RuntimeError as error:
            found[name] = f"RuntimeError: {error}"
    return found


def main(out_file: str, port: str, rank: str, world: str) -> None:
    from _ranks import join_gloo

    join_gloo(port, rank, world)
    results = {
        "runs": {
            (wrapper, metric): run(metric, int(rank), int(world), wrapper)
            for wrapper in WRAPPERS
            for metric in METRICS
        },
        "disagreements": disagreements(int(rank), int(world)),
    }
    with open(out_file, "wb") as out:
        pickle.dump(results, out)
    import torch.distributed as dist

    dist.destroy_process_group()


if __name__ == "__main__":
    main(*sys.argv[1:])
