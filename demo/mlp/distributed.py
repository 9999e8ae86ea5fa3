"""``python -m demo --distributed``: the torch path's training, data-parallel over 2 ranks.

The same problem, model and loop as :mod:`demo.mlp.torch_model` (float16 compute, Adam,
``cstorch.amp.GradScaler(loss_scale="dynamic")``), run by a ``torch.distributed`` job on the CPU
(gloo): every rank trains on its half of each step's batch, with its gradients averaged

* by ``DistributedDataParallel`` (``"torch DDP fp16 + DLS"``, and a float32 run without
  scaling as the reference), and
* by FSDP2, ``torch.distributed.fsdp.fully_shard`` (``"torch FSDP2 fp16 + DLS"``): each rank
  keeps half of every parameter, gradient and Adam moment.

The scaler needs nothing distributed-specific: it finds the job itself and takes one overflow
decision per step for all ranks, so every rank skips the same steps with the same scale. The
loss of a step is the mean over the whole batch (the ranks' losses averaged). Rank 0 prints the
same table as ``make demo`` and saves a plot; the last line says whether the ranks agreed on
every decision.

Launch it with ``torchrun --nproc-per-node 2 -m demo --distributed`` (any number of ranks that
divides the batch), or with ``python -m demo --distributed``, which starts 2 local ranks itself.

Each rank's backward pass sees half as many rows as one process's, so a float16 cotangent per
row is twice as large (the loss is a mean over fewer rows): the distributed runs can overflow at
half the scale of the one-process torch path, and their scale trajectory may differ from it.
"""

from __future__ import annotations

import dataclasses
import datetime
import os
import socket
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from tqdm.auto import tqdm

import torch_facade as cstorch
from demo.mlp.problem import Problem, RunOptions, make_problem
from demo.mlp.records import RunRecord
from demo.mlp.report import comparison_lines, plot_records, summary_table
from demo.mlp.torch_model import DemoMLP, mse

DEFAULT_RANKS = 2
TIMEOUT = datetime.timedelta(seconds=120)


def _rows(problem: Problem, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's contiguous share of the rows of ``step``'s batch."""
    x, y = problem.batch(step)
    rank, world = dist.get_rank(), dist.get_world_size()
    share = len(x) // world
    part = slice(rank * share, (rank + 1) * share)
    return torch.from_numpy(x[part]), torch.from_numpy(y[part])


def _global_mean(value: torch.Tensor) -> float:
    """The mean of a scalar over the ranks (the full-batch loss, from each rank's half)."""
    total = value.detach().float().reshape(1).clone()
    dist.all_reduce(total)
    return float(total) / dist.get_world_size()


def _wrap_ddp(model: DemoMLP) -> torch.nn.Module:
    return torch.nn.parallel.DistributedDataParallel(model)


def _wrap_fsdp2(model: DemoMLP) -> torch.nn.Module:
    from torch.distributed.fsdp import fully_shard

    return fully_shard(model)  # DemoMLP reads its layers' parameters itself: one group


def _full_loss(model: torch.nn.Module, problem: Problem) -> float:
    """The float32 loss of the final parameters on the whole data set (called on every rank)."""
    with torch.no_grad():
        outputs = model(torch.from_numpy(problem.x), dtype=torch.float32)
        return float(mse(outputs, torch.from_numpy(problem.y)))


def _train(
    name: str,
    wrap: Callable[[DemoMLP], torch.nn.Module],
    problem: Problem,
    options: RunOptions,
    half: torch.dtype | None,
) -> RunRecord:
    """Trains one wrapped model; ``half`` selects float16 compute with DLS (else float32).

    Returns:
        The run's record (the same on every rank).
    """
    start = time.perf_counter()
    model = wrap(DemoMLP(problem.init_params, compute_dtype=half or torch.float32))
    optimizer = torch.optim.Adam(model.parameters(), lr=problem.learning_rate)
    scaler = None
    if half is not None:
        settings = dataclasses.asdict(problem.scaler)
        scaler = cstorch.amp.GradScaler(loss_scale="dynamic", **settings)
    losses: list[float] = []
    scales: list[float] = []
    finite: list[bool] = []
    show = options.progress and dist.get_rank() == 0
    for step in tqdm(range(problem.steps), desc=name, disable=not show, unit="step"):
        x, y = _rows(problem, step)
        optimizer.zero_grad()
        loss = mse(model(x), y)
        if scaler is None:
            loss.backward()
            optimizer.step()
        else:
            scales.append(float(scaler.get_scale()))
            scaler.scale(loss).backward()
            scaler.unscale_(optimizer)
            scaler.step(optimizer)
            scaler.update()
            finite.append(bool(scaler.get_isfinite()))
        losses.append(_global_mean(loss))
    scaled = scaler is not None
    return RunRecord(
        name=name,
        path="torch distributed",
        losses=np.asarray(losses),
        overflow=~np.asarray(finite if scaled else [True] * problem.steps, bool),
        final_loss=_full_loss(model, problem),
        scales=np.asarray(scales) if scaled else None,
        final_scale=float(scaler.get_scale()) if scaled else None,
        num_skipped_steps=int(scaler.get_num_skipped_steps()) if scaled else None,
        wall_time_s=time.perf_counter() - start,
    )


def _ranks_agree(records: list[RunRecord]) -> bool:
    """Whether every rank recorded the same skips, scales and losses (one all-gather)."""
    mine = np.concatenate(
        [np.concatenate([r.overflow, r.all_scales, r.losses]).astype(np.float64) for r in records]
    )
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, mine.tobytes())
    return all(g == gathered[0] for g in gathered)


def train_distributed(problem: Problem, options: RunOptions) -> tuple[list[RunRecord], bool]:
    """The distributed runs of ``problem`` in an initialized job, on every rank.

    Returns:
        The records (DDP fp16 + DLS, FSDP2 fp16 + DLS, DDP float32) and whether all ranks
        recorded the same numbers.
    """
    saved = cstorch.amp.get_half_dtype_str(), cstorch.amp.mixed_precision()
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as the torch path: tiny tensors, and ranks share the cores
    try:
        half = cstorch.amp.set_half_dtype("float16")
        records = [
            _train("torch DDP fp16 + DLS", _wrap_ddp, problem, options, half),
            _train("torch FSDP2 fp16 + DLS", _wrap_fsdp2, problem, options, half),
            _train("torch DDP float32", _wrap_ddp, problem, options, None),
        ]
    finally:
        torch.set_num_threads(threads)
        cstorch.amp.set_half_dtype(saved[0])
        cstorch.amp.enable_mixed_precision(saved[1])
    return records, _ranks_agree(records)


def _rank_main(steps: int, seed: int, out_dir: Path, options: RunOptions) -> None:
    """One rank: trains, and on rank 0 prints the report and saves the plot."""
    problem = make_problem(steps=steps, seed=seed)
    records, agreed = train_distributed(problem, options)
    if dist.get_rank() != 0:
        return
    world = dist.get_world_size()
    print()
    print(summary_table(records))
    print()
    for line in comparison_lines(records):
        print(line)
    title = f"torch, {world} ranks: float16 + dynamic loss scaling vs float32 ({steps} steps)"
    plot = plot_records(records, out_dir / "distributed_demo.png", title=title)
    print(f"plot saved to {os.path.relpath(plot) if not plot.is_absolute() else plot}")
    verdict = "yes" if agreed else "NO"
    print(f"all {world} ranks took the same decisions (skips, scales, losses): {verdict}")
    sys.stdout.flush()


def _spawned_rank(rank: int, world: int, port: int, arguments: tuple[Any, ...]) -> None:
    """The entry point of a rank started by :func:`run`."""
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world, timeout=TIMEOUT
    )
    try:
        _rank_main(*arguments)
    finally:
        dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def run(steps: int, seed: int, out_dir: Path, options: RunOptions) -> int:
    """``python -m demo --distributed``: under torchrun, this process is one rank of its job;
    otherwise it starts :data:`DEFAULT_RANKS` local ranks (spawned processes) and waits.

    Returns:
        The process exit status.
    """
    arguments = (steps, seed, out_dir, options)
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:  # started by torchrun
        dist.init_process_group("gloo", timeout=TIMEOUT)
        try:
            _rank_main(*arguments)
        finally:
            dist.destroy_process_group()
        return 0
    print(f"Starting {DEFAULT_RANKS} local ranks (gloo)", flush=True)
    torch.multiprocessing.start_processes(
        _spawned_rank,
        args=(DEFAULT_RANKS, _free_port(), arguments),
        nprocs=DEFAULT_RANKS,
        start_method="spawn",
    )
    return 0
