"""Section 3: whole iterations under ``DistributedDataParallel``, 2 ranks on the CPU (gloo).

Two processes are spawned; each wraps its own copy of a small model (size ``S`` by default) in
``DistributedDataParallel`` per variant and runs the whole-iteration variants of
:mod:`workbench.whole_loop` (fused AdamW, torch's default ``zero_grad``) interleaved, with the
same fixed number of iterations on both ranks (the all-reduce in every backward keeps them in
step). Rank 0's timings are reported. Each rank uses one torch thread; on a 2-core machine the two
ranks, their XLA threads and gloo share the cores, so the numbers are small and noisy.
"""

from __future__ import annotations

import dataclasses
import datetime
import json
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing
from torch import nn
from torch.multiprocessing.spawn import ProcessException
from torch.nn.parallel import DistributedDataParallel

from workbench import whole_loop
from workbench.processes import free_port
from workbench.sizes import SIZES
from workbench.timing import CompileCounter, FirstStep, Plan, Timing

WORLD_SIZE = 2
OPTIMIZER = "AdamW fused"
"""The optimizer of every DDP variant (the facade's fast path)."""

SET_TO_NONE = True
"""torch's default ``zero_grad``."""

ITERS = 10
"""Iterations per variant and round, on both ranks (fixed: the ranks must agree)."""

PROCESS_GROUP_TIMEOUT_S = 120
"""gloo's timeout for a collective (a rank that died makes the other fail after this)."""

TIMEOUT_S = 300.0
"""The whole section's time limit, start-up included; the ranks are terminated after it."""

FAILURES = (TimeoutError, ProcessException)
"""What :func:`run` raises when a rank fails or the section times out."""


@dataclasses.dataclass(frozen=True)
class DdpSettings:
    """What each rank runs.

    Attributes:
        size: the model's size (a key of :data:`workbench.sizes.SIZES`).
        rounds: timed rounds.
        iters: iterations per variant and round.
        warmup: untimed iterations per variant after its first.
        seed: seeds the model (the same on both ranks) and the tokens (rank added).
    """

    size: str = "S"
    rounds: int = 5
    iters: int = ITERS
    warmup: int = 2
    seed: int = 0


@dataclasses.dataclass
class DdpResult:
    """Rank 0's measurements.

    Attributes:
        settings: what ran.
        group: first iterations, timed rounds and skipped steps of every variant.
        tensors: parameter tensors of the model.
        params: parameters of the model.
        seconds: wall time of the section, start-up included.
    """

    settings: DdpSettings
    group: whole_loop.WholeGroup
    tensors: int
    params: int
    seconds: float


def _group_to_json(group: whole_loop.WholeGroup, workload: whole_loop.Workload) -> dict[str, Any]:
    return {
        "first": {k: dataclasses.asdict(v) for k, v in group.first.items()},
        "timings": {k: dataclasses.asdict(v) for k, v in group.timings.items()},
        "skipped_steps": group.skipped_steps,
        "tensors": workload.tensors,
        "params": workload.params,
    }


def _rank_main(rank: int, settings: DdpSettings, port: int, out: str) -> None:
    """One rank: join the gloo group, measure the variants, rank 0 writes ``out`` (JSON)."""
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=WORLD_SIZE,
        timeout=datetime.timedelta(seconds=PROCESS_GROUP_TIMEOUT_S),
    )
    try:
        spec = SIZES[settings.size]
        workload = whole_loop.make_workload(spec, settings.seed, token_seed=settings.seed + rank)
        plan = Plan(settings.rounds, settings.iters, settings.warmup, fixed_iters=True)
        counter = CompileCounter()
        with counter.listening():
            group = whole_loop.run_group(
                workload,
                OPTIMIZER,
                SET_TO_NONE,
                plan,
                counter,
                wrap=_ddp,
                variants=whole_loop.VARIANTS,
            )
        if rank == 0:
            Path(out).write_text(json.dumps(_group_to_json(group, workload)))
        dist.barrier()
    finally:
        dist.destroy_process_group()


def _ddp(module: nn.Module) -> nn.Module:
    return DistributedDataParallel(module)


def _join(context: torch.multiprocessing.ProcessContext, timeout_s: float) -> None:
    """Waits for every rank; raises ``TimeoutError`` (after terminating them) past the limit."""
    deadline = time.monotonic() + timeout_s
    while not context.join(timeout=max(0.1, deadline - time.monotonic())):
        if time.monotonic() >= deadline:
            for process in context.processes:
                if process.is_alive():
                    process.terminate()
                    process.join(5.0)
            raise TimeoutError(f"the DDP ranks did not finish within {timeout_s:.0f} s")


def _load(path: Path, settings: DdpSettings, seconds: float) -> DdpResult:
    data = json.loads(path.read_text())
    group = whole_loop.WholeGroup(
        OPTIMIZER,
        SET_TO_NONE,
        {k: FirstStep(**v) for k, v in data["first"].items()},
        {k: Timing(**v) for k, v in data["timings"].items()},
        data["skipped_steps"],
    )
    return DdpResult(settings, group, data["tensors"], data["params"], seconds)


def run(settings: DdpSettings, timeout_s: float = TIMEOUT_S) -> DdpResult:
    """Spawns the two ranks on a free loopback port and returns rank 0's measurements.

    Args:
        settings: model size, rounds, iterations and warm-up.
        timeout_s: time limit for the whole section.

    Raises:
        TimeoutError: the ranks took longer than ``timeout_s``.
        torch.multiprocessing.ProcessRaisedException: a rank raised (its traceback is included).
        torch.multiprocessing.ProcessExitedException: a rank died.
    """
    started = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="ddp_bench_") as folder:
        out = Path(folder) / "rank0.json"
        context = torch.multiprocessing.start_processes(
            _rank_main,
            args=(settings, free_port(), str(out)),
            nprocs=WORLD_SIZE,
            join=False,
            start_method="spawn",
        )
        _join(context, timeout_s)
        return _load(out, settings, time.perf_counter() - started)
