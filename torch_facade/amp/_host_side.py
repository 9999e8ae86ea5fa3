"""The facade's one boundary with ``torch.compile``: host-side entry points run eagerly.

The facade's work per iteration is host-side: gradients cross into JAX through DLPack, a jitted
JAX core runs, the host reads a flag. None of it can be traced by dynamo (it would trace into
JAX and fail), and none of it should be: it is one call into an already compiled XLA
executable. So every public entry point that does such work is marked :func:`host_side` here,
once, at the boundary: called from ``torch.compile``'d code, dynamo ends its graph at the call
(a graph break), runs the entry point as ordinary Python with dynamo off for everything it
calls, and resumes tracing after it. Called eagerly, the mark costs well under a microsecond.

What stays traceable (plain tensor arithmetic and reads of configuration) is left unmarked, so
that it becomes part of the user's graph: ``get_scale``, the half-dtype getters, ``autocast``
and the casting decorators. ``GradScaler.scale`` is marked although its result is one multiply:
it also starts the iteration (stage checks, restores, first-iteration discovery), and its break
sits next to the one ``.backward()`` makes anyway. ``docs/pytorch/compile.md``'s table lists
each entry point and why.

Why not ``torch.compiler.disable`` at import: it imports ``torch._dynamo`` (with sympy and
torch.fx's symbolic shapes), 1.3-1.9 s of every start on a 2-core machine, for a user who may
never compile anything. The mark is made in two halves instead, and only the second needs dynamo:

* for dynamo's tracer, the wrapper carries the attributes ``torch.compiler.disable`` sets
  (``_torchdynamo_disable`` and its reason): dynamo refuses to trace into it and breaks the
  graph at the call, with :data:`REASON`;
* at run time, the wrapper calls the function directly while ``torch._dynamo`` is not imported
  (then nothing can be compiling), and otherwise the ``torch.compiler.disable``'d function,
  made on first use: the same wrapper, dynamo off for everything the entry point calls. The
  wrapper's own frame is marked for dynamo's frame evaluator to skip (the flag
  ``torch._dynamo.skip_code`` sets, through ``torch._C``), so that the call after a graph break
  is not traced as a frame of its own.

Where the private ``torch._C`` names it needs are missing (another torch), the mark falls back
to ``torch.compiler.disable`` at import, as before.
"""

from __future__ import annotations

import functools
import inspect
import os
import sys
import types
from collections.abc import Callable
from typing import Any, NamedTuple, TypeVar, cast

import torch

__all__ = ["REASON", "WRAPPER_DIR", "host_side"]

F = TypeVar("F", bound=Callable[..., Any])

REASON = (
    "cstorch.amp: host-side work (DLPack, a jitted JAX call, a host read) runs eagerly "
    "behind a graph break"
)
"""What dynamo reports as the graph break's reason (``TORCH_LOGS=graph_breaks``)."""

_TAKES_REASON = "reason" in inspect.signature(torch.compiler.disable).parameters


def _torch_disable(fn: F) -> F:
    """``torch.compiler.disable(fn)`` with the facade's reason (imports ``torch._dynamo``)."""
    if _TAKES_REASON:
        return cast(F, torch.compiler.disable(fn, reason=REASON))
    return cast(F, torch.compiler.disable(fn))  # torch before 2.7


class _FrameControls(NamedTuple):
    """The two calls into dynamo's frame evaluator (``torch._C``, no ``torch._dynamo``)."""

    skip_frames_of: Callable[[types.CodeType], None]  # what ``torch._dynamo.skip_code`` does
    set_eval_frame: Callable[[Any], Any]  # the callback swap ``torch.compiler.disable`` makes


def _frame_controls() -> _FrameControls | None:
    """The frame evaluator's calls, or ``None`` where this torch lacks the private names."""
    try:
        from torch._C._dynamo import eval_frame
    except ImportError:
        return None
    names = ("set_code_exec_strategy", "_FrameExecStrategy", "_FrameAction", "set_eval_frame")
    if not all(hasattr(eval_frame, name) for name in names):
        return None
    action = eval_frame._FrameAction
    if not (hasattr(action, "SKIP") and hasattr(action, "DEFAULT")):
        return None
    strategy = eval_frame._FrameExecStrategy(action.SKIP, action.DEFAULT)
    return _FrameControls(
        skip_frames_of=lambda code: eval_frame.set_code_exec_strategy(code, strategy),
        set_eval_frame=eval_frame.set_eval_frame,
    )


_CONTROLS = _frame_controls()


def _lazy_disable(fn: F) -> F:
    """The lazy mark: ``fn`` itself until ``torch._dynamo`` is imported, then the
    ``torch.compiler.disable``'d ``fn``; dynamo's tracer sees a disabled function either way."""
    disabled: list[F] = []  # made on the first call once torch._dynamo is imported

    @functools.wraps(fn)
    def host_side_entry(*args: Any, **kwargs: Any) -> Any:
        if "torch._dynamo" not in sys.modules:
            return fn(*args, **kwargs)  # nothing can be compiling
        if not disabled:  # once, with dynamo's frame evaluator off (it would trace the making)
            set_eval_frame = cast(_FrameControls, _CONTROLS).set_eval_frame
            prior = set_eval_frame(None)
            try:
                disabled.append(_torch_disable(fn))
            finally:
                set_eval_frame(prior)
        return disabled[0](*args, **kwargs)

    entry = cast(Any, host_side_entry)
    entry._torchdynamo_disable = True  # dynamo's tracer: do not inline, break the graph here
    entry._torchdynamo_disable_msg = REASON
    entry._torchdynamo_disable_recursive = True
    entry._torchdynamo_orig_callable = fn
    return cast(F, entry)


if _CONTROLS is not None:
    # Every wrapper shares this one code object: one mark covers them all.
    _CONTROLS.skip_frames_of(_lazy_disable(lambda: None).__code__)


def host_side(fn: F) -> F:
    """Marks a public entry point whose work is host-side: dynamo never traces into it.

    Under ``torch.compile`` it is ``torch.compiler.disable(fn)`` (recursive: nothing ``fn``
    calls is traced either), with the facade's reason for the graph break. ``torch._dynamo`` is
    imported only once user code has imported it (to compile something): until then the mark
    is a plain call. ``fn``'s name, docstring and signature are kept.

    Example:
        >>> import torch
        >>> from torch_facade.amp._host_side import host_side
        >>> @host_side
        ... def host_sum(x):
        ...     return float(x.sum())  # a host read: a graph break in compiled code
        >>> host_sum(torch.ones(3))
        3.0
    """
    if _CONTROLS is None:
        return _torch_disable(fn)
    return _lazy_disable(fn)


WRAPPER_DIR = os.path.join(os.path.dirname(os.path.abspath(torch.__file__)), "_dynamo")
"""Where the frames of ``torch.compiler.disable``'s wrappers live (torch's dynamo package): a
facade warning skips them to point at the user's code (:mod:`~torch_facade.amp._caller`). The
lazy wrapper's own frame is in this package, which a warning skips anyway."""
