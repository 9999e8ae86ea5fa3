"""Fresh Python processes without paying the imports: forked from one that has imported them.

:class:`ForkedPython` keeps one ``tests/docs_page_server.py`` running that has imported the
modules it was given (torch, JAX, the facade, flax...) and nothing else. Each script then runs in
a process forked from it: the state a fresh interpreter reaches after those imports (no JAX
backend started, nothing compiled or traced, no torch module beyond the imported ones), without
the 3-4 s of CPU the imports cost each time. The scripts run one at a time.

Environment variables given to a script are set in ``os.environ`` before its first line: right
for what is read when it is used (the JAX memory settings, the facade's cache folder, ``HOME``),
not for what an import reads (those go to the server's own environment).

:class:`ForkLauncher` does the same for processes that must run at once (the ranks of a job):
``tests/fork_launcher.py`` imports their modules, then forks all of them; each
:class:`ForkedWorker` is watched and killed as a ``subprocess.Popen`` child would be.
"""

from __future__ import annotations

import contextlib
import json
import os
import select
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterable
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
SERVER = REPO / "tests" / "docs_page_server.py"
# What ``import torch_facade`` loads (torch, JAX, amp_core), for scripts that use the facade.
FACADE = ("json", "os", "sys", "torch", "jax", "jax._src.xla_bridge", "torch_facade")


def fresh_environment(**env: str) -> dict[str, str]:
    """The caller's environment without its JAX memory settings, plus ``env``."""
    environment = {k: v for k, v in os.environ.items() if not k.startswith("XLA_PYTHON_CLIENT")}
    environment.pop("XLA_CLIENT_MEM_FRACTION", None)
    environment.update(env)
    environment.setdefault("PYTHONPATH", str(REPO))
    return environment


def last_json(output: str) -> Any:
    """The last line of ``output`` that is a JSON object or list (what a script printed last)."""
    for line in reversed(output.strip().splitlines()):
        with contextlib.suppress(ValueError):
            document = json.loads(line)
            if isinstance(document, (dict, list)):
                return document
    raise AssertionError(f"no JSON line in the script's output:\n{output[-3000:]}")


class ForkedPython:
    """A server of forked Python processes, each starting right after ``preload``'s imports.

    Args:
        workdir: where the scripts and their outputs are written.
        preload: the modules the server imports before it forks.
        env: the server's environment: the caller's without its JAX memory settings, plus this.
    """

    def __init__(self, workdir: Path, preload: Iterable[str] = FACADE, **env: str) -> None:
        self._workdir = workdir
        self._runs = 0
        self._pending: Path | None = None
        self._pid_file: Path | None = None
        self._server = subprocess.Popen(
            [sys.executable, str(SERVER), *preload],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            cwd=REPO,
            env=fresh_environment(**env),
        )
        assert self._server.stdout is not None
        ready = self._server.stdout.readline().strip()
        assert ready == "ready", f"the server did not start: {ready!r}"

    def submit(self, code: str, timeout: float = 120, argv: Iterable[str] = (), **env: str) -> None:
        """Starts ``code`` in a forked process, ``sys.argv[1:]`` being ``argv`` and ``env`` set
        in its environment; :meth:`outcome` waits for it (one script at a time)."""
        assert self._pending is None, "the previous script's outcome was not read"
        self._runs += 1
        script = self._workdir / f"script_{self._runs}.py"
        self._pending = self._workdir / f"output_{self._runs}.txt"
        self._pid_file = self._workdir / f"pid_{self._runs}"
        prelude = (
            f"import os, sys\nos.environ.update({env!r})\nsys.argv[1:] = {list(argv)!r}\n"
            f"with open({str(self._pid_file)!r} + '.tmp', 'w') as pid_file:\n"
            "    pid_file.write(str(os.getpid()))\n"
            f"os.replace({str(self._pid_file)!r} + '.tmp', {str(self._pid_file)!r})\n"
        )
        script.write_text(prelude + code)
        assert self._server.stdin is not None
        self._server.stdin.write(f"{script}\t{self._pending}\t{timeout}\n")
        self._server.stdin.flush()

    @property
    def pending(self) -> bool:
        """Whether a submitted script's outcome has not been read yet."""
        return self._pending is not None

    def ended(self, wait_s: float) -> bool:
        """Whether the submitted script has ended, waiting up to ``wait_s`` seconds for it."""
        assert self._pending is not None and self._server.stdout is not None
        readable, _, _ = select.select([self._server.stdout], [], [], wait_s)
        return bool(readable)

    def kill(self, timeout: float = 60) -> None:
        """Kills the submitted script's process with SIGKILL (once it has started)."""
        assert self._pid_file is not None
        deadline = time.monotonic() + timeout
        while not self._pid_file.exists():
            assert time.monotonic() < deadline, "the script never started"
            time.sleep(0.02)
        os.kill(int(self._pid_file.read_text()), signal.SIGKILL)

    def outcome(self) -> tuple[int, str]:
        """Waits for the submitted script: its exit status (``-9`` once killed with SIGKILL,
        124 after its timeout) and its output (standard output and error together)."""
        assert self._pending is not None and self._server.stdout is not None
        answer = self._server.stdout.readline()
        assert answer, "the server ended"
        output, self._pending = self._pending, None
        return int(answer.split("\t")[0]), output.read_text()

    def run(self, code: str, timeout: float = 120, **env: str) -> Any:
        """Runs ``code`` (``env`` set) to its end; it must exit cleanly. Returns the last JSON
        line it printed, as ``run_python`` in ``facade_helpers`` does for a fresh interpreter."""
        self.submit(code, timeout, **env)
        status, output = self.outcome()
        assert status == 0, f"exit status {status}:\n{output[-3000:]}"
        return last_json(output)

    def close(self) -> None:
        """Ends the server (the end of its input)."""
        assert self._server.stdin is not None
        self._server.stdin.close()
        self._server.wait(timeout=60)


LAUNCHER = REPO / "tests" / "fork_launcher.py"


class ForkLauncher:
    """``tests/fork_launcher.py`` running one launch: workers forked at once from a process that
    has imported ``preload``; which worker has which pid, which has ended with which status.

    Args:
        script: what each worker runs as ``__main__``.
        workers: one ``{"name", "args", "env", "log"}`` per worker (``env``: its whole
            environment; ``log``: its output).
        preload: the modules the launcher imports before it forks.
        env: the launcher's environment (what the workers' imports read).
    """

    def __init__(
        self,
        script: Path,
        workers: list[dict[str, Any]],
        preload: Iterable[str],
        env: dict[str, str],
    ) -> None:
        self.pids: dict[str, int] = {}
        self.codes: dict[str, int] = {}
        for worker in workers:  # there to read even if the launcher fails before it forks
            Path(worker["log"]).touch()
        self.proc = subprocess.Popen(
            [sys.executable, str(LAUNCHER), str(script), *preload],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            env=env,
            cwd=REPO,
        )
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps(workers) + "\n")
        self.proc.stdin.close()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            event, name, value = line.split()
            (self.pids if event == "started" else self.codes)[name] = int(value)

    def close(self) -> None:
        """Waits for the launcher (it ends once every worker has)."""
        self.proc.wait(timeout=60)


class ForkedWorker:
    """One worker of a :class:`ForkLauncher`, seen as ``subprocess.Popen`` sees a child."""

    def __init__(self, launcher: ForkLauncher, name: str) -> None:
        self._launcher, self.name = launcher, name

    @property
    def launcher(self) -> ForkLauncher:
        """The launch it belongs to."""
        return self._launcher

    @property
    def returncode(self) -> int | None:
        """Its exit status (``-9`` once killed with SIGKILL); ``None`` while it runs."""
        return self._launcher.codes.get(self.name)

    def poll(self) -> int | None:
        """Its exit status, or ``None`` while it runs (1 if the launcher itself failed)."""
        if self.returncode is None and self._launcher.proc.poll() not in (None, 0):
            self._launcher.codes[self.name] = 1
        return self.returncode

    def send_signal(self, sig: int) -> None:
        """Sends ``sig`` to it once it has started, unless it has ended."""
        deadline = time.monotonic() + 60
        while self.name not in self._launcher.pids and self.poll() is None:
            assert time.monotonic() < deadline, f"{self.name} never started"
            time.sleep(0.01)
        if self.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self._launcher.pids[self.name], sig)

    def kill(self) -> None:
        """Kills it with SIGKILL."""
        self.send_signal(signal.SIGKILL)

    def wait(self) -> int:
        """Waits until it has ended; its exit status."""
        deadline = time.monotonic() + 60
        while self.poll() is None:
            assert time.monotonic() < deadline, f"{self.name} did not end"
            time.sleep(0.01)
        return int(self.returncode or 0)
