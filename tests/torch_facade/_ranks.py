"""Starting and waiting for the ranks of a CPU gloo job (one process per rank, JAX on the CPU).

Shared by the tests that run a worker script as ``WORLD`` processes (``test_distributed.py``,
``test_hsdp.py``, ``test_facade_accumulation.py``, ``test_facade_spike_skip.py``,
``test_skip_aware.py``). A worker takes ``out_file port rank world`` on its command line and
joins the group with :func:`join_gloo` (its folder is first on its ``sys.path``). The ranks are
forked from one process that has imported their heavy modules (``tests/fork_launcher.py``).
"""

from __future__ import annotations

import os
import time
from datetime import timedelta
from pathlib import Path
from typing import TYPE_CHECKING

from workbench.processes import free_port

if TYPE_CHECKING:  # the ranks import this module too, without the tests package
    from tests.forked_python import ForkedWorker

COLLECTIVE_TIMEOUT = timedelta(seconds=60)
"""A collective that waits longer fails the rank."""


def join_gloo(port: str, rank: str, world: str) -> None:
    """The worker's side: one torch thread, and this rank in a gloo group on the loopback."""
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=int(rank),
        world_size=int(world),
        timeout=COLLECTIVE_TIMEOUT,
    )


PRELOAD = ("numpy", "torch", "torch.distributed", "jax", "jax._src.xla_bridge", "torch_facade")
"""What every rank imports before its own code: imported once by the launcher the ranks are
forked from, instead of once per rank (about 3 CPU-seconds each)."""


def start_ranks(
    worker: Path, out: Path, world: int, extra_env: dict[str, str] | None = None
) -> list[ForkedWorker]:
    """Starts every rank of ``worker`` (one torch thread each), forked at once from a process
    that has imported :data:`PRELOAD` (``tests/fork_launcher.py``); rank ``r`` pickles its result
    to ``out / f"rank{r}.pkl"`` and logs to ``out / f"rank{r}.log"``. ``extra_env``: more
    environment variables for the ranks (read when used, not at import)."""
    from tests.forked_python import ForkedWorker, ForkLauncher

    repo_root = worker.parents[2]
    env = dict(os.environ, JAX_PLATFORMS="cpu", OMP_NUM_THREADS="1")
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(repo_root), env.get("PYTHONPATH")]))
    port = str(free_port())
    workers = [
        {
            "name": f"rank{rank}",
            "args": [str(out / f"rank{rank}.pkl"), port, str(rank), str(world)],
            "env": dict(env, **(extra_env or {})),
            "log": str(out / f"rank{rank}.log"),
        }
        for rank in range(world)
    ]
    launcher = ForkLauncher(worker, workers, PRELOAD, env)
    return [ForkedWorker(launcher, f"rank{rank}") for rank in range(world)]


def wait_for_ranks(procs: list[ForkedWorker], out: Path, deadline: float) -> None:
    """Waits for every rank; on a failure or at ``deadline`` (``time.monotonic()``), kills the
    rest and fails.

    Raises:
        AssertionError: with the tail of each failed rank's log.
    """
    try:
        while any(p.poll() is None for p in procs):
            failed = any(p.poll() not in (None, 0) for p in procs)
            if failed or time.monotonic() > deadline:
                break
            time.sleep(0.1)
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        for launcher in {id(proc.launcher): proc.launcher for proc in procs}.values():
            launcher.close()
    codes = [p.returncode for p in procs]
    if any(codes):
        tails = "\n".join(
            f"--- rank {rank} (exit {code}) ---\n{(out / f'rank{rank}.log').read_text()[-3000:]}"
            for rank, code in enumerate(codes)
        )
        raise AssertionError(f"ranks failed or ran past their deadline:\n{tails}")
