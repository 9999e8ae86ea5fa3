"""Starts a launch's workers at once, each forked from this process once it has imported theirs.

``python fork_launcher.py SCRIPT MODULE...`` puts ``SCRIPT``'s folder first on the path (as
``python SCRIPT`` does), imports the modules named (the workers' heavy
imports: JAX, flax, optax, orbax... but no JAX backend is started), then reads one JSON line
from standard input: a list of ``{"name", "args", "env", "log"}``. It forks one process per
worker, which takes ``env`` as its whole environment, writes its output to ``log`` and runs
``SCRIPT`` as ``__main__`` with ``args`` (as ``python SCRIPT ARGS...`` would); it answers
``started NAME PID`` for each, then ``ended NAME STATUS`` as each ends (``-9`` once killed with
SIGKILL), and exits once all have.

Each worker starts where a fresh interpreter stands after those imports, without paying them:
what is read at import (``JAX_PLATFORMS``, JAX's compilation cache options) comes from this
process's environment; what is read later (``XLA_FLAGS`` when the CPU backend starts, the
cluster variables in ``jax.distributed.initialize``) from the worker's own.
"""

from __future__ import annotations

import importlib
import json
import os
import sys

from docs_page_server import run_child  # this file's folder is first on the path


def main(script: str, preload: list[str]) -> None:
    """Preloads ``preload``, then forks and watches the workers read from standard input."""
    sys.path.insert(0, os.path.dirname(os.path.abspath(script)))
    for name in preload:
        importlib.import_module(name)
    workers = json.loads(sys.stdin.readline())
    names = {}
    for worker in workers:
        sys.stdout.flush()
        pid = os.fork()
        if pid == 0:
            run_child(script, worker["log"], worker["args"], worker["env"], exit_functions=False)
        names[pid] = worker["name"]
        print(f"started {worker['name']} {pid}", flush=True)
    while names:
        pid, status = os.wait()
        print(f"ended {names.pop(pid)} {os.waitstatus_to_exitcode(status)}", flush=True)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2:])
