"""Where a facade warning should point: the first frame outside the ``torch_facade`` package
(and outside the wrappers that :func:`~torch_facade.amp._host_side.host_side` adds)."""

from __future__ import annotations

import os
import sys
import types

from torch_facade.amp._host_side import WRAPPER_DIR

_PACKAGE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def stacklevel(also_skip: tuple[str, ...] = ()) -> int:
    """The ``warnings.warn`` ``stacklevel`` of the caller's first frame outside this package.

    Args:
        also_skip: directories whose frames are skipped too (e.g. torch's, for a warning raised
            from an optimizer hook, so that it points at the user's ``optimizer.step()``).

    Example:
        >>> from torch_facade.amp import _caller
        >>> _caller.stacklevel() >= 1
        True
    """
    skipped = (_PACKAGE, WRAPPER_DIR, *also_skip)
    frame: types.FrameType | None = sys._getframe(1)
    level = 1
    while frame is not None and os.path.abspath(frame.f_code.co_filename).startswith(skipped):
        frame, level = frame.f_back, level + 1
    return level
