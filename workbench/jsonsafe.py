"""NaN-safe JSON: strict JSON has no NaN or infinity, so undefined numbers are written ``null``."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any


def finite(value: Any) -> Any:
    """``value`` with every non-finite float replaced by ``None``, in dicts, lists and tuples.

    Example:
        >>> from workbench.jsonsafe import finite
        >>> finite({"a": [1.0, float("nan")], "b": (float("inf"), "x")})
        {'a': [1.0, None], 'b': [None, 'x']}
    """
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: finite(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [finite(v) for v in value]
    return value


def write_json(path: Path, value: Any, **dumps: Any) -> Path:
    """Writes ``finite(value)`` to ``path`` as strict JSON (one-space indent, a final newline).

    Args:
        path: the file to write.
        value: what to write.
        **dumps: more arguments of :func:`json.dumps` (e.g. ``default=str``).

    Returns:
        ``path``.

    Example:
        >>> import json, tempfile
        >>> from pathlib import Path
        >>> from workbench.jsonsafe import write_json
        >>> with tempfile.TemporaryDirectory() as folder:
        ...     path = write_json(Path(folder) / "r.json", {"ms": float("nan")})
        ...     json.loads(path.read_text())
        {'ms': None}
    """
    path.write_text(json.dumps(finite(value), indent=1, allow_nan=False, **dumps) + "\n")
    return path
