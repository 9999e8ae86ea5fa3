"""Kill a training run with SIGKILL at a chosen step, for both front doors' resume tests.

A worker script runs the training loop as a child process: ``WORKER DIR STOP_AT``. After each
step it appends a line ``step value...`` to ``DIR/progress.txt``; on ``STOP_AT`` it waits to be
killed. The parent starts it, waits until the line of the chosen step is written, and kills it.

:class:`ForkedRuns` does the same with each run in a process forked from one that has imported
the worker's heavy modules (``tests/forked_python.py``): a fresh process for the run (nothing
computed, compiled or restored before its first line), without paying the imports each time.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterable
from pathlib import Path

from tests.forked_python import ForkedPython

REPO = Path(__file__).resolve().parents[1]
TIMEOUT = 180.0


def start(worker: Path, directory: Path, stop_at: int) -> subprocess.Popen[bytes]:
    """Starts ``worker`` on CPU in a fresh interpreter (repo and the worker's folder importable)."""
    environment = {k: v for k, v in os.environ.items() if not k.startswith("XLA_PYTHON_CLIENT")}
    path = os.pathsep.join([str(REPO), str(worker.parent)])
    environment.update(JAX_PLATFORMS="cpu", PYTHONPATH=path)
    return subprocess.Popen(
        [sys.executable, str(worker), str(directory), str(stop_at)],
        cwd=REPO,
        env=environment,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )


def finish(process: subprocess.Popen[bytes]) -> None:
    """Waits for a run that goes to its end; it must exit cleanly."""
    _, stderr = process.communicate(timeout=TIMEOUT)
    assert process.returncode == 0, stderr.decode()[-3000:]


def progress(directory: Path) -> list[tuple[int, tuple[float, ...]]]:
    """The steps written so far, each with its values (a line still being written left out)."""
    path = directory / "progress.txt"
    if not path.exists():
        return []
    complete = [line.split() for line in path.read_text().split("\n")[:-1]]
    return [(int(step), tuple(float(v) for v in values)) for step, *values in complete]


def kill_at(worker: Path, directory: Path, step: int) -> None:
    """Starts a run, waits until it has finished ``step``, and kills it with SIGKILL."""
    process = start(worker, directory, step)
    deadline = time.monotonic() + TIMEOUT
    try:
        while step not in [s for s, _ in progress(directory)]:
            if process.poll() is not None:
                _, stderr = process.communicate()
                raise AssertionError(f"the run ended before step {step}: {stderr.decode()[-3000:]}")
            assert time.monotonic() < deadline, f"the run never reached step {step}"
            time.sleep(0.05)
    finally:
        if process.poll() is None:
            os.kill(process.pid, signal.SIGKILL)
        process.communicate(timeout=30)
    assert process.returncode == -signal.SIGKILL


class ForkedRuns:
    """``start``/``finish``/``kill_at`` for one worker, each run forked from one server that has
    imported ``preload`` (the worker's own imports) on CPU, with the worker's folder importable.
    """

    def __init__(self, worker: Path, workdir: Path, preload: Iterable[str], **env: str) -> None:
        path = os.pathsep.join([str(REPO), str(worker.parent)])
        self._worker = worker
        self._server = ForkedPython(workdir, preload, JAX_PLATFORMS="cpu", PYTHONPATH=path, **env)

    def _submit(self, directory: Path, stop_at: int) -> None:
        code = f"import runpy\nrunpy.run_path({str(self._worker)!r}, run_name='__main__')\n"
        self._server.submit(code, TIMEOUT, argv=[str(directory), str(stop_at)])

    def finish(self, directory: Path) -> None:
        """Runs the worker to its end in ``directory``; it must exit cleanly."""
        self._submit(directory, -1)
        status, output = self._server.outcome()
        assert status == 0, output[-3000:]

    def kill_at(self, directory: Path, step: int) -> None:
        """Starts a run, waits until it has finished ``step``, and kills it with SIGKILL."""
        self._submit(directory, step)
        deadline = time.monotonic() + TIMEOUT
        try:
            while step not in [s for s, _ in progress(directory)]:
                if self._server.ended(0.05):
                    _, output = self._server.outcome()
                    raise AssertionError(f"the run ended before step {step}: {output[-3000:]}")
                assert time.monotonic() < deadline, f"the run never reached step {step}"
        finally:
            if self._server.pending:
                self._server.kill()
                status, output = self._server.outcome()
        assert status == -signal.SIGKILL, (status, output[-3000:])

    def close(self) -> None:
        """Ends the server."""
        self._server.close()
