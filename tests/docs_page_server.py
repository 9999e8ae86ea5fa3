"""Runs scripts one at a time, each in a fresh process forked from this preloaded one.

``python tests/docs_page_server.py MODULE ...`` imports the modules named (the heavy, shared
ones: jax, optax, torch, ...), prints ``ready`` and then, for each line ``SCRIPT<TAB>OUTPUT
<TAB>TIMEOUT_S`` read from standard input, forks: the child runs ``SCRIPT`` as ``__main__``
(as ``python SCRIPT`` would, in a fresh namespace), with its standard output and error in
``OUTPUT``, and exits; this process answers with a line ``STATUS<TAB>CPU_S``: the child's exit
status (124 after a timeout) and the CPU seconds it used. End of input ends it.

Nothing but imports has run in this process when it forks, so each script starts from the state
a fresh interpreter would reach after importing those modules, without paying for the imports:
``tests/test_docs_pages.py`` runs every docs page this way (about 2.5 s of CPU saved per page
that imports torch).
"""

from __future__ import annotations

import atexit
import importlib
import os
import runpy
import signal
import sys
import time
import traceback


def run_child(
    script: str,
    output: str,
    args: list[str] | None = None,
    env: dict[str, str] | None = None,
    exit_functions: bool = True,
) -> None:
    """In a forked child: runs ``script`` as ``__main__`` with ``args`` (in ``env``, as its whole
    environment, if given) and its output in ``output``, then exits with its status; never
    returns. ``exit_functions``: run what the interpreter would run at exit (temporary dirs,
    ...). Also the workers' runner of ``tests/fork_launcher.py``."""
    fd = os.open(output, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    if env is not None:
        os.environ.clear()
        os.environ.update(env)
    sys.argv = [script, *(args or [])]
    code = 0
    try:
        runpy.run_path(script, run_name="__main__")
    except SystemExit as exit_:
        code = exit_.code if isinstance(exit_.code, int) else (0 if exit_.code is None else 1)
    except BaseException:
        traceback.print_exc()
        code = 1
    try:
        if exit_functions:
            atexit._run_exitfuncs()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def _wait(pid: int, timeout_s: float) -> tuple[int, float]:
    """The child's exit status (124 once killed after ``timeout_s``) and its CPU seconds."""
    deadline = time.monotonic() + timeout_s
    while True:
        done, status, usage = os.wait4(pid, os.WNOHANG)
        if done:
            return os.waitstatus_to_exitcode(status), usage.ru_utime + usage.ru_stime
        if time.monotonic() > deadline:
            os.kill(pid, signal.SIGKILL)
            _, _, usage = os.wait4(pid, 0)
            return 124, usage.ru_utime + usage.ru_stime
        time.sleep(0.02)


def main(preload: list[str]) -> None:
    """Preloads ``preload``, then serves scripts read from standard input until it closes."""
    for name in preload:
        importlib.import_module(name)
    print("ready", flush=True)
    for line in sys.stdin:
        script, output, timeout_s = line.rstrip("\n").split("\t")
        sys.stdout.flush()
        pid = os.fork()
        if pid == 0:
            run_child(script, output)
        status, cpu_s = _wait(pid, float(timeout_s))
        print(f"{status}\t{cpu_s:.2f}", flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
