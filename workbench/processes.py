"""Helpers for the processes the rooms start and the command lines they read: a free port, an
environment that imports this repository, a comma-separated list of names."""

from __future__ import annotations

import argparse
import os
import socket
from collections.abc import Sequence
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
"""The repository's root: the folder that holds the library and the rooms."""


def free_port() -> int:
    """A TCP port on the loopback interface that nothing listened on a moment ago (the OS
    picks it).

    Example:
        >>> from workbench.processes import free_port
        >>> 0 < free_port() < 65536
        True
    """
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def repo_environment(**extra: str) -> dict[str, str]:
    """This process's environment with :data:`REPO_ROOT` first on ``PYTHONPATH``, plus ``extra``.

    A child started with it imports this repository's library and rooms, wherever it runs.

    Example:
        >>> from workbench.processes import REPO_ROOT, repo_environment
        >>> env = repo_environment(OMP_NUM_THREADS="1")
        >>> env["PYTHONPATH"].split(os.pathsep)[0] == str(REPO_ROOT), env["OMP_NUM_THREADS"]
        (True, '1')
    """
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(REPO_ROOT), env.get("PYTHONPATH", "")]).rstrip(
        os.pathsep
    )
    env.update(extra)
    return env


def comma_names(text: str, known: Sequence[str], what: str) -> tuple[str, ...]:
    """A comma-separated list of names among ``known`` (an ``argparse`` type's body).

    Raises:
        argparse.ArgumentTypeError: a name is not in ``known``, or ``text`` names none.

    Example:
        >>> from workbench.processes import comma_names
        >>> comma_names("S, M", ("S", "M", "L"), "sizes")
        ('S', 'M')
    """
    names = tuple(s.strip() for s in text.split(",") if s.strip())
    unknown = [s for s in names if s not in known]
    if unknown or not names:
        raise argparse.ArgumentTypeError(
            f"unknown {what} {unknown or text!r}; choose from {', '.join(known)}"
        )
    return names
