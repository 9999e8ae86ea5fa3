"""Registry of demo paths: a path name maps to a function that trains and returns records.

A path is a function ``run(problem: Problem, options: RunOptions) -> list[RunRecord]``. The JAX
path registers itself when :mod:`demo.jax_path` is imported. Optional paths (the torch facade)
live in their own module, listed in :data:`OPTIONAL_PATH_MODULES`; that module calls
:func:`register_path` at import time, and if importing it fails (for example because
``torch_facade`` is missing) the path is reported as unavailable and ``--path all`` skips it.

To add a path, write a module like :mod:`demo.torch_path` and list it in
:data:`OPTIONAL_PATH_MODULES`; ``--path``, the table and the plots then need no changes.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable

from demo.problem import Problem, RunOptions
from demo.records import RunRecord

PathRunner = Callable[[Problem, RunOptions], list[RunRecord]]
"""The signature of a demo path: ``run(problem, options) -> list[RunRecord]``."""

PATHS: dict[str, PathRunner] = {}
"""The registered paths, in registration order (``--path all`` runs them in this order)."""

OPTIONAL_PATH_MODULES: dict[str, str] = {"torch": "demo.torch_path"}
"""Paths that may be missing, and the module whose import registers each."""

KNOWN_PATHS: tuple[str, ...] = ("jax", *OPTIONAL_PATH_MODULES)
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
    """Imports the built-in and optional path modules so that they register themselves.

    Returns:
        For every known path that is not available, the reason (an import error message).
    """
    import demo.jax_path  # noqa: F401  (registers "jax")

    unavailable: dict[str, str] = {}
    for name, module in OPTIONAL_PATH_MODULES.items():
        if name in PATHS:
            continue
        try:
            importlib.import_module(module)
        except ImportError as err:
            unavailable[name] = f"{type(err).__name__}: {err}"
            continue
        if name not in PATHS:
            unavailable[name] = f"{module} was imported but did not register {name!r}"
    return unavailable
