"""One rank of a DDP job started by torchrun, for ``test_torchrun.py``.

Run under torchrun (``python -m torch.distributed.run [torchrun options] _torchrun_worker.py
OUT_DIR [--kill]``): the rank, world size and rendezvous come from torchrun's environment
(``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``/``MASTER_PORT``, ``TORCHELASTIC_RESTART_COUNT``).

Every rank trains the MLP of ``_distributed_worker.py`` (its ``"ddp"`` case: Adam, the facade's
``GradScaler(loss_scale="dynamic")`` from ``2**8``, growing after 2 + 1 clean steps) on its
contiguous share of each step's global batch of ``BATCH`` rows, for :data:`STEPS` steps. At the
steps of :data:`FAULTS` one rank alone writes an inf into its own gradient *after* the backward
pass, that is after DDP's all-reduce, so only that rank holds a non-finite gradient: every rank
must skip that step. The test runs :func:`train` with ``rank=None`` in its own process on the
whole batch: that is the one-process oracle.

Rank 0 saves a checkpoint (model, optimizer and scaler state dicts) after every :data:`EVERY`
steps, atomically (a temporary file, then ``os.replace``), and every rank resumes from it when
it exists at start. With ``--kill``, rank :data:`KILL_RANK` SIGKILLs itself after step
:data:`KILL_AFTER` in the first attempt (``TORCHELASTIC_RESTART_COUNT == 0``); torchrun
(``--max-restarts 1``) then stops the survivors and starts the group again, which resumes from
the checkpoint written after step ``KILL_AFTER - 1``.

A world size that does not divide ``BATCH`` is refused on every rank: each prints one line and
waits at a barrier until every rank has printed it (torchrun stops the other ranks at the first
exit), then exits with status 2.

Each rank appends its events (``start MASTER_PORT PID``, ``step N``, ``kill N``) with a time to
``OUT_DIR/events.txt`` and saves its result with ``torch.save`` to ``OUT_DIR/rank{RANK}.pt``.
"""

from __future__ import annotations

import math
import os
import signal
import sys
import time
from pathlib import Path
from typing import Any

import _distributed_worker as base
import numpy as np
import torch

STEPS = 8
BATCH = base.BATCH
FAULTS = {2: -1, 6: 0}
"""Step -> the rank (an index into the ranks: -1 is the last) that plants an inf after the
all-reduce: one overflow before the kill, one after it."""
EVERY = 2
"""Rank 0 checkpoints after steps 1, 3, 5 and 7."""
KILL_RANK, KILL_AFTER = 1, 4
"""With ``--kill``: the rank that SIGKILLs itself after this step in the first attempt."""
CASE = base.CASES["ddp"]
ENVIRONMENT = (
    "RANK",
    "LOCAL_RANK",
    "GROUP_RANK",
    "WORLD_SIZE",
    "LOCAL_WORLD_SIZE",
    "MASTER_ADDR",
    "TORCHELASTIC_RESTART_COUNT",
    "TORCHELASTIC_MAX_RESTARTS",
)


def fault_rank(step: int, world: int) -> int | None:
    """The rank that plants the inf at ``step`` (``None``: no fault at this step)."""
    if step not in FAULTS:
        return None
    return range(world)[FAULTS[step]]


def rows_of(rank: int, world: int) -> slice:
    """The contiguous rows of the global batch that ``rank`` of ``world`` trains on."""
    share = BATCH // world
    return slice(rank * share, (rank + 1) * share)


def log_event(directory: Path, rank: int, attempt: int, event: str) -> None:
    """Appends ``time attempt rank event`` to ``directory/events.txt`` (one short write)."""
    with open(directory / "events.txt", "a") as events:
        events.write(f"{time.time():.6f} {attempt} {rank} {event}\n")


def save_atomically(value: Any, path: Path) -> None:
    """``torch.save`` to a temporary file beside ``path``, then ``os.replace`` onto it: a reader
    (or a restart after a kill) sees the previous file or the new one, never a partial one."""
    temporary = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    torch.save(value, temporary)
    os.replace(temporary, path)


def snapshot(
    model: torch.nn.Module, optimizer: torch.optim.Optimizer, scaler: Any
) -> dict[str, Any]:
    """Copies of the model's, the optimizer's and the scaler's state dicts."""
    return {
        "model": {k: v.detach().clone() for k, v in model.state_dict().items()},
        "optimizer": optimizer.state_dict(),
        "scaler": scaler.state_dict(),
    }


def train(
    rank: int | None,
    world: int = 1,
    directory: Path | None = None,
    attempt: int = 0,
    kill: bool = False,
) -> dict[str, Any]:
    """Trains as ``rank`` of a DDP job of ``world`` ranks, or in one process (``rank=None``).

    Args:
        rank: this rank (a process group of ``world`` ranks is initialized), or ``None``: one
            process on the whole batch, planting every fault itself.
        world: the number of ranks.
        directory: where the checkpoint and the events go (ranks only).
        attempt: torchrun's restart count.
        kill: SIGKILL rank :data:`KILL_RANK` after step :data:`KILL_AFTER` in attempt 0.

    Returns:
        ``steps`` (the steps this attempt ran), per step ``isfinite``, ``local_finite`` (this
        rank's own gradients were finite, checked with ``torch.isfinite``), ``unchanged`` (this
        rank's parameters and optimizer state kept every bit), the scaler's ``state_dict``
        values (``state.<key>``) and ``params`` (flat float32 after the step); ``resumed_from``
        (the checkpoint's step, or ``None``) and ``final`` (the state dicts at the end).
    """
    from torch.nn.parallel import DistributedDataParallel

    model = base.MLP()
    optimizer = base.OPTIMIZERS[CASE.optimizer](model.parameters())
    scaler = base.new_scaler(CASE)
    checkpoint = None if directory is None else directory / "ckpt.pt"
    first, resumed_from = 0, None
    if checkpoint is not None and checkpoint.exists():
        saved = torch.load(checkpoint, weights_only=True)
        model.load_state_dict(saved["model"])
        optimizer.load_state_dict(saved["optimizer"])
        scaler.load_state_dict(saved["scaler"])
        first = resumed_from = saved["step"] + 1
    wrapped = model if rank is None else DistributedDataParallel(model)
    params = list(model.parameters())
    rows = slice(None) if rank is None else rows_of(rank, world)
    record: dict[str, list[Any]] = {"steps": []}

    def add(key: str, value: Any) -> None:
        record.setdefault(key, []).append(value)

    for step in range(first, STEPS):
        optimizer.zero_grad()
        x, y = base.global_batch(step, CASE)
        scaler.scale(base.mse(wrapped(x[rows]), y[rows])).backward()
        if fault_rank(step, world) is not None and rank in (None, fault_rank(step, world)):
            base.inject_fault(params[0], math.inf, sharded=False)  # after DDP's all-reduce
        add("local_finite", all(bool(torch.isfinite(p.grad).all()) for p in params))
        before = base.local_bits(model, optimizer)
        scaler.unscale_(optimizer)
        scaler.step(optimizer)
        scaler.update()
        add("steps", step)
        add("isfinite", bool(scaler.get_isfinite()))
        add("unchanged", before == base.local_bits(model, optimizer))
        for key, value in scaler.state_dict().items():
            add(f"state.{key}", value.numpy().copy())
        add("params", base.flat(params))
        if directory is None or rank is None:
            continue
        if (step + 1) % EVERY == 0:
            if rank == 0:
                save_atomically({"step": step, **snapshot(model, optimizer, scaler)}, checkpoint)
            torch.distributed.barrier()  # the checkpoint is complete before any rank goes on
        log_event(directory, rank, attempt, f"step {step}")
        if kill and attempt == 0 and rank == KILL_RANK and step == KILL_AFTER:
            log_event(directory, rank, attempt, f"kill {step}")
            os.kill(os.getpid(), signal.SIGKILL)
    result: dict[str, Any] = {k: np.asarray(v) for k, v in record.items()}
    result["resumed_from"] = resumed_from
    result["final"] = snapshot(model, optimizer, scaler)
    return result


def refuse_uneven_batch(rank: int, world: int) -> None:
    """Where ``world`` does not divide :data:`BATCH`: every rank prints why, waits until all
    have, and exits with status 2 (no rank trains, none is left waiting in a collective)."""
    if BATCH % world == 0:
        return
    # One write a line: under an unbuffered stderr, print() writes the text and the newline
    # apart, and the ranks' lines in one log interleaved (seen once in the suite).
    sys.stderr.write(
        f"rank {rank}: WORLD_SIZE={world} does not divide the global batch of {BATCH} rows; "
        "start a world size that divides it\n"
    )
    sys.stderr.flush()
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()
    os._exit(2)


def main(out_dir: str, *flags: str) -> None:
    """Joins torchrun's gloo group, trains, and saves this rank's result."""
    import torch.distributed as dist
    from _ranks import COLLECTIVE_TIMEOUT

    directory = Path(out_dir)
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    attempt = int(os.environ["TORCHELASTIC_RESTART_COUNT"])
    torch.set_num_threads(1)
    log_event(directory, rank, attempt, f"start {os.environ['MASTER_PORT']} {os.getpid()}")
    dist.init_process_group("gloo", timeout=COLLECTIVE_TIMEOUT)  # env:// from torchrun
    refuse_uneven_batch(rank, world)
    result = train(rank, world, directory, attempt, kill="--kill" in flags)
    result["environment"] = {key: os.environ.get(key) for key in ENVIRONMENT}
    dist.barrier()
    dist.destroy_process_group()
    save_atomically(result, directory / f"rank{rank}.pt")
    print(f"rank {rank} of {world} (attempt {attempt}): done", flush=True)
    os._exit(0)  # skip interpreter teardown (gloo and XLA threads): the result is written


if __name__ == "__main__":
    main(*sys.argv[1:])
