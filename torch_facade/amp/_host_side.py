"""The facade's one boundary with ``torch.compile``: host-side entry points run eagerly.

The facade's work per iteration is host-side: gradients cross into JAX through DLPack, a jitted
JAX core runs, the host reads a flag. None of it can be traced by dynamo (it would trace into
JAX and fail), and none of it should be: it is one call into an already compiled XLA
executable. So every public entry point that does such work is marked :func:`host_side` here,
once, at the boundary: called from ``torch.compile``'d code, dynamo ends its graph at the call
(a graph break), runs the entry point as ordinary Python with dynamo off for everything it
calls, and resumes tracing after it. Called eagerly, the mark costs about a microsecond.

What stays traceable (plain tensor arithmetic and reads of configuration) is left unmarked, so
that it becomes part of the user's graph: ``get_scale``, the half-dtype getters, ``autocast``
and the casting decorators. ``GradScaler.scale`` is marked although its result is one multiply:
it also starts the iteration (stage checks, restores, first-iteration discovery), and its break
sits next to the one ``.backward()`` makes anyway. ``docs/pytorch/compile.md``'s table lists
each entry point and why.
"""

from __future__ import annotations

import inspect
import os
from collections.abc import Callable
from typing import Any, TypeVar, cast

import torch

__all__ = ["WRAPPER_DIR", "host_side"]

F = TypeVar("F", bound=Callable[..., Any])

REASON = (
    "cstorch.amp: host-side work (DLPack, a jitted JAX call, a host read) runs eagerly "
    "behind a graph break"
)
"""What dynamo reports as the graph break's reason (``TORCH_LOGS=graph_breaks``)."""

_TAKES_REASON = "reason" in inspect.signature(torch.compiler.disable).parameters


def host_side(fn: F) -> F:
    """Marks a public entry point whose work is host-side: dynamo never traces into it.

    ``torch.compiler.disable(fn)`` (recursive: nothing ``fn`` calls is traced either), with the
    facade's reason for the graph break. ``fn``'s name, docstring and signature are kept.

    Example:
        >>> import torch
        >>> from torch_facade.amp._host_side import host_side
        >>> @host_side
        ... def host_sum(x):
        ...     return float(x.sum())  # a host read: a graph break in compiled code
        >>> host_sum(torch.ones(3))
        3.0
    """
    if _TAKES_REASON:
        disabled = torch.compiler.disable(fn, reason=REASON)
    else:  # torch before 2.7
        disabled = torch.compiler.disable(fn)
    return cast(F, disabled)


WRAPPER_DIR = os.path.dirname(os.path.abspath(host_side(lambda: None).__code__.co_filename))
"""Where the frames of :func:`host_side`'s wrappers live (torch's dynamo package): a facade
warning skips them to point at the user's code (:mod:`~torch_facade.amp._caller`)."""
