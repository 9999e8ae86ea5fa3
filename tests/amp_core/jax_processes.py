"""Start the JAX worker processes of the multi-process tests, and compare what they wrote.

Every worker runs as ``python SCRIPT ARGS...`` on the CPU with its own forced host device
count, this repository importable, and no cluster variable inherited from the environment the
suite runs in (a CI job under SLURM or MPI must not steer the workers). :func:`run_workers`
starts a whole launch at once and watches it: the first worker that fails ends the launch (the
others are killed), so a broken job ends in seconds with every worker's log, and none outlives
the deadline.
"""

from __future__ import annotations

import dataclasses
import signal
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from pathlib import Path

import numpy as np

from tests.forked_python import ForkedWorker, ForkLauncher
from workbench.processes import REPO_ROOT, repo_environment

DEVICE_COUNT_FLAG = "--xla_force_host_platform_device_count"
# Variables through which jax.distributed.initialize() finds a cluster by itself.
CLUSTER_VARIABLES = ("SLURM_", "OMPI_", "PMI_", "JAX_COORDINATOR_", "JAX_LOCAL_DEVICE_IDS")


def shared_compilation_cache(folder: Path) -> dict[str, str]:
    """The environment that gives JAX processes one persistent compilation cache in ``folder``,
    every compiled program kept (runs of one worker compile the same programs)."""
    return {
        "JAX_COMPILATION_CACHE_DIR": str(folder),
        "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0",
        "JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES": "0",
    }


@dataclasses.dataclass(frozen=True)
class Worker:
    """One process of a launch.

    Attributes:
        name: names its log (``<name>.log``) and its line in a failure report.
        args: the script's arguments.
        host_devices: the CPU devices its JAX sees.
        env: variables added to its environment.
        ready_file: set for a worker that must be killed: once every such worker of the launch
            has written its ready file, they are all killed with SIGKILL (the last started
            first, so that process 0, which hosts the coordinator, goes last). A worker with a
            ready file that exits by itself fails the launch.
    """

    name: str
    args: Sequence[str]
    host_devices: int
    env: Mapping[str, str] = dataclasses.field(default_factory=dict)
    ready_file: Path | None = None


def worker_environment(host_devices: int, extra: Mapping[str, str]) -> dict[str, str]:
    """This environment with ``host_devices`` CPU devices, the repository first on the path,
    no cluster variables, and ``extra``."""
    env = {
        key: value
        for key, value in repo_environment().items()
        if not key.startswith(CLUSTER_VARIABLES)
    }
    flags = [f for f in env.get("XLA_FLAGS", "").split() if not f.startswith(DEVICE_COUNT_FLAG)]
    env["XLA_FLAGS"] = " ".join([*flags, f"{DEVICE_COUNT_FLAG}={host_devices}"])
    env["JAX_PLATFORMS"] = "cpu"
    env.update(extra)
    return env


def run_workers(
    script: Path,
    workers: Sequence[Worker],
    log_dir: Path,
    timeout_s: float,
    preload: Sequence[str] = (),
) -> dict[str, int]:
    """Starts every worker at once and waits until each has exited or been killed.

    Args:
        script: the worker script.
        workers: the launch.
        log_dir: where each worker's stdout and stderr go.
        timeout_s: the deadline for the whole launch.
        preload: modules to import once: each worker is then forked from a process that has
            imported them (``tests/fork_launcher.py``) instead of starting a fresh interpreter.
            Variables read at import (``JAX_*`` options) must be the same for every worker.

    Returns:
        name -> exit status (``-9`` for the workers killed at their ready file).

    Raises:
        AssertionError: a worker failed, or the launch passed its deadline; with the tail of
            every worker's log.
    """
    procs: dict[str, subprocess.Popen[bytes] | ForkedWorker] = {}
    to_kill = [w for w in workers if w.ready_file is not None]
    must_be_killed = {w.name for w in to_kill}
    killed: set[str] = set()
    problem = ""
    launcher = None
    if preload:
        first = dict(workers[0].env)
        shared = {k: v for k, v in first.items() if all(w.env.get(k) == v for w in workers)}
        specs = [
            {
                "name": w.name,
                "args": list(w.args),
                "env": worker_environment(w.host_devices, w.env),
                "log": str(log_dir / f"{w.name}.log"),
            }
            for w in workers
        ]
        launcher = ForkLauncher(script, specs, preload, worker_environment(1, shared))
    try:
        for worker in workers:
            if launcher is not None:
                procs[worker.name] = ForkedWorker(launcher, worker.name)
                continue
            with open(log_dir / f"{worker.name}.log", "wb") as log:
                procs[worker.name] = subprocess.Popen(
                    [sys.executable, str(script), *worker.args],
                    env=worker_environment(worker.host_devices, worker.env),
                    cwd=REPO_ROOT,
                    stdout=log,
                    stderr=subprocess.STDOUT,
                )
        deadline = time.monotonic() + timeout_s
        while not problem:
            codes = {name: proc.poll() for name, proc in procs.items()}
            failed = [
                name
                for name, code in codes.items()
                if code is not None and name not in killed and (code != 0 or name in must_be_killed)
            ]
            if failed:
                problem = f"failed: {failed}"
            elif to_kill and all(w.ready_file and w.ready_file.exists() for w in to_kill):
                for worker in reversed(to_kill):
                    procs[worker.name].send_signal(signal.SIGKILL)
                    procs[worker.name].wait()
                    killed.add(worker.name)
                to_kill = []
            elif all(code is not None for code in codes.values()):
                break
            elif time.monotonic() > deadline:
                problem = f"still running after {timeout_s} s"
            else:
                time.sleep(0.1)
    finally:
        for proc in procs.values():
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        if launcher is not None:
            launcher.close()
    if problem:
        tails = "\n".join(
            f"--- {name} (exit {proc.returncode}) ---\n"
            f"{(log_dir / f'{name}.log').read_text(errors='replace')[-3000:]}"
            for name, proc in procs.items()
        )
        raise AssertionError(f"launch {problem}\n{tails}")
    return {name: int(proc.returncode) for name, proc in procs.items()}  # type: ignore[arg-type]


def assert_same_bits(actual: np.ndarray, expected: np.ndarray, key: str) -> None:
    """Same dtype, shape and bytes, except that any NaN equals any NaN.

    NaN payloads are not compared: gloo's all-reduce keeps the payload of a NaN that started in
    float16, XLA's in-process all-reduce returns the default NaN.
    """
    assert actual.dtype == expected.dtype, key
    assert actual.shape == expected.shape, key
    if np.issubdtype(actual.dtype, np.floating):
        nan = np.isnan(actual)
        np.testing.assert_array_equal(nan, np.isnan(expected), err_msg=key)
        actual, expected = actual[~nan], expected[~nan]
    assert actual.tobytes() == expected.tobytes(), f"{key}: {actual} != {expected}"
