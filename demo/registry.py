"""Registry of demo paths: a path name maps to a function that trains and returns records.

A path is a function ``run(problem: Problem, options: RunOptions) -> list[RunRecord]`` in a
module of its own, named in :data:`PATH_RUNNERS` as ``"module:function"``. :func:`load_paths`
imports them; the path modules do not import this one (no import cycle). An optional path whose
module fails to import (the torch facade, if ``torch_facade`` is missing) is reported as
unavailable and ``--path all`` skips it.

To add a path, write a module like :mod:`demo.torch_path` and list it in :data:`PATH_RUNNERS`
(or call :func:`register_path`); ``--path``, the table and the plots then need no changes.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable

from demo.problem import Problem, RunOptions
from demo.records import RunRecord

PathRunner = Callable[[Problem, RunOptions], list[RunRecord]]
"""The signature of a demo path: ``run(problem, options) -> list[RunRecord]``."""

PATHS: dict[str, PathRunner] = {}
"""The loaded paths, in registration order (``--path all`` runs them in this order)."""

PATH_RUNNERS: dict[str, str] = {
    "jax": "demo.jax_path:run_jax_path",
    "torch": "demo.torch_path:run_torch_path",
}
"""Every built-in path, as ``"module:function"``."""

OPTIONAL_PATHS: frozenset[str] = frozenset({"torch"})
"""Paths that may be missing (their module's import may fail)."""

KNOWN_PATHS: tuple[str, ...] = tuple(PATH_RUNNERS)
"""Every path name the command line accepts."""


def register_path(name: str, runner: PathRunner) -> PathRunner:
    """Registers ``runner`` under ``name`` (replacing an earlier registration of that name).

    Args:
        name: the ``--path`` value that selects it.
        runner: ``run(problem, options) -> list[RunRecord]``.

    Returns:
        ``runner`` itself, so that this can be used as a plain call or wrapped as a decorator.
    """
    PATHS[name] = runner
    return runner


def load_paths() -> dict[str, str]:
    """Imports the path modules and registers their runners.

    Returns:
        For every optional path that is not available, the reason (an import error message).

    Raises:
        ImportError: a path that is not optional could not be imported.
    """
    unavailable: dict[str, str] = {}
    for name, target in PATH_RUNNERS.items():
        if name in PATHS:
            continue
        module_name, _, function = target.partition(":")
        try:
            module = importlib.import_module(module_name)
        except ImportError as err:
            if name not in OPTIONAL_PATHS:
                raise
            unavailable[name] = f"{type(err).__name__}: {err}"
            continue
        register_path(name, getattr(module, function))
    return unavailable
