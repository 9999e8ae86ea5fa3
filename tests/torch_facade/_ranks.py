"""Starting and waiting for the ranks of a CPU gloo job (one process per rank, JAX on the CPU).

Shared by the tests that run a worker script as ``WORLD`` processes: ``test_distributed.py`` and
``test_facade_accumulation.py``. A worker takes ``out_file port rank world`` on its command line
and joins the group with :func:`join_gloo` (its folder is first on its ``sys.path``).
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from datetime import timedelta
from pathlib import Path

from workbench.processes import free_port

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


def start_ranks(
    worker: Path, out: Path, world: int, extra_env: dict[str, str] | None = None
) -> list[subprocess.Popen[bytes]]:
    """Starts every rank of ``worker`` (one torch thread each); rank ``r`` pickles its result
    to ``out / f"rank{r}.pkl"`` and logs to ``out / f"rank{r}.log"``. ``extra_env``: more
    environment variables for the ranks."""
    repo_root = worker.parents[2]
    env = dict(os.environ, JAX_PLATFORMS="cpu", OMP_NUM_THREADS="1", **(extra_env or {}))
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(repo_root), env.get("PYTHONPATH")]))
    port = str(free_port())
    procs = []
    for rank in range(world):
        with open(out / f"rank{rank}.log", "wb") as log:
            command = [sys.executable, str(worker), str(out / f"rank{rank}.pkl"), port]
            procs.append(
                subprocess.Popen(
                    [*command, str(rank), str(world)],
                    env=env,
                    cwd=repo_root,
                    stdout=log,
                    stderr=subprocess.STDOUT,
                )
            )
    return procs


def wait_for_ranks(procs: list[subprocess.Popen[bytes]], out: Path, deadline: float) -> None:
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
    codes = [p.returncode for p in procs]
    if any(codes):
        tails = "\n".join(
            f"--- rank {rank} (exit {code}) ---\n{(out / f'rank{rank}.log').read_text()[-3000:]}"
            for rank, code in enumerate(codes)
        )
        raise AssertionError(f"ranks failed or ran past their deadline:\n{tails}")
