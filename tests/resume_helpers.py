"""Kill a training run with SIGKILL at a chosen step, for both front doors' resume tests.

A worker script runs the training loop as a child process: ``WORKER DIR STOP_AT``. After each
step it appends a line ``step value...`` to ``DIR/progress.txt``; on ``STOP_AT`` it waits to be
killed. The parent starts it, waits until the line of the chosen step is written, and kills it.

Each run is a process forked from one that has imported the worker's heavy modules
(:class:`ForkedRuns`, over ``tests/forked_python.py``): a fresh process for the run (nothing
computed, compiled or restored before its first line), without paying the imports each time.
"""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Iterable
from pathlib import Path

from tests.forked_python import ForkedPython

REPO = Path(__file__).resolve().parents[1]
TIMEOUT = 180.0


def progress(directory: Path) -> list[tuple[int, tuple[float, ...]]]:
    """The steps written so far, each with its values (a line still being written left out)."""
    path = directory / "progress.txt"
    if not path.exists():
        return []
    complete = [line.split() for line in path.read_text().split("\n")[:-1]]
    return [(int(step), tuple(float(v) for v in values)) for step, *values in complete]


class ForkedRuns:
    """Runs of one worker, each forked from one server that has imported ``preload`` (the
    worker's own imports) on CPU, with the worker's folder importable; ``env`` is added to the
    server's environment (read at import: JAX's options)."""

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
