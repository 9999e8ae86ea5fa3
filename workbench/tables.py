"""Markdown tables and their cells, as every room's report writes them."""

from __future__ import annotations

import math
from collections.abc import Sequence

ALIGNMENTS = ("l", "r")
"""A column's alignment: ``"l"`` (left, ``---``) or ``"r"`` (right, ``---:``)."""


def markdown_table(
    header: Sequence[str], rows: Sequence[Sequence[str]], align: Sequence[str] | None = None
) -> list[str]:
    """The lines of a markdown table: the header, the alignment row, one line per row.

    Args:
        header: the column titles.
        rows: the cells of each row, already text, as many as ``header``.
        align: ``"l"`` or ``"r"`` per column (default: every column left-aligned).

    Returns:
        The table's lines, without a trailing blank line.

    Raises:
        ValueError: ``align`` or a row has another length than ``header``, or an alignment is
            neither ``"l"`` nor ``"r"``.

    Example:
        >>> from workbench.tables import markdown_table
        >>> print("\\n".join(markdown_table(["case", "ms"], [["a", "1.5"]], ["l", "r"])))
        | case | ms |
        |---|---:|
        | a | 1.5 |
    """
    align = ["l"] * len(header) if align is None else list(align)
    if len(align) != len(header):
        raise ValueError(f"align must have one entry per column ({len(header)}); got {len(align)}")
    if bad := [a for a in align if a not in ALIGNMENTS]:
        raise ValueError(f"align entries must be one of {ALIGNMENTS}; got {bad}")
    for i, row in enumerate(rows):
        if len(row) != len(header):
            raise ValueError(f"rows[{i}] must have {len(header)} cells; got {len(row)}")
    lines = ["| " + " | ".join(header) + " |"]
    lines.append("|" + "|".join("---:" if a == "r" else "---" for a in align) + "|")
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return lines


def number(value: float | None) -> str:
    """Three significant digits, without an exponent; ``n/a`` for ``None`` and non-finite values.

    Example:
        >>> from workbench.tables import number
        >>> number(12.345), number(0.012345), number(1234.5), number(float("nan")), number(None)
        ('12.3', '0.0123', '1234', 'n/a', 'n/a')
    """
    if value is None or not math.isfinite(value):  # None: undefined (null in the JSON)
        return "n/a"
    if abs(value) < 1e-9:
        return "0"
    digits = max(0, 2 - math.floor(math.log10(abs(value))))
    return f"{value:.{digits}f}"


def stats_cell(stats: dict[str, float | None], suffix: str = "") -> str:
    """``median [min, max]``, the median followed by ``suffix`` unless it is undefined.

    Example:
        >>> from workbench.tables import stats_cell
        >>> stats_cell({"median": 1.5, "min": 1.0, "max": 2.0}, "x")
        '1.50x [1.00, 2.00]'
        >>> stats_cell({"median": None, "min": None, "max": None}, "x")
        'n/a [n/a, n/a]'
    """
    median = number(stats["median"])
    if median != "n/a":
        median += suffix
    return f"{median} [{number(stats['min'])}, {number(stats['max'])}]"


def yes(flag: bool) -> str:
    """``"yes"`` or ``"no"``.

    Example:
        >>> from workbench.tables import yes
        >>> yes(True), yes(False)
        ('yes', 'no')
    """
    return "yes" if flag else "no"
